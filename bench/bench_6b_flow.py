"""The released-weights flow at full GPT-J-6B size, with random weights: original slim layout -> 1 shard -> sample ->
HF export -> transformers, and int8 (slim_model.py --dtype int8, sampled), each stage a child process whose wall time
and peak resident memory are reported.

The script writes a random checkpoint in the original slim layout itself (8 shards, bf16 stored as numpy 'V2', as
the released step_383500 is), then runs the user's commands on it. Needs about 40 GB of disk under --work and
about 14 GB of memory; it is a benchmark, not a test.

    python bench/bench_6b_flow.py --work /tmp/gptj6b [--config configs/6B_roto_256.json] [--keep | --reuse]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench.common import emit  # noqa: E402

PROMPT = "The quick brown fox"
MAX_NEW = 4
WRITE_ORIGINAL = """
import sys
import ml_dtypes, numpy as np
sys.path.insert(0, {root!r})
from mesh_transformer import config
from mesh_transformer.store import mtj_v1
cfg, step_dir, n_shards = config.load({config!r}), {step_dir!r}, 8
D, F, V, L = cfg.d_model, cfg.d_ff, cfg.n_vocab, cfg.layers
rng = np.random.default_rng(0)
prefix = "causal_transformer_shard/~/"

def rand(*shape, scale=0.02):
    return (rng.standard_normal(shape, np.float32) * scale).astype(ml_dtypes.bfloat16)

