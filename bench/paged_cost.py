"""What one paged decode step of GPT-J-6B costs on a TPU, by its compiler: the serving engine's decode program over
the paged cache compiled for a compile-only target (default v5litepod-1: libtpu on this CPU, nothing runs), for
each attention path (`gather`, `kernel`) x cache dtype x page size, at the device suite's serving shape (64 rows,
256-token prompts + 128 new tokens, 384 positions read). Prints one JSON line per variant: the compiler's bytes
accessed, flops and temporaries, and the step time and tokens/s the chip's bandwidth allows for those bytes (a
bound: the program's own bytes at the datasheet's bandwidth) beside the weights-and-cache roofline.

    python bench/paged_cost.py [--target v5litepod-1] [--rows 64] [--pages 16,32] [--paths gather,kernel]
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("JAX_PLATFORMS", "cpu")  # compiles for the target, runs nothing

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding

from bench.suite_parts import GPTJ_6B, INT8, model_config
from mesh_transformer import targets
from mesh_transformer.aot import _abstract_slots, _memory, shard_bytes
from mesh_transformer.infer.params import abstract_params, make_inference_layout
from mesh_transformer.infer.programs import Programs
from mesh_transformer.parallel.mesh import make_dp_mp


def variant(device, target, rows: int, positions: int, page: int, path: str, kv: str) -> dict:
    cfg = model_config({**GPTJ_6B, "seq": 512, **INT8}, kv_cache_dtype=kv)
    layout = make_inference_layout(cfg, mesh=make_dp_mp(1, 1, [device]))
    layout = dataclasses.replace(layout, policy=dataclasses.replace(layout.policy, paged_attention=path))
    programs, params = Programs(layout), abstract_params(layout)
    n_read, width = -(-positions // page), -(-cfg.seq // page)
    cache = programs.abstract_pages(rows * width, page)
    _, slots, steps = _abstract_slots(programs, rows, [page])
    table = jax.ShapeDtypeStruct((rows, width), jnp.int32,
                                 sharding=NamedSharding(layout.mesh, layout.spec(("batch", "length"))))
    start = time.perf_counter()
    compiled = programs.jitted["paged_decode"].lower(params, cache, slots, steps, table, rows=rows, n_read=n_read,
                                                     top=0, penalized=False).compile(
        compiler_options=layout.policy.compiler_options())
    seconds = time.perf_counter() - start
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    moved = float(cost.get("bytes accessed", 0))
    weights, cache_bytes = shard_bytes(params), shard_bytes(cache)
    read = cache_bytes * n_read / width  # the pages one step reads, all rows full
    bandwidth = target.chip.bandwidth
    return {"bench": "paged_cost", "target": target.name, "paged_attention": path, "kv_cache_dtype": kv,
            "page_size": page, "rows": rows, "positions_read": n_read * page, "compile_s": round(seconds, 1),
            "bytes_accessed": moved, "flops": float(cost.get("flops", 0)), "weights_bytes": weights,
            "pages_read_bytes": round(read), **{k: v for k, v in _memory(compiled).items() if k == "temp_bytes"},
            "step_ms_at_bandwidth": round(1e3 * moved / bandwidth, 2),
            "tokens_per_s_at_bandwidth": round(rows * bandwidth / moved, 1),
            "roofline_tokens_per_s": round(rows * bandwidth / (weights + read), 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="v5litepod-1")
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--positions", type=int, default=384, help="positions each row reads (prompt + new)")
    parser.add_argument("--pages", default="16", help="page sizes, comma-separated")
    parser.add_argument("--paths", default="gather,kernel", help="paged attention paths, comma-separated")
    parser.add_argument("--kv", default="int8", help="cache dtypes (int8, compute), comma-separated")
    args = parser.parse_args()
    target = targets.target(args.target)
    device = target.devices()[0]
    for page in map(int, args.pages.split(",")):
        for kv in args.kv.split(","):
            for path in args.paths.split(","):
                print(json.dumps(variant(device, target, args.rows, args.positions, page, path, kv)), flush=True)


if __name__ == "__main__":
    main()
