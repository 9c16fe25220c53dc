"""Helpers shared by tests of several subpackages."""
from __future__ import annotations

import os
import subprocess
import sys

from mesh_transformer.platforms import for_platform

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CPU_POLICY = for_platform("cpu")  # the platform policy of the tests' devices, for model code called without a Layout


def run_script(script: str, *args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    """Runs one of the top-level command-line scripts as a user would, from the repository root, with glibc's
    tunables already as the scripts' CPU restart sets them: the restart is tested in tests/test_cli.py, and here
    it would only start each script twice (a benchmark imports JAX and torch before it restarts)."""
    from mesh_transformer.cli import KEEP_HOST_MEMORY

    env = {**os.environ, "GLIBC_TUNABLES": os.environ.get("GLIBC_TUNABLES", KEEP_HOST_MEMORY)}
    return subprocess.run([sys.executable, script, *args], cwd=REPO_ROOT, input=stdin, capture_output=True,
                          text=True, env=env)


def run_scripts(*calls: tuple[str, ...]) -> list[subprocess.CompletedProcess]:
    """`run_script` for each (script, *args), a few at once: each is mostly one interpreter's start-up and
    compiles, which leave the second core idle."""
    import concurrent.futures

    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        return list(pool.map(lambda call: run_script(*call), calls))


def write_hf_dir(directory: str, params: dict, cfg) -> str:
    """A tiny model as an HF GPT-J directory (f32 safetensors, config.json, GPT-2 tokenizer files)."""
    import json

    import numpy as np
    from safetensors.numpy import save_file

    from mesh_transformer.store import hf
    from mesh_transformer.tokenizer import load_tokenizer

    os.makedirs(directory, exist_ok=True)
    state = {k: np.ascontiguousarray(v, np.float32) for k, v in hf.params_to_hf(params, cfg.layers).items()}
    save_file(state, os.path.join(directory, "model.safetensors"))
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump({**hf.hf_config(cfg), "torch_dtype": "float32"}, f)
    load_tokenizer().save_pretrained(directory)
    return directory


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
    import json

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


def _eval_cfg():
    from mesh_transformer import config

    return config.from_dict(EVAL_CFG_DICT)


EVAL_CFG = _eval_cfg()


def random_eval_params(cfg=EVAL_CFG, seed: int = 0) -> dict:
    """Random weights made with numpy (nothing to compile), large enough that the argmax is rarely a near-tie."""
    import jax
    import numpy as np

    from mesh_transformer.model import gptj

    rng = np.random.default_rng(seed)

    def leaf(path, shape):
        name = jax.tree_util.keystr(path)
        if "scale" in name:
            return np.ones(shape.shape, np.float32)
        return (rng.standard_normal(shape.shape) * (0.05 if "bias" in name else 0.2)).astype(np.float32)

    return jax.tree_util.tree_map_with_path(leaf, gptj.param_shapes(cfg))


def per_sample(results: dict) -> dict:
    """task -> [(doc_id, filtered response)] in doc order, from lm-eval results with log_samples."""
    return {task: [(s["doc_id"], s["filtered_resps"]) for s in sorted(samples, key=lambda s: s["doc_id"])]
            for task, samples in results["samples"].items()}


def assert_same_eval(ours: dict, ref: dict, rolling_docs=None) -> None:
    """Per-sample log-likelihoods within 1e-4, generations and accuracies exactly; `rolling_docs` limits the
    perplexity docs compared."""
    import numpy as np

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
