"""The user's GPT-J-6B flows on the accelerator this machine has, with random weights: a random checkpoint in the
original slim layout (8 shards, written by one process per shard), then LoRA fine-tuning from it with the one-chip
recipe, sampling in bf16 and int8, and the server's start at the 6B config's context, each stage a child process
whose wall time, peak resident host memory and the figures it logs are emitted as JSON lines (with the commit,
device kind and JAX version in a first record).

Cold start: each stage's record carries when its log first said the runtime was up (`runtime_s`), the weights were
read (`read_s`), the server had sized itself (`sized_s`) and compiled its programs (`compiled_s`), the first
completion was made (`first_token_s`), the server was ready (`ready_s`) and the first training steps were logged
(`first_step_s`), in seconds from the stage's start; and what the compilation cache did. The LoRA, int8 sampling
and serving stages run twice, on an empty compilation cache (`cold`) and again on what that run left (`warm`). A
chip's machine may allow no sockets: the server's stage ends once it is ready (its bind may then fail).

    python bench/chip_flow.py --work /tmp/g6b [--only write,lora,sample_bf16,sample_int8,serve] [--lora-steps 4]
        [--lora-set remat_policy=save_qkv]

With `--model llama2_7b` or `llama3_8b` (bench/suite_parts.py's shapes), the random model is an HF directory
instead (safetensors in bf16, config.json and a word-level tokenizer of the model's vocabulary, written here), which
the sampling and serving stages read with `--hf`; its LoRA step is device_suite.py's `train_lora --model`.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench.bench_6b_flow import PROMPT, WRITE_ORIGINAL  # noqa: E402
from bench.common import emit, write_word_tokenizer  # noqa: E402
from bench.suite_parts import MODELS  # noqa: E402

# device_sample.py with its load time and generation time logged (the tool itself logs only the mesh it chose).
SAMPLE_LOGGED = """
import logging, runpy, sys
logging.basicConfig(level=logging.INFO, format="%(message)s")
sys.argv[0] = "device_sample.py"
runpy.run_path("device_sample.py", run_name="__main__")
"""
STAGES = ("write", "data", "lora", "sample_bf16", "sample_int8", "serve")
# When a stage's log first says what: the seconds from its start are its record's fields.
MARKERS = {"runtime_s": r"inference mesh:|train mesh:", "read_s": r"read [\d.]+ GB of params",
           "sized_s": r"memory per device:", "compiled_s": r"compiled them in", "first_token_s": r"\d+ tokens in",
           "ready_s": r"serving .* slots on http", "first_step_s": r"tok_s="}
CONFIG = "configs/6B_roto_256.json"
LORA_CONFIG = "configs/6B_lora_v5litepod-1.json"


META = """
import json, resource, mesh_transformer, jax
d = jax.devices()[0]
print(json.dumps({"platform": d.platform, "device_kind": d.device_kind, "devices": jax.device_count(),
                  "jax": jax.__version__, "backend_peak_rss_gb": round(resource.getrusage(
                      resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9, 2)}))
"""


def meta() -> dict:
    """The run's first record. JAX starts in a child of its own: a process that holds the chip keeps the stages'
    children off it, and a child forked from a large process reports that process's peak memory as its own. Its
    peak host memory (`backend_peak_rss_gb`) is what the backend alone takes: the stages' peaks include it."""
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                                check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        commit = os.environ.get("MTJ_COMMIT", "unknown")
    devices = subprocess.run([sys.executable, "-c", META], cwd=ROOT, capture_output=True, text=True, check=True)
    return {"bench": "meta", "script": "chip_flow", "commit": commit, **json.loads(devices.stdout.splitlines()[-1]),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}


def stage(name: str, argv: list[str], log_path: str, until: str | None = None, **extra) -> tuple[int, str]:
    """Run one stage as a child process, its output in log_path, ended once a line matches `until`; emit its exit
    status, wall time, peak resident memory (its own rusage) and when each of MARKERS was first logged, with
    `extra`; return (status, output)."""
    start, seen, lines = time.perf_counter(), {}, []
    child = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    with open(log_path, "w") as log:
        for line in iter(child.stdout.readline, ""):  # tqdm's "\r" ends a line too (universal newlines)
            log.write(line)
            lines.append(line)
            for field, pattern in MARKERS.items():
                if field not in seen and re.search(pattern, line):
                    seen[field] = round(time.perf_counter() - start, 1)
            if until and re.search(until, line):
                child.terminate()
                break
    _, status, usage = os.wait4(child.pid, 0)
    output = "".join(lines)
    rc = 0 if until and re.search(until, output) else os.waitstatus_to_exitcode(status)
    record = {"bench": "chip_flow", "stage": name, "rc": rc, "wall_s": round(time.perf_counter() - start, 1),
              "peak_rss_gb": round(usage.ru_maxrss * 1024 / 1e9, 2), **seen, **extra}
    if loaded := re.search(r"read ([\d.]+) GB of params from .* in ([\d.]+) s \((.*)\)", output):
        record.update(params_gb=float(loaded.group(1)), load_s=float(loaded.group(2)), loading=loaded.group(3))
    if tokens := re.search(r"(\d+) tokens in ([\d.]+) s", output):
        record.update(new_tokens=int(tokens.group(1)), generate_s=float(tokens.group(2)))
    if cache := re.search(r"compilation cache .*: (\d+) of (\d+) programs read from it \(([\d.]+) s", output):
        record.update(cache_hits=int(cache.group(1)), cache_requests=int(cache.group(2)),
                      compile_saved_s=float(cache.group(3)))
    if sized := re.search(r"memory per device: (.*)", output):
        record["sized"] = sized.group(1)
    if rc:
        record["error"] = [line for line in output.splitlines() if line.strip()][-3:]
    emit(**record)
    return rc, output


def write_original(step_dir: str, config: str) -> None:
    """The random original-layout checkpoint, one process per shard (the shards' random streams differ)."""
    script = WRITE_ORIGINAL.format(root=ROOT, config=os.path.join(ROOT, config), step_dir=step_dir)
    script = script.replace("rng = np.random.default_rng(0)", "rng = np.random.default_rng(int(sys.argv[1]))")
    script = script.replace("for shard in range(n_shards):", "for shard in [int(sys.argv[1])]:")
    start = time.perf_counter()
    children = [subprocess.Popen([sys.executable, "-c", script, str(shard)], cwd=ROOT,
                                 env={**os.environ, "JAX_PLATFORMS": "cpu"}) for shard in range(8)]
    rcs = [child.wait() for child in children]
    emit(bench="chip_flow", stage="write_original", rc=max(rcs), wall_s=round(time.perf_counter() - start, 1))


def write_random_hf(path: str, model: str, seq: int) -> None:
    """A random HF directory of one of MODELS' shapes at context `seq`: bf16 safetensors (matrices spread 0.02, norms
    ones), its family's config.json, and a word-level tokenizer of the whole vocabulary ("w3 w4 ..."; <s> 1, </s> 2,
    prepended BOS), config.json last."""
    import ml_dtypes
    import numpy as np
    from mesh_transformer import config
    from mesh_transformer.store import hf, safetensors_io

    start = time.perf_counter()
    cfg = config.from_dict({**MODELS[model], "seq": seq, "cores_per_replica": 1})
    os.makedirs(path, exist_ok=True)
    # Matrices are windows of one pool of random values (drawing 7 billion would take minutes).
    pool = (np.random.default_rng(0).standard_normal(1 << 26, np.float32) * 0.02).astype(ml_dtypes.bfloat16)
    entries = [(entry.name, entry.shape, np.dtype(ml_dtypes.bfloat16)) for entry in hf.hf_layout(cfg)]

    def arrays():
        for i, (name, shape, dtype) in enumerate(entries):
            if len(shape) == 1:
                yield name, np.ones(shape, dtype)
            else:
                yield name, np.resize(np.roll(pool, 7919 * i), shape)

    safetensors_io.write_dir(path, entries, arrays(), 5 * 10 ** 9)
    write_word_tokenizer(path, {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, cfg.n_vocab)}})
    with open(f"{path}/config.json", "w") as f:
        json.dump({**hf.hf_config(cfg), "torch_dtype": "bfloat16", "bos_token_id": 1, "eos_token_id": 2}, f)
    gb = sum(os.path.getsize(os.path.join(path, name)) for name in os.listdir(path)) / 1e9
    emit(bench="chip_flow", stage=f"write_hf_{model}", rc=0, gb=round(gb, 2),
         wall_s=round(time.perf_counter() - start, 1))


