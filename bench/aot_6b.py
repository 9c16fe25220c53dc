"""Ahead-of-time check: GPT-J-6B forward+backward compiled for 8 faked CPU devices (mp 8) from abstract shapes.

Nothing is allocated: the params are ShapeDtypeStructs with shardings. Prints per-device memory from the compiled
executable's memory analysis, and the compile time.

    python bench/aot_6b.py [--config configs/6B_roto_256.json]
"""
from __future__ import annotations

import os
import sys

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import argparse
import time

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from bench.common import emit
from mesh_transformer import config
from mesh_transformer.parallel import mesh
from mesh_transformer.model import gptj as model

GIB = 2 ** 30


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/6B_roto_256.json")
    args = parser.parse_args()
    cfg = config.load(args.config)
    m = mesh.make(cfg, jax.devices()[:cfg.cores_per_replica])
    params = model.abstract_params(cfg, m)
    batch = cfg.per_replica_batch * m.shape[mesh.DP]
    tokens = jax.ShapeDtypeStruct((batch, cfg.seq + 1), jnp.int32, sharding=NamedSharding(m, P(mesh.DP, None)))
    start = time.perf_counter()
    compiled = jax.jit(model.sharded_loss_and_grad_fn(cfg, m)).lower(params, tokens).compile()
    compile_s = time.perf_counter() - start
    mem = compiled.memory_analysis()
    n_params = sum(x.size for x in jax.tree.leaves(params))
    emit(bench="aot_fwd_bwd", config=args.config, devices=m.size, mp=cfg.cores_per_replica, params=n_params,
         compile_s=round(compile_s, 1),
         per_device_argument_gib=round(mem.argument_size_in_bytes / GIB, 3),
         per_device_output_gib=round(mem.output_size_in_bytes / GIB, 3),
         per_device_temp_gib=round(mem.temp_size_in_bytes / GIB, 3),
         per_device_total_gib=round((mem.argument_size_in_bytes + mem.output_size_in_bytes
                                     + mem.temp_size_in_bytes - mem.alias_size_in_bytes) / GIB, 3))


if __name__ == "__main__":
    main()
