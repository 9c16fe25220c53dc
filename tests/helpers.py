"""Helpers shared by tests of several subpackages: scripts run as a user would, tiny models and their checkpoints in
each format, the trainer tests' runs, the evaluation tests' tasks. torch, transformers and the store's I/O are
imported where used, so a test that needs none of them does not pay their import."""
from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator

import jax
import ml_dtypes
import numpy as np

from mesh_transformer.model import lora, table
from mesh_transformer import config
from mesh_transformer.parallel.layout import Layout, make_layout
from mesh_transformer.parallel.mesh import make_dp_mp, make_mesh
from mesh_transformer.platforms import for_platform
from mesh_transformer.store import hf

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CPU_POLICY = for_platform("cpu")  # the platform policy of the tests' devices, for model code called without a Layout


# ---- scripts and child processes ----

def run_script(script: str, *args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    """Runs one of the top-level command-line scripts as a user would, from the repository root, with glibc's
    tunables already as the scripts' CPU restart sets them: the restart is tested in tests/test_platforms.py, and here
    it would only start each script twice (a benchmark imports JAX and torch before it restarts)."""
    from mesh_transformer.platforms import KEEP_HOST_MEMORY

    env = {**os.environ, "GLIBC_TUNABLES": os.environ.get("GLIBC_TUNABLES", KEEP_HOST_MEMORY)}
    return subprocess.run([sys.executable, script, *args], cwd=REPO_ROOT, input=stdin, capture_output=True,
                          text=True, env=env)


def run_scripts(*calls: tuple[str, ...]) -> list[subprocess.CompletedProcess]:
    """`run_script` for each (script, *args), a few at once: each is mostly one interpreter's start-up and
    compiles, which leave the second core idle."""
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        return list(pool.map(lambda call: run_script(*call), calls))


def run_driver(args: list[str], env_extra: dict[str, str] | None = None, **popen) -> subprocess.Popen:
    """device_train.py's main started through tests/train_driver.py, which can stall a checkpoint write for a kill."""
    env = {**os.environ, **(env_extra or {})}
    return subprocess.Popen([sys.executable, os.path.join(REPO_ROOT, "tests", "train_driver.py"), *args],
                            cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            **popen)


def wait_for(predicate: Callable[[], bool], proc: subprocess.Popen, timeout_s: float = 240) -> None:
    """Polls `predicate` until it holds; fails with the child's stderr if the child exits first."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert proc.poll() is None, proc.communicate()[1][-2000:]
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


# ---- tiny models: random params, HF models, layouts ----

# The fine-tuning and trainer tests' model shape (seq and the parallel layout come with each run's config).
TINY_SHAPE = {"layers": 2, "d_model": 32, "n_heads": 4, "n_vocab": 128, "pe_rotary_dims": 4}
TINY_NEOX_SHAPE = {**TINY_SHAPE, "family": "gptneox", "rotary_base": 500.0}  # rotary on half of each head of 8


def random_params(cfg: config.Config, seed: int) -> dict:
    """Random f32 params with every leaf nonzero (LayerNorms and biases too), so each one counts."""
    rng = np.random.default_rng(seed)
    return jax.tree.map(lambda s: (rng.normal(size=s.shape) * 0.2).astype(np.float32), table.param_shapes(cfg))


def random_hf_model(cfg: config.Config, seed: int = 0):
    """HF's model of the config's family (GPT-J, GPT-NeoX; eager attention) with every parameter random, LayerNorms
    and biases too."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    keys = hf.hf_config(cfg)
    hf_config = AutoConfig.for_model(keys["model_type"], **{k: v for k, v in keys.items() if k != "model_type"})
    hf_config._attn_implementation = "eager"
    hf_model = AutoModelForCausalLM.from_config(hf_config).eval()
    with torch.no_grad():  # HF's init leaves LayerNorms at 1/0 and biases at 0: randomize all so each one counts
        for p in hf_model.parameters():
            p.copy_(torch.randn_like(p) * 0.2)
    return hf_model


def state_dict_numpy(hf_model) -> dict[str, np.ndarray]:
    """An HF model's state dict as numpy arrays."""
    return {k: v.detach().numpy() for k, v in hf_model.state_dict().items()}


def random_hf_dir(tmp_path, cfg: config.Config, name: str = "hf", seed: int = 0) -> tuple[str, object]:
    """(directory, model): a `random_hf_model` saved as safetensors under tmp_path/name (n_positions past seq: the
    loss reads seq + 1 tokens)."""
    model = random_hf_model(dataclasses.replace(cfg, seq=cfg.seq + 1), seed)
    path = str(tmp_path / name)
    model.save_pretrained(path, safe_serialization=True)
    return path, model


def write_hf_dir(directory: str, params: dict, cfg: config.Config) -> str:
    """Our params as an HF GPT-J directory (f32 safetensors, config.json, GPT-2 tokenizer files)."""
    from safetensors.numpy import save_file

    from mesh_transformer.tokenizer import load_tokenizer

    os.makedirs(directory, exist_ok=True)
    state = {k: np.ascontiguousarray(v, np.float32) for k, v in hf.params_to_hf(params, cfg).items()}
    save_file(state, os.path.join(directory, "model.safetensors"))
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump({**hf.hf_config(cfg), "torch_dtype": "float32"}, f)
    load_tokenizer().save_pretrained(directory)
    return directory


def layout_of(cfg: config.Config, spec: tuple) -> Layout:
    """The Layout a test's mesh spec names: ("shard_map", dp, mp) or (parallelism, data, fsdp, tensor)."""
    mode, *sizes = spec
    if mode == "shard_map":
        return make_layout(dataclasses.replace(cfg, cores_per_replica=sizes[1]), mesh=make_dp_mp(*sizes))
    return make_layout(dataclasses.replace(cfg, parallelism=mode),
                       mesh=make_mesh(dict(zip(("data", "fsdp", "tensor"), sizes))))


# ---- original mesh-transformer-jax checkpoints, built from the layout facts ----

MTJ_CFG = config.load("configs/tiny_rot_partial.json", ["cores_per_replica=1"])  # 2 layers, D 64, 8 heads, V 256
MTJ_ROOT = "causal_transformer_shard/~/"  # the haiku module every leaf name starts with
BF16 = np.dtype(ml_dtypes.bfloat16)


def original_shards(params: dict, cfg: config.Config, n_shards: int,
                    rng: np.random.Generator) -> list[dict[str, np.ndarray]]:
    """Per-shard haiku leaves of our global params: heads/MLP/vocab split, per-shard biases that sum to ours."""
    shards: list[dict[str, np.ndarray]] = [{} for _ in range(n_shards)]

    def put(name, pieces):
        for shard, piece in zip(shards, pieces):
            shard[MTJ_ROOT + name] = np.ascontiguousarray(piece)

    def split(x, axis):
        return np.split(x, n_shards, axis=axis)

    def summing_parts(total):  # random per-shard parts whose sum is `total`, as the original's per-shard biases
        parts = [rng.normal(size=total.shape).astype(np.float32) * 0.1 for _ in range(n_shards - 1)]
        return [*parts, total - sum(parts)]

    put("embedding_shard/~/linear/w", split(params["embed"]["wte"], 0))
    put("embedding_shard/~/linear/b", summing_parts(rng.normal(size=cfg.d_model).astype(np.float32)))
    put("projection_shard/~/linear/w", split(params["lm_head"]["kernel"], 1))
    put("projection_shard/~/linear/b", split(params["lm_head"]["bias"], 0))
    put("projection_shard/~/replicated_layer_norm/scale", [params["ln_f"]["scale"]] * n_shards)
    put("projection_shard/~/replicated_layer_norm/offset", [params["ln_f"]["bias"]] * n_shards)
    layers = params["layers"]
    for i in range(cfg.layers):
        for module, array, axis in [("linear", layers["attn"]["q"], 1), ("linear_1", layers["attn"]["v"], 1),
                                    ("linear_2", layers["attn"]["k"], 1), ("linear_3", layers["attn"]["out"], 0),
                                    ("linear_4", layers["mlp"]["fc_in"]["kernel"], 1),
                                    ("linear_5", layers["mlp"]["fc_out"]["kernel"], 0)]:
            put(f"layer_{i}/~/{module}/w", split(array[i], axis))
        put(f"layer_{i}/~/linear_4/b", split(layers["mlp"]["fc_in"]["bias"][i], 0))
        put(f"layer_{i}/~/linear_5/b", summing_parts(layers["mlp"]["fc_out"]["bias"][i]))
        put(f"layer_{i}/~/replicated_layer_norm/scale", [layers["ln_1"]["scale"][i]] * n_shards)
        put(f"layer_{i}/~/replicated_layer_norm/offset", [layers["ln_1"]["bias"][i]] * n_shards)
    return shards


def write_mtj_v1(step_dir: str, shards: list[dict[str, np.ndarray]], step: int, full: bool) -> None:
    """The original's files: sorted leaves (+ optimizer leaves first when full, + step last) in 16 npz chunks."""
    from mesh_transformer.store import mtj_v1

    for i, leaves in enumerate(shards):
        params = [leaves[name] for name in sorted(leaves, key=lambda n: tuple(n.rsplit("/", 1)))]
        if full:  # optax chain state: adam count, mu and nu per param, schedule count
            opt = [np.int32(step), *[np.ones_like(p) for p in params], *[np.full_like(p, 2) for p in params],
                   np.int32(step)]
        flat = (opt if full else []) + params + [np.int32(step)]
        flat = [a.view("V2") if a.dtype == BF16 else a for a in flat]  # how numpy saved jax's bfloat16
        os.makedirs(f"{step_dir}/shard_{i}", exist_ok=True)
        k, m = divmod(len(flat), mtj_v1.N_FILES)
        for f in range(mtj_v1.N_FILES):
            with open(f"{step_dir}/shard_{i}/{f}.npz", "wb") as out:
                np.savez(out, *flat[f * k + min(f, m):(f + 1) * k + min(f + 1, m)])


def _expected_params(params: dict, shards: list[dict], dtype: np.dtype) -> dict:
    """What the reader must give: the embedding bias folded into wte and fc_out biases summed (f32, then `dtype`)."""
    def total(name):
        return sum(s[MTJ_ROOT + name].astype(np.float32) for s in shards)

    out = jax.tree.map(lambda x: x.astype(dtype).astype(np.float32), params)
    wte = params["embed"]["wte"].astype(dtype).astype(np.float32) + total("embedding_shard/~/linear/b")
    out["embed"]["wte"] = wte.astype(dtype).astype(np.float32)
    out["layers"]["mlp"]["fc_out"]["bias"] = np.stack(
        [total(f"layer_{i}/~/linear_5/b").astype(dtype).astype(np.float32) for i in range(MTJ_CFG.layers)])
    return out


def make_checkpoint(tmp_path, n_shards: int, dtype: np.dtype, full: bool, step: int = 383500) -> tuple[str, dict]:
    """An original-layout checkpoint of MTJ_CFG under tmp_path/model/step_{step}; returns (step dir, the params a
    reader must give)."""
    params = random_params(MTJ_CFG, seed=n_shards)
    shards = original_shards(params, MTJ_CFG, n_shards, np.random.default_rng(0))
    shards = [{k: v.astype(dtype) for k, v in s.items()} for s in shards]
    step_dir = str(tmp_path / "model" / f"step_{step}")
    write_mtj_v1(step_dir, shards, step, full)
    return step_dir, _expected_params(params, shards, dtype)


# ---- the trainer tests' runs ----

_RUN_SEQ = 16


def write_dataset(directory: str, name: str = "train", n_records: int = 64, seed: int = 0) -> str:
    """Random-token records of TINY_SHAPE's vocabulary as one TFRecord file and its index; returns the index."""
    from mesh_transformer.store import tfrecord

    rng = np.random.default_rng(seed)
    path = os.path.join(directory, f"{name}_0_{n_records}.tfrecords")
    tfrecord.write_records(path, [tfrecord.encode_example({"text": rng.integers(0, 128, _RUN_SEQ + 1)})
                                  for _ in range(n_records)])
    index = os.path.join(directory, f"{name}.index")
    with open(index, "w") as f:
        f.write(os.path.basename(path) + "\n")
    return index


def make_config(tmp_path, **overrides) -> config.Config:
    """A 6-step run of TINY_SHAPE on dp 2 x mp 4 (checkpoints and validation every 3 steps), its data written
    under tmp_path."""
    raw = {**TINY_SHAPE, "seq": _RUN_SEQ, "cores_per_replica": 4, "per_replica_batch": 2,
           "gradient_accumulation_steps": 2, "warmup_steps": 2, "anneal_steps": 20, "lr": 1e-2, "end_lr": 1e-3,
           "total_steps": 6, "ckpt_every": 3, "val_every": 3, "val_batches": 2, "keep_every": 1000, "remat": False,
           "model_dir": str(tmp_path / "run"), "train_set": write_dataset(str(tmp_path)),
           "val_set": {"held": write_dataset(str(tmp_path), "val", 8, 1)}}
    raw.update(overrides)
    return config.from_dict(raw)


def save_config(tmp_path, cfg: config.Config) -> str:
    """`cfg` as tmp_path/config.json, for a script's --config."""
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg.to_dict()))
    return str(path)


