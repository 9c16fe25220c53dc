"""The paged decode attention kernel alone (`infer/paged_kernel.py`) on the device JAX finds, at one layer's shape of
a model's serving (`--shape`: GPT-J-6B's 64 rows of 384 positions; Llama-2-7B's 12 rows and Llama-3-8B's 36 at
1,024 + 1,024 tokens, 1,536 positions on average), int8 pages with per-token scales and bf16 pages, several page
sizes, blocks and forms of a block's product (`--forms`; "copy" and "convert" are floors: only the pages' copies, and
those with each head's int8 converted). Prints one JSON line per variant: time per call, the bytes it must read (the
rows' pages and scales), the bandwidth that makes, and the largest difference from the pure-JAX gather computed in
f32 on the same device.

    python bench/paged_kernel_bench.py [--shape gptj_6b] [--pages 16,32,64] [--blocks 128,384] [--forms dense,mxu,copy]
        [--spread]
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from mesh_transformer.infer.paged_kernel import paged_decode_attention

# rows, query heads, key heads, head size, positions: the device suite's serving shapes
SHAPES = {"gptj_6b": (64, 16, 16, 256, 384), "llama2_7b": (12, 32, 32, 128, 1536), "llama3_8b": (36, 32, 8, 128, 1536)}


def copy_only(q_ref, head, k_scales, v_scales, start, length, m_ref, l_ref, acc_ref, *, kv_heads, group, span, work):
    """A floor: the block's pages copied, nothing computed (the output is 0 / 0)."""


def convert_only(q_ref, head, k_scales, v_scales, start, length, m_ref, l_ref, acc_ref, *, kv_heads, group, span, work):
    """A floor: each head's keys and values converted to f32 and summed, no product."""
    for h in range(kv_heads):
        at = pl.ds(h * group, 1)
        acc_ref[at, :] += jnp.sum(head("k", h, jnp.float32) + head("v", h, jnp.float32), axis=0, keepdims=True)


FLOORS = {"copy": copy_only, "convert": convert_only}


def reference(q, k, v, k_scales, v_scales, length, table):
    """The gather path's arithmetic in f32: each row's pages joined, dequantized, masked softmax."""
    def joined(x, scales):
        x = jnp.take(x, table, axis=0).astype(jnp.float32)  # [R, M, H, page, K]
        x = x.transpose(0, 1, 3, 2, 4).reshape(x.shape[0], -1, x.shape[2], x.shape[4])  # [R, S, H, K]
        if scales is not None:
            x = x * jnp.take(scales, table, axis=0).reshape(x.shape[0], -1, x.shape[2])[..., None]
        return jnp.repeat(x, q.shape[1] // x.shape[2], axis=2)  # each key head for its group of query heads
    s = jnp.einsum("rhk,rshk->rhs", q.astype(jnp.float32), joined(k, k_scales))
    s = jnp.where(jnp.arange(s.shape[-1])[None, None] < length[:, None, None], s, -1e30)
    return jnp.einsum("rhs,rshk->rhk", jax.nn.softmax(s, -1), joined(v, v_scales))


def variant(shape_name: str, page: int, block_tokens: int, int8: bool, form: str, repeats: int,
            spread: bool = False) -> dict:
    rows, heads, kv_heads, head_dim, positions = SHAPES[shape_name]
    # spread: the rows' lengths evenly from 2/3 to 4/3 of the shape's positions (1,024 to 2,048 about 1,536), as a
    # server's rows at different points of their requests
    lengths = np.linspace(2 * positions // 3, 4 * positions // 3, rows).astype(np.int32) if spread else \
        np.full(rows, positions, np.int32)
    width = -(-int(lengths.max()) // page)
    n_pages = rows * width
    keys = jax.random.split(jax.random.key(page), 6)
    q = (jax.random.normal(keys[0], (rows, heads, head_dim)) / np.sqrt(head_dim)).astype(jnp.bfloat16)
    shape = (n_pages, kv_heads, page, head_dim)
    if int8:
        k, v = (jax.random.randint(key, shape, -127, 128, jnp.int8) for key in keys[1:3])
        k_scales, v_scales = (jax.random.uniform(key, (n_pages, page, kv_heads), jnp.float32, 1e-3, 2e-2)
                              for key in keys[3:5])
    else:
        k, v = (jax.random.normal(key, shape, jnp.bfloat16) for key in keys[1:3])
        k_scales = v_scales = None
    table = jax.random.permutation(keys[5], n_pages).reshape(rows, width).astype(jnp.int32)
    length = jnp.asarray(lengths)
    per_block = max(1, min(width, block_tokens // page))
    kernel_form = FLOORS.get(form, form)
    run = jax.jit(lambda *a: paged_decode_attention(*a, pages_per_block=per_block, form=kernel_form))
    args = (q, k, v, k_scales, v_scales, length, table)
    out = run(*args).block_until_ready()
    error = None if form in FLOORS else float(jnp.max(jnp.abs(out - reference(*args))))
    start = time.perf_counter()
    for _ in range(repeats):
        out = run(*args)
    out.block_until_ready()
    seconds = (time.perf_counter() - start) / repeats
    per_position = kv_heads * head_dim * k.dtype.itemsize + (kv_heads * 4 if int8 else 0)
    moved = 2 * int(np.sum(-(-lengths // page))) * page * per_position  # the pages each row reads
    return {"bench": "paged_kernel", "device": jax.devices()[0].device_kind, "shape": shape_name, "form": form,
            "heads": heads, "kv_heads": kv_heads, "head_dim": head_dim, "page_size": page,
            "pages_per_block": per_block, "kv": "int8" if int8 else "bfloat16", "rows": rows,
            "positions": int(lengths.mean()), "spread": spread,
            "ms": round(1e3 * seconds, 3), "bytes_read": moved, "gb_per_s": round(moved / seconds / 1e9, 1),
            "max_abs_error": error}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="gptj_6b", choices=sorted(SHAPES))
    parser.add_argument("--forms", default="dense",
                        help="of paged_kernel.FORMS, or the floors copy and convert")
    parser.add_argument("--pages", default="16,32,64")
    parser.add_argument("--blocks", default="128,384", help="positions a block holds (pages x page size)")
    parser.add_argument("--kv", default="int8,bfloat16")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--spread", action="store_true",
                        help="rows of lengths from 2/3 to 4/3 of the shape's positions, not all alike")
    args = parser.parse_args()
    for kv, page, block, form in itertools.product(args.kv.split(","), map(int, args.pages.split(",")),
                                                   map(int, args.blocks.split(",")), args.forms.split(",")):
        try:
            record = variant(args.shape, page, block, kv == "int8", form, args.repeats, args.spread)
        except Exception as e:  # a variant the compiler refuses (VMEM): say so, go on with the others
            record = {"bench": "paged_kernel", "shape": args.shape, "form": form, "page_size": page,
                      "block_tokens": block, "kv": kv, "error": str(e).splitlines()[0][:300]}
        print(json.dumps(record), flush=True)


if __name__ == "__main__":
    main()
