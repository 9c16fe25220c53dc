"""Interleaved A/B of the train step: projections joined (`join_projections`) vs unjoined vs HF GPTJForCausalLM +
torch AdamW, the same weights and batch, at bench_model.py's config.

Each round times one step of each, in an order that rotates from round to round, so a slow spell of a shared
machine falls on all three alike; the summary gives each one's median and best step time and the ratios of the
medians (joined over unjoined, and each against HF). JSON lines, one per round and a summary.

    python bench/bench_join.py [--config configs/bench.json] [--batch 4] [--rounds 10]
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax
import numpy as np
import torch

from bench.bench_model import hf_steps, our_steps
from bench.common import emit, matmul_peak_flop_per_s, train_flops_per_token
from mesh_transformer import config
from mesh_transformer.platforms import platform_setup


def timed_s(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/bench.json")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=10)
    args = parser.parse_args()
    cfg = config.load(args.config, ["cores_per_replica=1", "warmup_steps=0"])
    setup_start_s = time.perf_counter()
    ids_BxT1 = np.random.default_rng(0).integers(0, cfg.n_vocab, (args.batch, cfg.seq + 1)).astype(np.int32)
    joined = our_steps(dataclasses.replace(cfg, join_projections=True), ids_BxT1)[1]
    _, unjoined, hf_state = our_steps(cfg, ids_BxT1)
    steps = {"ours_joined": joined, "ours_unjoined": unjoined, "hf_torch_adamw": hf_steps(cfg, hf_state, ids_BxT1)[1]}
    for step in steps.values():  # compile, and the first touches of every buffer
        step()
        step()
    emit(bench="train_step_ab_setup", setup_s=round(time.perf_counter() - setup_start_s, 1))  # compiles, warm-up
    times: dict[str, list[float]] = {name: [] for name in steps}
    names = list(steps)
    for round_ in range(args.rounds):
        order = names[round_ % len(names):] + names[:round_ % len(names)]
        for name in order:
            times[name].append(timed_s(steps[name]))
        emit(bench="train_step_ab_round", round=round_, order=order,
             **{f"{name}_s": round(times[name][-1], 4) for name in names})
    tokens, peak = args.batch * cfg.seq, matmul_peak_flop_per_s()
    median = {name: statistics.median(ts) for name, ts in times.items()}
    emit(bench="train_step_ab", config=args.config, batch=args.batch, seq=cfg.seq, rounds=args.rounds,
         platform=jax.devices()[0].platform, torch_threads=torch.get_num_threads(),
         **{f"{name}_median_s": round(median[name], 4) for name in names},
         **{f"{name}_best_s": round(min(times[name]), 4) for name in names},
         **{f"{name}_tokens_per_s": round(tokens / median[name], 1) for name in names},
         **{f"{name}_mfu_of_measured_f32_peak": round(train_flops_per_token(cfg) * tokens / median[name] / peak, 3)
            for name in names},
         joined_speedup_over_unjoined=round(median["ours_unjoined"] / median["ours_joined"], 3),
         joined_speedup_over_hf=round(median["hf_torch_adamw"] / median["ours_joined"], 3),
         unjoined_speedup_over_hf=round(median["hf_torch_adamw"] / median["ours_unjoined"], 3))


if __name__ == "__main__":
    platform_setup()
    main()