def train_losses(model_dir: str) -> dict[int, float]:
    """step -> training loss, from a run's metrics log."""
    from mesh_transformer.train.metrics import read_metrics

    return {row["step"]: row["loss"] for row in read_metrics(model_dir) if "loss" in row}


# ---- the evaluation tests' tasks and model ----

# lm-eval tasks the tests write: a multiple-choice one, a perplexity one, a generation one with stop strings.
_MC_DOCS = [{"question": f"Q{i}: which word follows '{w}'?", "choices": [" the", " a", f" {w}", " end of it"],
             "answer": i % 4} for i, w in enumerate(["cat", "dog", "sun", "sea", "red", "one"])]
_PPL_DOCS = [{"text": " ".join(["the quick brown fox jumps over the lazy dog"] * (1 + 3 * i))} for i in range(3)]
_GEN_DOCS = [{"question": f"Say {w}:", "answer": f" {w}"} for w in ["yes", "no", "maybe", "ok"]]
_TASK_YAML = {
    "tiny_mc": "output_type: multiple_choice\ndoc_to_text: '{{question}}'\ndoc_to_choice: '{{choices}}'\n"
               "doc_to_target: '{{answer}}'\nmetric_list:\n  - metric: acc\n  - metric: acc_norm\n",
    "tiny_ppl": "output_type: loglikelihood_rolling\ndoc_to_text: ''\ndoc_to_target: '{{text}}'\nmetric_list:\n"
                "  - metric: word_perplexity\n  - metric: byte_perplexity\n  - metric: bits_per_byte\n",
    "tiny_gen": "output_type: generate_until\ndoc_to_text: '{{question}}'\ndoc_to_target: '{{answer}}'\n"
                "generation_kwargs:\n  until: ['e', 'o']\n  max_gen_toks: 6\n  do_sample: false\n"
                "metric_list:\n  - metric: exact_match\n",
}
TASKS = tuple(_TASK_YAML)