def lora_metrics(model_dir: str) -> dict:
    """The LoRA run's logged tokens/s (median over the steps after the first two) and losses."""
    path = os.path.join(model_dir, "metrics.jsonl")
    if not os.path.exists(path):
        return {}
    rows = [json.loads(line) for line in open(path)]
    rates = sorted(r["tokens_per_s"] for r in rows if "tokens_per_s" in r and r.get("step", 0) > 2)
    losses = [round(r["loss"], 4) for r in rows if "loss" in r]
    return {"tokens_per_s_median": rates[len(rates) // 2] if rates else None, "losses": losses}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", required=True, help="a directory with ~15 GB free")
    parser.add_argument("--only", default=",".join(STAGES), help=f"stages of {','.join(STAGES)}")
    parser.add_argument("--lora-steps", type=int, default=4)
    parser.add_argument("--config", default=CONFIG, help=f"the model (default {CONFIG})")
    parser.add_argument("--lora-config", default=LORA_CONFIG, help=f"the LoRA recipe (default {LORA_CONFIG})")
    parser.add_argument("--lora-set", action="append", default=[], metavar="KEY=VALUE",
                        help="a config key of the LoRA run, for an A/B (remat_policy=save_qkv, ...; repeatable)")
    parser.add_argument("--seq", type=int, default=2048, help="the training data's sequence length")
    parser.add_argument("--logs", default=None, help="where each stage's output goes (default: --work)")
    parser.add_argument("--model", choices=tuple(MODELS), default="gptj_6b",
                        help="gptj_6b (default): the original checkpoint; another: a random HF directory")
    parser.add_argument("--prompt-tokens", type=int, default=None,
                        help="the sampling stages' prompt in tokens (an HF model's words; default: a sentence)")
    parser.add_argument("--new-tokens", type=int, default=64, help="the sampling stages' new tokens (default 64)")
    args = parser.parse_args()
    stages = args.only.split(",")
    if args.model != "gptj_6b" and {"lora", "data"} & set(stages):
        parser.error("an HF model's flow has the stages write, sample_bf16, sample_int8 and serve (its LoRA step: "
                     "bench/device_suite.py --only train_lora --model ...)")
    work = os.path.abspath(args.work)
    logs = os.path.abspath(args.logs or work)
    os.makedirs(work, exist_ok=True)
    os.makedirs(logs, exist_ok=True)
    original, data = f"{work}/original/step_1", f"{work}/data"
    emit(**meta())
    py = sys.executable
    hf_dir = None if args.model == "gptj_6b" else f"{work}/{args.model}"
    if "write" in stages:
        if hf_dir:
            write_random_hf(hf_dir, args.model, args.seq)
        else:
            write_original(original, args.config)
    if "data" in stages:
        stage("demo_corpus", [py, "demo_corpus.py", f"{work}/corpus", "--train-bytes", "2000000"], f"{logs}/corpus.log")
        stage("tfrecords", [py, "create_finetune_tfrecords.py", f"{work}/corpus/train", "train", "--output-dir", data,
                            "--seq", str(args.seq)], f"{logs}/tfrecords.log")
    cache = f"{work}/compilation_cache"

    def cold_and_warm(name: str, argv: list[str], until: str | None = None) -> None:
        """The stage on an empty compilation cache, then again on what that run left in it."""
        subprocess.run(["rm", "-rf", cache])
        for run in ("cold", "warm"):
            stage(f"{name}_{run}", [*argv, "--compilation-cache", cache], f"{logs}/{name}_{run}.log", until=until)

    if "lora" in stages:
        model_dir = f"{work}/lora"
        subprocess.run(["rm", "-rf", cache])
        for run in ("cold", "warm"):
            subprocess.run(["rm", "-rf", model_dir])
            stage(f"lora_train_from_original_{run}", [
                py, "device_train.py", "--config", args.lora_config, "--tune-model-path", original, "--set",
                f"train_set={data}/train.index", "--set", f"model_dir={model_dir}", "--set",
                f"total_steps={args.lora_steps}", "--set", f"ckpt_every={args.lora_steps}", "--set",
                "wandb_project=null", *[word for item in args.lora_set for word in ("--set", item)],
                "--compilation-cache", cache], f"{logs}/lora_{run}.log")
        emit(bench="chip_flow", stage="lora_metrics", config=args.lora_config, lora_set=args.lora_set,
             **lora_metrics(model_dir))
    source = ["--hf", hf_dir] if hf_dir else ["--ckpt", original, "--config", args.config]
    origin = f"hf_{args.model}" if hf_dir else "original"
    prompt = " ".join(f"w{3 + i}" for i in range(args.prompt_tokens - 1)) if args.prompt_tokens else PROMPT
    sample = [py, "-c", SAMPLE_LOGGED, *source, "--prompt", prompt, "--max-new-tokens", str(args.new_tokens),
              "--temperature", "0"]
    if "sample_bf16" in stages:
        stage(f"sample_bf16_from_{origin}", [*sample, "--dtype", "bf16"], f"{logs}/sample_bf16.log")
    if "sample_int8" in stages:
        cold_and_warm(f"sample_int8_from_{origin}", [*sample, "--dtype", "int8"])
    if "serve" in stages:  # the 6B config's context, pages by default, every program compiled before it listens
        serve = [py, "device_serve.py", *source, "--dtype", "int8",
                 "--kv-cache-dtype", "int8", "--max-batch", "64", "--warm-up", "--port", "0"]
        cold_and_warm("serve_int8", serve, until=MARKERS["ready_s"])
        stage("serve_refused", [*serve, "--kv-pages", "100000"], f"{logs}/serve_refused.log")


if __name__ == "__main__":
    main()
