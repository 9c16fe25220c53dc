"""Full fine-tune against LoRA (rank 8, base held in f32 and in bf16) on the bench config: train-step tokens/s and
compiled per-device memory of each, one device, one JSON line per variant.

    python bench/bench_lora.py [--config configs/bench.json] [--rank 8] [--repeats 3]
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax

from bench.common import best_time_s, emit
from mesh_transformer.model import gptj
from mesh_transformer import config
from mesh_transformer.platforms import keep_host_memory
from mesh_transformer.parallel.layout import make_layout
from mesh_transformer.parallel.mesh import make_dp_mp
from mesh_transformer.train import optim
from mesh_transformer.train import state as state_lib


def measure(cfg: config.Config, repeats: int) -> dict:
    """Seconds per train step and the compiled step's memory (XLA's analysis) for one variant."""
    layout = make_layout(cfg, mesh=make_dp_mp(1, 1))
    optimizer = optim.make_optimizer(cfg)
    train_state = state_lib.init_train_state(layout, optimizer, jax.random.PRNGKey(0))
    base = {}
    if cfg.lora_rank:
        params = layout.init_params(jax.random.PRNGKey(1))
        base = jax.tree.map(lambda x: x.astype(gptj.precision(cfg).frozen), params)
        del params
    tokens = jax.random.randint(jax.random.PRNGKey(2), (1, layout.global_batch, cfg.seq + 1), 0, cfg.n_vocab)
    tokens = jax.device_put(tokens, layout.batch_sharding())
    compiled = state_lib.make_train_step(layout, optimizer, optim.lr_schedule(cfg)).lower(
        train_state, tokens, base).compile()
    mem = compiled.memory_analysis()
    box = [train_state]

    def step():
        box[0], metrics = compiled(box[0], tokens, base)
        jax.block_until_ready(metrics)

    seconds = best_time_s(step, repeats)
    return {"step_s": round(seconds, 4), "tokens_per_s": round(layout.global_batch * cfg.seq / seconds, 1),
            "argument_bytes": mem.argument_size_in_bytes, "temp_bytes": mem.temp_size_in_bytes,
            "total_bytes": mem.argument_size_in_bytes + mem.output_size_in_bytes + mem.temp_size_in_bytes
            - mem.alias_size_in_bytes}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/bench.json")
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    cfg = config.load(args.config, ["cores_per_replica=1", "warmup_steps=0"])
    variants = [("full", {}), ("lora_base_f32", {"lora_rank": args.rank, "base_dtype": "float32"}),
                ("lora_base_bf16", {"lora_rank": args.rank, "base_dtype": "bfloat16"})]
    for name, overrides in variants:
        variant = dataclasses.replace(cfg, **overrides)
        emit(bench="train_step", variant=name, config=args.config, batch=cfg.per_replica_batch, seq=cfg.seq,
             compute_dtype=cfg.compute_dtype, device=jax.devices()[0].platform, **measure(variant, args.repeats))


if __name__ == "__main__":
    keep_host_memory()
    main()
