"""A GPT-NeoX HF directory at Pythia size sampled on this machine, with random weights: a random Pythia-1.4B written
as an HF directory in bf16 (safetensors, config.json, a tokenizer), then `device_sample.py --hf DIR --dtype bf16`
greedy against transformers' `GPTNeoXForCausalLM` greedy on the same directory, each a child process whose wall time
and peak resident memory are reported beside the weights' bytes, and beside its runtime's floor: the peak of a
process that only starts the same runtime and loads the tokenizer (JAX's CPU backend and the package, or torch and
transformers), so that what loading and sampling add is seen apart from what the runtime costs anyway.

The weights are drawn at a trained model's scale (matrices N(0, 1/fan_in)), so the logits spread and greedy choices
are not near-ties. Needs the weights' bytes of disk under --work (1.4B: 3 GB); it is a benchmark, not a test.

    python bench/bench_neox_flow.py --work /tmp/pythia [--shape pythia-1.4b] [--keep]
    python3 bench/bench_neox_flow.py --work /tmp/pythia --shape pythia-6.9b --dtype int8 --no-hf   # on a TPU host
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench.bench_6b_flow import stage  # noqa: E402
from bench.common import emit  # noqa: E402

PROMPT = "The quick brown fox"
MAX_NEW = 8
SHAPES = {  # the Pythia suite's HF config keys (EleutherAI/pythia-*: rotary_pct 0.25, parallel residual)
    "pythia-410m": {"hidden_size": 1024, "num_hidden_layers": 24, "num_attention_heads": 16},
    "pythia-1.4b": {"hidden_size": 2048, "num_hidden_layers": 24, "num_attention_heads": 16},
    "pythia-2.8b": {"hidden_size": 2560, "num_hidden_layers": 32, "num_attention_heads": 32},
    "pythia-6.9b": {"hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32},
    "pythia-12b": {"hidden_size": 5120, "num_hidden_layers": 36, "num_attention_heads": 40},
}
WRITE_HF = """
import json, os, sys
import ml_dtypes, numpy as np
sys.path.insert(0, {root!r})
from safetensors.numpy import save_file
from mesh_transformer.store import hf
from mesh_transformer.tokenizer import load_tokenizer
hf_config = {hf_config!r}
cfg = hf.config_from_hf(hf_config, cores_per_replica=1, tokenizer="gpt2")
rng = np.random.default_rng(0)
state = {{}}
for entry in hf.hf_layout(cfg):
    shape = entry.shape
    name = entry.name
    if name.endswith("layernorm.weight") or name.endswith("final_layer_norm.weight"):
        x = 1 + 0.1 * rng.standard_normal(shape, np.float32)
    elif name.endswith("bias"):
        x = 0.1 * rng.standard_normal(shape, np.float32)
    elif "embed_in" in name:
        x = rng.standard_normal(shape, np.float32)
    else:  # a torch Linear weight [out, in]
        x = rng.standard_normal(shape, np.float32) / np.sqrt(shape[-1])
    state[name] = x.astype(ml_dtypes.bfloat16)
os.makedirs({out!r}, exist_ok=True)
save_file(state, os.path.join({out!r}, "model.safetensors"))
load_tokenizer().save_pretrained({out!r})
json.dump({{**hf.hf_config(cfg), "torch_dtype": "bfloat16"}}, open(os.path.join({out!r}, "config.json"), "w"))
print(sum(x.nbytes for x in state.values()))
"""
OUR_FLOOR = """
import sys
sys.path.insert(0, {root!r})
import jax
jax.devices()
from mesh_transformer.infer import sampler
from mesh_transformer.tokenizer import load_tokenizer
load_tokenizer({hf!r})
"""
HF_FLOOR = """
import torch
from transformers import AutoTokenizer, GPTNeoXForCausalLM
AutoTokenizer.from_pretrained({hf!r})
"""
HF_GENERATE = """
import json, torch
from transformers import AutoTokenizer, GPTNeoXForCausalLM
model = GPTNeoXForCausalLM.from_pretrained({hf!r}, dtype=torch.bfloat16).eval()
tokenizer = AutoTokenizer.from_pretrained({hf!r})
ids = tokenizer({prompt!r}, return_tensors="pt").input_ids
with torch.no_grad():
    out = model.generate(ids, max_new_tokens={max_new}, do_sample=False, pad_token_id=0)
print(json.dumps(tokenizer.decode(out[0, ids.shape[1]:])))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", required=True, help="a directory with the weights' bytes free (1.4B: 3 GB)")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="pythia-1.4b")
    parser.add_argument("--keep", action="store_true", help="keep the directory written")
    parser.add_argument("--dtype", choices=("bf16", "int8"), default="bf16", help="device_sample.py's weights")
    parser.add_argument("--no-hf", action="store_true",
                        help="ours alone (a machine without torch: a TPU host); no transformers stages")
    args = parser.parse_args()
    work = os.path.abspath(args.work)
    hf_dir, py = f"{work}/{args.shape}", sys.executable
    width = SHAPES[args.shape]["hidden_size"]
    hf_config = {"model_type": "gpt_neox", "vocab_size": 50304, "intermediate_size": 4 * width, "rotary_pct": 0.25,
                 "rotary_emb_base": 10000, "max_position_embeddings": 2048, "use_parallel_residual": True,
                 **SHAPES[args.shape]}
    try:
        weight_bytes = int(stage("write_hf", [py, "-c", WRITE_HF.format(root=ROOT, hf_config=hf_config, out=hf_dir)],
                                 bench="neox_flow"))
        peaks: dict = {}
        sample = f"sample_{args.dtype}"
        ours = stage(sample, [py, "device_sample.py", "--hf", hf_dir, "--dtype", args.dtype, "--prompt", PROMPT,
                              "--max-new-tokens", str(MAX_NEW), "--temperature", "0"],
                     bench="neox_flow", bytes_of=weight_bytes, peaks=peaks).rstrip("\n")
        stage("our_runtime_floor", [py, "-c", OUR_FLOOR.format(root=ROOT, hf=hf_dir)], bench="neox_flow", peaks=peaks)
        compared = {"ours": json.dumps(ours), "ours_added_over_weights": round(
            (peaks[sample] - peaks["our_runtime_floor"]) / weight_bytes, 3)}
        if not args.no_hf:
            theirs = json.loads(stage("hf_transformers_generate", [py, "-c", HF_GENERATE.format(
                hf=hf_dir, prompt=PROMPT, max_new=MAX_NEW)], bench="neox_flow", bytes_of=weight_bytes, peaks=peaks))
            stage("hf_runtime_floor", [py, "-c", HF_FLOOR.format(hf=hf_dir)], bench="neox_flow", peaks=peaks)
            compared.update(hf=json.dumps(theirs), greedy_text_equal=ours == theirs, hf_added_over_weights=round(
                (peaks["hf_transformers_generate"] - peaks["hf_runtime_floor"]) / weight_bytes, 3))
        emit(bench="neox_flow", stage="compare", shape=args.shape, dtype=args.dtype,
             weights_gb=round(weight_bytes / 1e9, 3), **compared)
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
