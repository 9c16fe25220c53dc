"""Forward+backward tokens/s and MFU of our GPT-J against HF GPTJForCausalLM (torch), same config, same machine.

    python bench/bench_model.py [--config configs/bench.json] [--batch 4]
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax
import numpy as np
import torch
from transformers import GPTJConfig, GPTJForCausalLM

from bench.common import best_time_s, emit, matmul_peak_flop_per_s, train_flops_per_token
from mesh_transformer import config, hf, model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/bench.json")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    cfg = config.load(args.config, ["cores_per_replica=1"])
    tokens = args.batch * cfg.seq
    flops = train_flops_per_token(cfg) * tokens
    peak = matmul_peak_flop_per_s()
    emit(bench="matmul_peak_f32", gflop_per_s=round(peak / 1e9, 1), devices=jax.device_count(),
         platform=jax.devices()[0].platform)

    params = model.init_unsharded(cfg, jax.random.PRNGKey(0))
    ids = np.random.default_rng(0).integers(0, cfg.n_vocab, (args.batch, cfg.seq + 1)).astype(np.int32)
    step = jax.jit(jax.value_and_grad(lambda p, x: model.loss_fn(p, x, cfg)))
    ours_s = best_time_s(lambda: jax.block_until_ready(step(params, ids)), args.repeats)
    emit(bench="fwd_bwd", impl="ours_jax", remat=cfg.remat, tokens_per_s=round(tokens / ours_s, 1),
         step_s=round(ours_s, 4), mfu_of_measured_peak=round(flops / ours_s / peak, 3))

    hf_cfg = GPTJConfig(**hf.hf_config(cfg))
    hf_cfg._attn_implementation = "eager"
    hf_model = GPTJForCausalLM(hf_cfg)
    hf_model.load_state_dict({k: torch.from_numpy(v.copy()) for k, v in
                              hf.params_to_hf(jax.tree.map(np.asarray, params), cfg.layers).items()}, strict=False)
    ids_t = torch.from_numpy(ids).long()

    def hf_step():
        hf_model.zero_grad(set_to_none=True)
        hf_model(ids_t[:, :-1], labels=ids_t[:, :-1]).loss.backward()

    for impl in ("eager", "sdpa"):
        hf_cfg._attn_implementation = impl
        hf_s = best_time_s(hf_step, args.repeats)
        emit(bench="fwd_bwd", impl=f"hf_torch_{impl}", torch_threads=torch.get_num_threads(),
             tokens_per_s=round(tokens / hf_s, 1), step_s=round(hf_s, 4),
             mfu_of_measured_peak=round(flops / hf_s / peak, 3), ours_speedup=round(hf_s / ours_s, 2))


if __name__ == "__main__":
    main()