def write_tasks(directory: str) -> str:
    """The test tasks as JSONL data + YAML configs under `directory` (for lm-eval's include_path)."""
    os.makedirs(directory, exist_ok=True)
    for name, docs in zip(TASKS, (_MC_DOCS, _PPL_DOCS, _GEN_DOCS)):
        data = os.path.join(directory, f"{name}.jsonl")
        with open(data, "w") as f:
            f.writelines(json.dumps(doc) + "\n" for doc in docs)
        with open(os.path.join(directory, f"{name}.yaml"), "w") as f:
            f.write(f"task: {name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\n"
                    f"  cache_dir: {os.path.join(directory, 'cache')}\ntest_split: test\n{_TASK_YAML[name]}")
    return directory


# The evaluation tests' tiny model: GPT-2's vocabulary padded to divide 4 shards, a context of 64 tokens.
EVAL_CFG_DICT = {"layers": 2, "d_model": 32, "n_heads": 4, "n_vocab": 50304, "pe_rotary_dims": 4, "seq": 64,
                 "cores_per_replica": 4, "remat": False}
EVAL_OPTIONS = {"log_samples": True, "bootstrap_iters": 0, "batch_size": 4}


EVAL_CFG = config.from_dict(EVAL_CFG_DICT)


def random_eval_params(cfg=EVAL_CFG, seed: int = 0) -> dict:
    """Random weights made with numpy (nothing to compile), large enough that the argmax is rarely a near-tie."""
    rng = np.random.default_rng(seed)

    def leaf(path, shape):
        name = jax.tree_util.keystr(path)
        if "scale" in name:
            return np.ones(shape.shape, np.float32)
        return (rng.standard_normal(shape.shape) * (0.05 if "bias" in name else 0.2)).astype(np.float32)

    return jax.tree_util.tree_map_with_path(leaf, table.param_shapes(cfg))


