"""How far bf16 drifts from f32, ours against HF transformers, on one GPT-J-shaped random model (head dim 256,
rotary 64, weights N(0, 0.02) as the 6B flow bench writes them): logits over a 64-token sequence against HF in f32,
and how many greedy tokens of 32 each bf16 path shares with HF's f32 ones. Where bf16 greedy text differs from HF's
(bench_6b_flow's compare), this says whether ours drifts more than HF's own bf16 does.

    python bench/bench_bf16_drift.py [LAYERS D_MODEL]   (default 8 1024)
"""
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax
import numpy as np
import torch
from transformers import GPTJConfig, GPTJForCausalLM
from mesh_transformer import config, platforms
from mesh_transformer.store import hf
from mesh_transformer.model import gptj
from mesh_transformer.infer.params import make_inference_layout
from mesh_transformer.infer.sampler import Sampler

layers, d = (int(a) for a in sys.argv[1:3]) if len(sys.argv) > 2 else (8, 1024)
base = {"layers": layers, "d_model": d, "n_heads": d // 256, "n_vocab": 50400, "pe_rotary_dims": 64, "seq": 256,
        "cores_per_replica": 1}
cfg32 = config.from_dict({**base, "compute_dtype": "float32"})
cfg16 = config.from_dict({**base, "compute_dtype": "bfloat16"})
torch.manual_seed(0)
model = GPTJForCausalLM(GPTJConfig(**hf.hf_config(cfg32))).eval()
with torch.no_grad():
    for name, p in model.named_parameters():
        p.copy_(torch.ones_like(p) if name.endswith("ln_1.weight") or name.endswith("ln_f.weight")
                else torch.randn_like(p) * 0.02)
state = {k: v.detach().numpy() for k, v in model.state_dict().items()}
params = hf.hf_to_params(state, cfg32)
rng = np.random.default_rng(0)
ids = rng.integers(0, 50257, (1, 64))
with torch.no_grad():
    ref = model(torch.tensor(ids)).logits.float().numpy()[0]
    model16 = GPTJForCausalLM(GPTJConfig(**hf.hf_config(cfg32))).eval()
    model16.load_state_dict(model.state_dict())
    model16 = model16.to(torch.bfloat16)
    hf16 = model16(torch.tensor(ids)).logits.float().numpy()[0]
ours16 = np.asarray(jax.jit(lambda p, x: gptj.forward(gptj.cast_for_compute(p, cfg16), x, cfg16,
                                                           policy=platforms.default()))(params, ids),
                    np.float32)[0]
std = ref.std()
rec = {"layers": layers, "d_model": d, "logit_std": round(float(std), 3)}
for name, got in (("ours_bf16", ours16), ("hf_bf16", hf16)):
    err = got - ref
    rec[name] = {"rms_err_over_std": round(float(np.sqrt((err ** 2).mean()) / std), 4),
                 "max_err": round(float(np.abs(err).max()), 4),
                 "top1_agree_of_64": int((got.argmax(-1) == ref.argmax(-1)).sum())}
# Greedy continuations of 32 tokens from a 16-token prompt: how many tokens each bf16 path shares with f32's.
prompt = ids[0, :16].tolist()
with torch.no_grad():
    want = model.generate(torch.tensor([prompt]), max_new_tokens=32, do_sample=False, pad_token_id=0)[0, 16:].tolist()
    hf_got = model16.generate(torch.tensor([prompt]), max_new_tokens=32, do_sample=False,
                              pad_token_id=0)[0, 16:].tolist()
layout = make_inference_layout(cfg16, jax.devices()[:1], mp=1)
ours_got = Sampler(layout, params).generate([prompt], 32, temperature=0.0, stop_token_ids=[])[0].tokens
layout32 = make_inference_layout(cfg32, jax.devices()[:1], mp=1)
ours32 = Sampler(layout32, params).generate([prompt], 32, temperature=0.0, stop_token_ids=[])[0].tokens


def shared(a, b):
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))

rec["greedy_tokens_shared_with_hf_f32_of_32"] = {"ours_f32": shared(ours32, want),
                                                 "ours_bf16": shared(ours_got, want), "hf_bf16": shared(hf_got, want)}
print(json.dumps({"bench": "bf16_drift", **rec}))
