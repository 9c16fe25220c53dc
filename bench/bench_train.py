"""Full training step (forward, backward, clipping, AdamW) in tokens/s and MFU: ours vs HF GPTJForCausalLM + torch.

    python bench/bench_train.py [--config configs/bench.json] [--batch 4]
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
from mesh_transformer import config, hf, model, optim
from mesh_transformer.mesh import make_dp_mp


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/bench.json")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    cfg = config.load(args.config, ["cores_per_replica=1", "warmup_steps=0"])
    tokens = args.batch * cfg.seq
    flops = train_flops_per_token(cfg) * tokens
    peak = matmul_peak_flop_per_s()
    emit(bench="matmul_peak_f32", gflop_per_s=round(peak / 1e9, 1), platform=jax.devices()[0].platform)

    mesh = make_dp_mp(1, 1)
    opt = optim.make_optimizer(cfg)
    state = model.init_train_state(cfg, mesh, opt, jax.random.PRNGKey(0))
    hf_params = hf.params_to_hf(jax.tree.map(np.asarray, state["params"]), cfg.layers)
    train_step = model.make_train_step(cfg, mesh, opt, optim.lr_schedule(cfg))
    ids = np.random.default_rng(0).integers(0, cfg.n_vocab, (1, args.batch, cfg.seq + 1)).astype(np.int32)
    batch = jax.device_put(ids, model.batch_sharding(mesh))
    box = [state]

    def ours():
        box[0], metrics = train_step(box[0], batch)
        jax.block_until_ready(metrics)

    ours_s = best_time_s(ours, args.repeats)
    emit(bench="train_step", impl="ours_jax", remat=cfg.remat, tokens_per_s=round(tokens / ours_s, 1),
         step_s=round(ours_s, 4), mfu_of_measured_peak=round(flops / ours_s / peak, 3))

    hf_cfg = GPTJConfig(**hf.hf_config(cfg))
    hf_cfg._attn_implementation = "sdpa"
    hf_model = GPTJForCausalLM(hf_cfg)
    hf_model.load_state_dict({k: torch.from_numpy(v.copy()) for k, v in hf_params.items()}, strict=False)
    torch_opt = torch.optim.AdamW(hf_model.parameters(), lr=cfg.lr, betas=(0.9, 0.999), eps=1e-8,
                                  weight_decay=cfg.weight_decay)
    ids_t = torch.from_numpy(ids[0]).long()

    def hf_step():
        torch_opt.zero_grad(set_to_none=True)
        hf_model(ids_t[:, :-1], labels=ids_t[:, :-1]).loss.backward()
        torch.nn.utils.clip_grad_norm_(hf_model.parameters(), 1.0)
        torch_opt.step()

    hf_s = best_time_s(hf_step, args.repeats)
    emit(bench="train_step", impl="hf_torch_sdpa_adamw", torch_threads=torch.get_num_threads(),
         tokens_per_s=round(tokens / hf_s, 1), step_s=round(hf_s, 4),
         mfu_of_measured_peak=round(flops / hf_s / peak, 3), ours_speedup=round(hf_s / ours_s, 2))


if __name__ == "__main__":
    main()
