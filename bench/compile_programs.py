"""How long the GPT-J-6B int8 server's programs take XLA to compile for a TPU target, compiled here (compile-only, no
accelerator): the warm-up's programs (`serve.warmup.paged_programs`: paged prefill and decode, 64 slots, an int8
paged cache of 2,195 pages of 16, seq 2048) picked by index, one at a time, each a JSON line with its lowering and
compile seconds; and the sampling step alone (`infer.choose.choose`) over 1 and 64 rows of the vocabulary. Run it at
two commits to compare.

    python bench/compile_programs.py [--topology v5litepod-1] [--layers 28] [--programs 0,19,20,59]
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from bench.common import emit
from mesh_transformer import config, targets
from mesh_transformer.infer.choose import choose, fill_sampling
from mesh_transformer.infer.pages import pages_for
from mesh_transformer.infer.params import abstract_params, make_inference_layout
from mesh_transformer.infer.programs import Programs
from mesh_transformer.infer.score import MAX_TOP
from mesh_transformer.serve.schedule import engine_schedule
from mesh_transformer.serve.warmup import paged_programs

PAGES, PAGE, SLOTS = 2195, 16, 64  # device_serve.py's own for GPT-J-6B int8 on a v5e (docs/performance.md)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--topology", default="v5litepod-1")
    parser.add_argument("--layers", type=int, default=28)
    parser.add_argument("--programs", default="0,19,20,59",
                        help="indices into the warm-up's programs (20 prefills, then decodes by rows and pages read: "
                             "20 is 1 row of 1 page, 59 is 64 rows of 128)")
    args = parser.parse_args()
    devices = targets.target(args.topology).devices()
    cfg = config.load("configs/6B_roto_256.json", [f"layers={args.layers}", 'weight_dtype="int8"',
                                                    'kv_cache_dtype="int8"', "cores_per_replica=1",
                                                    'compute_dtype="bfloat16"'])
    layout = make_inference_layout(cfg, devices[:1])
    programs = Programs(layout)
    schedule = engine_schedule(SLOTS, 1, cfg.seq, PAGE)
    state = (abstract_params(layout), programs.abstract_pages(PAGES, PAGE), programs.abstract_slots(SLOTS))
    listed = paged_programs(state, schedule, pages_for(cfg.seq, PAGE), 0, reuse_pages=True)
    emit(bench="meta", script="compile_programs", topology=args.topology, jax=jax.__version__, layers=args.layers,
         programs=len(listed))
    mesh = Mesh(np.array(devices[:1]), ("x",))
    whole = NamedSharding(mesh, PartitionSpec())
    for rows in (1, SLOTS):
        abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=whole),
                                (np.zeros((rows, cfg.n_vocab), np.float32), fill_sampling(rows, []),
                                 np.zeros(rows, np.int32)))
        start = time.perf_counter()
        jax.jit(lambda logits, sampling, index: choose(logits, sampling, index, top=MAX_TOP)).lower(
            *abstract).compile()
        emit(bench="compile_program", program="choose", rows=rows, compile_s=round(time.perf_counter() - start, 1))
    options = layout.policy.compiler_options()
    for i in (int(x) for x in args.programs.split(",")):
        name, program_args, static = listed[i]
        start = time.perf_counter()
        lowered = programs.lower(name, *program_args, **static)
        lowered_s = time.perf_counter() - start
        lowered.compile(compiler_options=options)
        emit(bench="compile_program", program=name, index=i, **{k: v for k, v in static.items() if k != "top"},
             ids=list(program_args[3].shape) if "prefill" in name else None, lower_s=round(lowered_s, 1),
             compile_s=round(time.perf_counter() - start - lowered_s, 1))


if __name__ == "__main__":
    main()