def per_sample(results: dict) -> dict:
    """task -> [(doc_id, filtered response)] in doc order, from lm-eval results with log_samples."""
    return {task: [(s["doc_id"], s["filtered_resps"]) for s in sorted(samples, key=lambda s: s["doc_id"])]
            for task, samples in results["samples"].items()}


def assert_same_eval(ours: dict, ref: dict, rolling_docs=None) -> None:
    """Per-sample log-likelihoods within 1e-4, generations and accuracies exactly; `rolling_docs` limits the
    perplexity docs compared."""
    a, b = per_sample(ours), per_sample(ref)
    for task in TASKS:
        for (doc_a, resp_a), (doc_b, resp_b) in zip(a[task], b[task], strict=True):
            assert doc_a == doc_b
            if task == "tiny_gen":
                assert resp_a == resp_b
            elif task == "tiny_mc":
                np.testing.assert_allclose([r[0] for r in resp_a], [r[0] for r in resp_b], atol=1e-4, rtol=0)
                assert [r[1] for r in resp_a] == [r[1] for r in resp_b]
            elif rolling_docs is None or doc_a in rolling_docs:
                np.testing.assert_allclose(resp_a, resp_b, atol=1e-4, rtol=0)
    for task in ("tiny_mc", "tiny_gen"):
        metrics = {k: v for k, v in ours["results"][task].items() if k.startswith(("acc", "exact_match"))}
        assert metrics and metrics == {k: ref["results"][task][k] for k in metrics}, task


