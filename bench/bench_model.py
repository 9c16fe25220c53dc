"""Training throughput of our GPT-J against HF GPTJForCausalLM (torch) on the same weights and machine.

Two rows each: forward+backward alone, and a full training step (clipping, AdamW). Ours and HF's run in alternating
rounds: `ours_speedup` is the median of the per-round ratios, the times are each side's best. MFU is against the f32
matmul rate this machine reaches (measured first).

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

from bench.common import emit, interleaved_times_s, matmul_peak_flop_per_s, train_flops_per_token
from mesh_transformer.platforms import platform_setup
from mesh_transformer import config
from mesh_transformer.store import hf
from mesh_transformer.model import gptj as model
from mesh_transformer.parallel.layout import make_layout
from mesh_transformer.train import optim
from mesh_transformer.train import state as state_lib
from mesh_transformer.parallel.mesh import make_dp_mp


def our_steps(cfg, ids_BxT1):
    """(forward+backward, full train step, the params in HF names): the steps as callables that wait for the
    device, on one device."""
    layout = make_layout(cfg, mesh=make_dp_mp(1, 1))
    opt = optim.make_optimizer(cfg)
    state = state_lib.init_train_state(layout, opt, jax.random.PRNGKey(0))
    hf_state = hf.params_to_hf(jax.tree.map(np.asarray, state["params"]), cfg)
    grad_fn = jax.jit(jax.value_and_grad(lambda p, x: model.loss_fn(p, x, cfg, policy=layout.policy)))
    train_step = state_lib.make_train_step(layout, opt, optim.lr_schedule(cfg))
    batch = jax.device_put(ids_BxT1[None], layout.batch_sharding())
    box = [state]

    def fwd_bwd():
        jax.block_until_ready(grad_fn(box[0]["params"], ids_BxT1))

    def step():
        box[0], metrics = train_step(box[0], batch, {})
        jax.block_until_ready(metrics)

    return fwd_bwd, step, hf_state


def hf_steps(cfg, hf_state, ids_BxT1):
    """(forward+backward, full train step with torch AdamW, same hyperparameters) of HF GPTJForCausalLM."""
    hf_cfg = GPTJConfig(**hf.hf_config(cfg))
    hf_cfg._attn_implementation = "sdpa"
    hf_model = GPTJForCausalLM(hf_cfg)
    hf_model.load_state_dict({k: torch.from_numpy(v.copy()) for k, v in hf_state.items()}, strict=False)
    torch_opt = torch.optim.AdamW(hf_model.parameters(), lr=cfg.lr, betas=(0.9, 0.999), eps=1e-8,
                                  weight_decay=cfg.weight_decay)
    ids = torch.from_numpy(ids_BxT1).long()

    def fwd_bwd():
        hf_model.zero_grad(set_to_none=True)
        hf_model(ids[:, :-1], labels=ids[:, :-1]).loss.backward()

    def step():
        fwd_bwd()
        torch.nn.utils.clip_grad_norm_(hf_model.parameters(), 1.0)
        torch_opt.step()

    return fwd_bwd, step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/bench.json")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    cfg = config.load(args.config, ["cores_per_replica=1", "warmup_steps=0"])
    tokens = args.batch * cfg.seq
    flops = train_flops_per_token(cfg) * tokens
    # The peak is measured before and after the runs and the best kept: on a shared machine one low reading would
    # flatter every MFU figure.
    before = matmul_peak_flop_per_s()
    ids_BxT1 = np.random.default_rng(0).integers(0, cfg.n_vocab, (args.batch, cfg.seq + 1)).astype(np.int32)
    *ours, hf_state = our_steps(cfg, ids_BxT1)
    rounds = [interleaved_times_s([our_fn, hf_fn], args.repeats)
              for our_fn, hf_fn in zip(ours, hf_steps(cfg, hf_state, ids_BxT1))]
    after = matmul_peak_flop_per_s()
    peak = max(before, after)
    emit(bench="matmul_peak_f32", gflop_per_s=round(peak / 1e9, 1), before=round(before / 1e9, 1),
         after=round(after / 1e9, 1), platform=jax.devices()[0].platform, torch_threads=torch.get_num_threads())
    for what, (our_s, their_s) in zip(("fwd_bwd", "train_step"), rounds):
        speedup = float(np.median(np.array(their_s) / np.array(our_s)))
        for impl, seconds in (("ours_jax", min(our_s)), ("hf_torch_sdpa", min(their_s))):
            emit(bench=what, impl=impl, remat=cfg.remat, tokens_per_s=round(tokens / seconds, 1),
                 step_s=round(seconds, 4), mfu_of_measured_peak=round(flops / seconds / peak, 3),
                 ours_speedup=round(speedup, 2), rounds=len(our_s))


if __name__ == "__main__":
    platform_setup()
    main()
