"""The paged decode attention kernel alone (`infer/paged_kernel.py`) on the device JAX finds, at one GPT-J-6B layer's
shape: 64 rows of 384 positions over 1,536 pages, int8 pages with per-token scales and bf16 pages, several page sizes
and blocks. Prints one JSON line per variant: time per call, the bytes it must read (the rows' pages and scales),
the bandwidth that makes, and the largest difference from the pure-JAX gather computed in f32 on the same device.

    python bench/paged_kernel_bench.py [--pages 16,32,64] [--blocks 128,384] [--repeats 20]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax
import jax.numpy as jnp
import numpy as np

from mesh_transformer.infer.paged_kernel import paged_decode_attention

ROWS, HEADS, HEAD_DIM, POSITIONS = 64, 16, 256, 384  # GPT-J-6B's heads; the device suite's serving requests


def reference(q, k, v, k_scales, v_scales, length, table):
    """The gather path's arithmetic in f32: each row's pages joined, dequantized, masked softmax."""
    def joined(x, scales):
        x = jnp.take(x, table, axis=0).astype(jnp.float32)  # [R, M, H, page, K]
        x = x.transpose(0, 1, 3, 2, 4).reshape(x.shape[0], -1, x.shape[2], x.shape[4])  # [R, S, H, K]
        if scales is not None:
            x = x * jnp.take(scales, table, axis=0).reshape(x.shape[0], -1, x.shape[2])[..., None]
        return x
    s = jnp.einsum("rhk,rshk->rhs", q.astype(jnp.float32), joined(k, k_scales))
    s = jnp.where(jnp.arange(s.shape[-1])[None, None] < length[:, None, None], s, -1e30)
    return jnp.einsum("rhs,rshk->rhk", jax.nn.softmax(s, -1), joined(v, v_scales))


def variant(page: int, block_tokens: int, int8: bool, repeats: int) -> dict:
    width = -(-POSITIONS // page)
    n_pages = ROWS * width
    keys = jax.random.split(jax.random.key(page), 6)
    q = (jax.random.normal(keys[0], (ROWS, HEADS, HEAD_DIM)) / np.sqrt(HEAD_DIM)).astype(jnp.bfloat16)
    shape = (n_pages, HEADS, page, HEAD_DIM)
    if int8:
        k, v = (jax.random.randint(key, shape, -127, 128, jnp.int8) for key in keys[1:3])
        k_scales, v_scales = (jax.random.uniform(key, (n_pages, page, HEADS), jnp.float32, 1e-3, 2e-2)
                              for key in keys[3:5])
    else:
        k, v = (jax.random.normal(key, shape, jnp.bfloat16) for key in keys[1:3])
        k_scales = v_scales = None
    table = jax.random.permutation(keys[5], n_pages).reshape(ROWS, width).astype(jnp.int32)
    length = jnp.full((ROWS,), POSITIONS, jnp.int32)
    per_block = max(1, min(width, block_tokens // page))
    run = jax.jit(lambda *a: paged_decode_attention(*a, pages_per_block=per_block))
    args = (q, k, v, k_scales, v_scales, length, table)
    out = run(*args).block_until_ready()
    error = float(jnp.max(jnp.abs(out - reference(*args))))
    start = time.perf_counter()
    for _ in range(repeats):
        out = run(*args)
    out.block_until_ready()
    seconds = (time.perf_counter() - start) / repeats
    per_position = HEADS * HEAD_DIM * k.dtype.itemsize + (HEADS * 4 if int8 else 0)
    moved = 2 * ROWS * width * page * per_position
    return {"bench": "paged_kernel", "device": jax.devices()[0].device_kind, "page_size": page,
            "pages_per_block": per_block, "kv": "int8" if int8 else "bfloat16", "rows": ROWS, "positions": POSITIONS,
            "ms": round(1e3 * seconds, 3), "bytes_read": moved, "gb_per_s": round(moved / seconds / 1e9, 1),
            "max_abs_error": error}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pages", default="16,32,64")
    parser.add_argument("--blocks", default="128,384", help="positions a block holds (pages x page size)")
    parser.add_argument("--kv", default="int8,bfloat16")
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    for kv in args.kv.split(","):
        for page in map(int, args.pages.split(",")):
            for block in map(int, args.blocks.split(",")):
                try:
                    record = variant(page, block, kv == "int8", args.repeats)
                except Exception as e:  # a variant the compiler refuses (VMEM): say so, go on with the others
                    record = {"bench": "paged_kernel", "page_size": page, "block_tokens": block, "kv": kv,
                              "error": str(e).splitlines()[0][:300]}
                print(json.dumps(record), flush=True)


if __name__ == "__main__":
    main()