def shard_leaves():
    leaves = {{"embedding_shard/~/linear/w": rand(V // n_shards, D), "embedding_shard/~/linear/b": rand(D),
              "projection_shard/~/linear/w": rand(D, V // n_shards), "projection_shard/~/linear/b": rand(V // n_shards),
              "projection_shard/~/replicated_layer_norm/scale": np.ones(D, ml_dtypes.bfloat16),
              "projection_shard/~/replicated_layer_norm/offset": rand(D)}}
    for i in range(L):
        cols, rows = (D, D // n_shards), (D // n_shards, D)
        for module, shape in [("linear", cols), ("linear_1", cols), ("linear_2", cols), ("linear_3", rows),
                              ("linear_4", (D, F // n_shards)), ("linear_5", (F // n_shards, D))]:
            leaves[f"layer_{{i}}/~/{{module}}/w"] = rand(*shape)
        leaves[f"layer_{{i}}/~/linear_4/b"] = rand(F // n_shards)
        leaves[f"layer_{{i}}/~/linear_5/b"] = rand(D)
        leaves[f"layer_{{i}}/~/replicated_layer_norm/scale"] = np.ones(D, ml_dtypes.bfloat16)
        leaves[f"layer_{{i}}/~/replicated_layer_norm/offset"] = rand(D)
    return {{prefix + k: v for k, v in leaves.items()}}

import os
for shard in range(n_shards):
    leaves = shard_leaves()
    flat = [leaves[n].view("V2") for n in sorted(leaves, key=lambda n: tuple(n.rsplit("/", 1)))] + [np.int32(1)]
    os.makedirs(f"{{step_dir}}/shard_{{shard}}", exist_ok=True)
    k, m = divmod(len(flat), mtj_v1.N_FILES)
    for f in range(mtj_v1.N_FILES):
        with open(f"{{step_dir}}/shard_{{shard}}/{{f}}.npz", "wb") as out:
            np.savez(out, *flat[f * k + min(f, m):(f + 1) * k + min(f + 1, m)])
    del leaves, flat
"""
HF_GENERATE = """
import json, sys, torch
from transformers import AutoTokenizer, GPTJForCausalLM
model = GPTJForCausalLM.from_pretrained({hf!r}, torch_dtype=torch.bfloat16).eval()
tokenizer = AutoTokenizer.from_pretrained({hf!r})
ids = tokenizer({prompt!r}, return_tensors="pt").input_ids
with torch.no_grad():
    out = model.generate(ids, max_new_tokens={max_new}, do_sample=False, pad_token_id=0)
    # Our tokens, teacher-forced through HF: where HF's greedy choice differs, by how much HF prefers its own.
    ours = tokenizer({prompt!r} + {ours!r}, return_tensors="pt").input_ids
    logits = model(ours).logits[0, ids.shape[1] - 1:-1].float()
top2 = logits.topk(2, -1).values
chosen = logits.gather(-1, ours[0, ids.shape[1]:, None])[:, 0]
print(tokenizer.decode(out[0, ids.shape[1]:]))
print(json.dumps({{"ours_top1_under_hf": (chosen == top2[:, 0]).tolist(),
                  "hf_prefers_its_own_by": [round(x, 4) for x in (top2[:, 0] - chosen).tolist()],
                  "hf_top1_top2_gap": [round(x, 4) for x in (top2[:, 0] - top2[:, 1]).tolist()],
                  "logit_std": round(logits.std().item(), 3)}}))
"""


def stage(name: str, argv: list[str], env: dict | None = None, bench: str = "gptj6b_flow",
          bytes_of: int | None = None, peaks: dict | None = None) -> str:
    """Run one stage as a child process; emit its wall time and peak resident memory (its own rusage; with
    `bytes_of`, also as a multiple of those bytes: the weights'; into `peaks` under its name); return its standard
    output."""
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        start = time.perf_counter()
        child = subprocess.Popen(argv, cwd=ROOT, stdout=out, stderr=err, text=True, env={**os.environ, **(env or {})})
        _, status, usage = os.wait4(child.pid, 0)
        child.returncode = os.waitstatus_to_exitcode(status)
        peak = usage.ru_maxrss * 1024
        if peaks is not None:
            peaks[name] = peak
        emit(bench=bench, stage=name, rc=child.returncode, wall_s=round(time.perf_counter() - start, 1),
             peak_rss_gb=round(peak / 1e9, 2), **({} if bytes_of is None else {"peak_over": round(peak / bytes_of, 3)}))
        out.seek(0)
        err.seek(0)
        if child.returncode:
            sys.stderr.write(err.read()[-4000:])
            raise SystemExit(f"stage {name} failed")
        return out.read()


def _log_time_s(log: str, text: str) -> float | None:
    """The asctime of the first log line holding `text`, as seconds since the epoch."""
    for line in log.splitlines():
        if text in line and line[:4].isdigit():
            return time.mktime(time.strptime(line[:19], "%Y-%m-%d %H:%M:%S"))
    return None


def serve_warm_up(argv: list[str], limit_s: float) -> None:
    """Start the server with --warm-up, time it until it listens (at most limit_s), then stop it; emit the load
    and compile times, the programs it compiles, its peak resident memory, and how it ended where it exited by
    itself (its exit status and last log line)."""
    with tempfile.TemporaryFile("w+") as err:
        start = time.perf_counter()
        child = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=err, text=True)
        log, ready_s, ended = "", None, None
        while ended is None and ready_s is None and time.perf_counter() - start < limit_s:
            time.sleep(1)  # polling a log file for a line; nothing is timed by the sleep itself
            pid, status, usage = os.wait4(child.pid, os.WNOHANG)
            ended = (status, usage) if pid else None
            err.seek(0)
            log = err.read()
            if "serving " in log:
                ready_s = time.perf_counter() - start
        if ended is None:
            child.terminate()
            _, status, usage = os.wait4(child.pid, 0)
        else:
            status, usage = ended
        child.returncode = os.waitstatus_to_exitcode(status)
        programs = [line.split("compiling ", 1)[1] for line in log.splitlines() if "compiling " in line]
        started, compiling, ready = (_log_time_s(log, text) for text in ("inference mesh", "compiling ", "serving "))
        emit(bench="gptj6b_flow", stage="serve_warm_up", args=" ".join(argv[2:]),
             ready_s=round(ready_s, 1) if ready_s else None,
             not_ready_after_s=None if ready_s else round(time.perf_counter() - start, 1),
             programs=programs[0] if programs else None,
             load_s=compiling - started if started and compiling else None,
             warm_up_s=ready - compiling if ready and compiling else None,
             peak_rss_gb=round(usage.ru_maxrss * 1024 / 1e9, 2),
             exited_by_itself=None if ended is None else {"rc": child.returncode,
                                                          "last_line": log.strip().splitlines()[-1][:200]})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", required=True, help="a directory with ~40 GB free")
    parser.add_argument("--config", default="configs/6B_roto_256.json")
    parser.add_argument("--keep", action="store_true", help="keep the files written")
    parser.add_argument("--reuse", action="store_true", help="keep the files, and skip writing and resharding where "
                                                             "a kept run's files are there")
    parser.add_argument("--warm-up-limit-s", type=float, default=900, help="give up on the server's warm-up after "
                                                                            "this long (default 900)")
    parser.add_argument("--serve-max-batch", type=int, default=4, help="the server's slots (default 4: with 8, the "
                        "KV cache and the warm-up's 52 programs outgrew a 24 GB host)")
    args = parser.parse_args()
    work = os.path.abspath(args.work)
    original, one, hf_dir = f"{work}/original/step_1", f"{work}/one", f"{work}/hf"
    os.makedirs(work, exist_ok=True)
    config = os.path.join(ROOT, args.config)
    py = sys.executable
    try:
        if not (args.reuse and os.path.isdir(one)):
            stage("write_original_slim", [py, "-c", WRITE_ORIGINAL.format(root=ROOT, config=config,
                                                                          step_dir=original)])
            stage("reshard_to_1", [py, "resharding_example.py", "--input-ckpt", original, "--config", config,
                                   "--output-ckpt", one, "--cores-per-replica", "1", "--slim", "--dtype", "bf16"])
        sample = [py, "device_sample.py", "--ckpt", one, "--dtype", "bf16", "--prompt", PROMPT, "--max-new-tokens",
                  str(MAX_NEW), "--temperature", "0"]
        ours_text = stage("sample_bf16", sample)
        # The CLIs restart with glibc malloc keeping freed memory; opted out, a transient load peak is returned.
        stage("sample_bf16_malloc_default", sample, env={"GLIBC_TUNABLES": ""})
        int8 = f"{work}/int8"  # the layers' matrices in int8 (slim_model.py --dtype int8), read back as int8
        if not (args.reuse and os.path.isdir(int8)):
            stage("slim_int8", [py, "slim_model.py", "--input-ckpt", one, "--config", f"{one}/config.json",
                                "--output-ckpt", int8, "--dtype", "int8"])
        int8_sample = [py, "device_sample.py", "--ckpt", int8, "--dtype", "int8", *sample[6:]]
        stage("sample_int8", int8_sample)
        stage("sample_int8_quantize_head", [*int8_sample, "--quantize-head"])
        stage("sample_int8_quantized_while_loading", [*sample[:4], "--dtype", "int8", *sample[6:]])
        serve_warm_up([py, "device_serve.py", "--ckpt", one, "--dtype", "bf16", "--warm-up", "--port", "0",
                       "--max-batch", str(args.serve_max_batch)], args.warm_up_limit_s)
        shutil.rmtree(f"{work}/original", ignore_errors=True)
        stage("export_hf", [py, "to_hf_weights.py", "--input-ckpt", one, "--config", config, "--output-path",
                            hf_dir, "--dtype", "bf16"])
        ours_text = ours_text.rstrip("\n")
        hf_out = stage("hf_transformers_generate", [py, "-c", HF_GENERATE.format(hf=hf_dir, prompt=PROMPT,
                                                                             max_new=MAX_NEW, ours=ours_text)])
        hf_text, teacher_forced = hf_out.rstrip("\n").rsplit("\n", 1)
        emit(bench="gptj6b_flow", stage="compare", ours=json.dumps(ours_text), hf=json.dumps(hf_text),
             greedy_text_equal=ours_text == hf_text, model_bf16_gb=round(_model_bytes(config) / 1e9, 2),
             **json.loads(teacher_forced))
    finally:
        if not (args.keep or args.reuse):
            shutil.rmtree(work, ignore_errors=True)


def _model_bytes(config_path: str) -> int:
    from mesh_transformer import config
    from mesh_transformer.model import table

    cfg = config.load(config_path)
    return sum(int(np.prod(s.shape)) * 2 for s in __import__("jax").tree.leaves(table.param_shapes(cfg)))


if __name__ == "__main__":
    main()