# ---- the chat and metrics tests' server ----

@contextlib.contextmanager
def tiny_server(**app_kwargs) -> Iterator[str]:
    """The URL of an HTTP server on 127.0.0.1 over a serving engine of EVAL_CFG's model with random weights (EOS
    made impossible, so completions run to max_tokens), on 4 devices (dp 2 x mp 2), 4 slots."""
    from mesh_transformer.infer.params import make_inference_layout
    from mesh_transformer.serve import server
    from mesh_transformer.serve.engine import Engine
    from mesh_transformer.tokenizer import EOS_ID, load_tokenizer

    params = random_eval_params()
    params["lm_head"]["bias"][EOS_ID] = -1e4
    layout = make_inference_layout(EVAL_CFG, mesh=make_dp_mp(2, 2, jax.devices()[:4]))
    engine = Engine(layout, params, load_tokenizer(), max_batch=4)
    try:
        with server.BackgroundServer(server.create_app(engine, engine.tokenizer, **app_kwargs)) as running:
            yield running.url
    finally:
        engine.close()


def left_pad(prompts: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
    """Prompts as HF's generate takes them: ids and attention mask [R, longest], padded on the left."""
    length = max(map(len, prompts))
    ids = np.zeros((len(prompts), length), np.int64)
    mask = np.zeros((len(prompts), length), np.int64)
    for row, prompt in enumerate(prompts):
        ids[row, length - len(prompt):], mask[row, length - len(prompt):] = prompt, 1
    return ids, mask


def ours_of(hf_model, **overrides) -> tuple[config.Config, dict]:
    """(our config from an HF model's config, one device, no remat; our params from its state dict)."""
    cfg = hf.config_from_hf(hf_model.config.to_dict(), cores_per_replica=1, remat=False, **overrides)
    return cfg, hf.hf_to_params(state_dict_numpy(hf_model), cfg)


def hf_logits(hf_model, ids) -> np.ndarray:
    import torch

    with torch.no_grad():
        return hf_model(torch.tensor(ids)).logits.numpy()


def our_logits(params, ids, cfg) -> np.ndarray:
    from mesh_transformer.model import gptj

    return np.asarray(jax.jit(lambda p, x: gptj.forward(p, x, cfg, policy=CPU_POLICY))(params, ids))


def hf_greedy(hf_model, prompts: list[list[int]], n: int) -> tuple[np.ndarray, np.ndarray]:
    """HF's greedy tokens [R, n] and the log-probabilities of those tokens [R, n] (prompts left-padded)."""
    import torch

    ids, mask = left_pad(prompts)
    with torch.no_grad():
        out = hf_model.generate(torch.tensor(ids), attention_mask=torch.tensor(mask), max_new_tokens=n,
                                do_sample=False, pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    tokens = out.sequences[:, ids.shape[1]:].numpy()
    logprobs = torch.log_softmax(torch.stack(out.logits, 1), -1).numpy()
    return tokens, np.take_along_axis(logprobs, tokens[..., None], -1)[..., 0]


# ---- LoRA adapters served side by side (model/lora_slots.py) ----

def served_greedy(layout: Layout, params: dict, prompts: list, row_slots: np.ndarray, steps: int, page: int = 4):
    """Greedy tokens and chosen log-probs [rows, 1 + steps] through the paged programs over params with adapter
    slots, prompt r in slot r running adapter slot row_slots[r] (-1: the base)."""
    from mesh_transformer.infer import decode
    from mesh_transformer.infer.choose import fill_sampling
    from mesh_transformer.infer.programs import Programs
    from mesh_transformer.parallel.mesh import DP

    programs, dp, n = Programs(layout), layout.mesh.shape[DP], len(prompts)
    local, per_row = n // dp, layout.cfg.seq // page
    cache, slots = programs.new_pages(n * per_row, page), programs.new_slots(n)
    table_ = np.tile(np.arange(local * per_row, dtype=np.int32).reshape(local, per_row), (dp, 1))
    width = max(map(len, prompts))
    ids = np.zeros((n, width), np.int32)
    for i, prompt in enumerate(prompts):
        ids[i, :len(prompt)] = prompt
    length = np.array([len(p) for p in prompts], np.int32)
    sampling = fill_sampling(n, [])._replace(adapter=np.asarray(row_slots, np.int32), logprobs=np.ones(n, bool))
    slot = np.tile(np.arange(local, dtype=np.int32), dp)
    token, chosen, slots, cache = programs.paged_prefill(params, cache, slots, ids, np.zeros(n, np.int32), length,
                                                         table_, slot, sampling, np.zeros(n, np.int32), n_read=0)
    state = decode.Steps(length.copy(), np.ones(n, np.int32), sampling)
    tokens, logprobs = [np.asarray(token)], [np.asarray(chosen.chosen)]
    for _ in range(steps):
        read = max(1, -(-int(np.max(np.asarray(state.position))) // page))
        token, chosen, slots, state, cache = programs.paged_decode(params, cache, slots, state, table_, rows=local,
                                                                   n_read=read)
        tokens.append(np.asarray(token))
        logprobs.append(np.asarray(chosen.chosen))
    return np.stack(tokens, 1), np.stack(logprobs, 1)


def int8_base(cfg, base) -> tuple[dict, dict]:
    """(an int8 base: each layer matrix quantized per layer as the loader does, its scales beside; the float base it
    stands for, each matrix int8 x scale)."""
    int8, floats = jax.tree.map(np.asarray, base), jax.tree.map(np.asarray, base)
    int8["layers"] = {**int8["layers"], lora.SCALES: {}}
    for target, path in lora.base_matrices(cfg).items():
        w = table.get_path(base["layers"], path)
        q, scales = zip(*(lora.quantize_matrix(np.asarray(w[i], np.float32)) for i in range(cfg.layers)))
        table.set_path(int8["layers"], path, np.stack(q))
        int8["layers"][lora.SCALES][target] = np.stack(scales)
        table.set_path(floats["layers"], path, np.stack(q).astype(np.float32) * np.stack(scales)[:, None, :])
    return int8, floats
