"""Helpers shared by tests of several subpackages."""
from __future__ import annotations

import os
import subprocess
import sys

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_script(script: str, *args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    """Runs one of the top-level command-line scripts as a user would, from the repository root."""
    return subprocess.run([sys.executable, script, *args], cwd=REPO_ROOT, input=stdin, capture_output=True,
                          text=True)


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
