"""The slot cache's decode attention kernel alone (`infer/decode_kernel.py`) on the device JAX finds, at one layer's
shape of a model's int8 decode section in `bench/device_suite.py` (`--shape`; rows by `--rows`, 192 cached positions
of a 256-position block, bf16 keys and values), in each form of a row's chunk (`--forms`). Prints one JSON line per
variant: time per call, the keys' and values' bytes the rows read, the bandwidth that makes, and the largest
difference from XLA's attention computed in f32 on the same device.

    python bench/decode_kernel_bench.py [--shape llama3_8b] [--rows 32,128] [--forms vpu,mxu] [--repeats 20]
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

from mesh_transformer.infer import decode_kernel

SHAPES = {"gptj_6b": (16, 16, 256), "llama2_7b": (32, 32, 128), "llama3_8b": (32, 8, 128)}  # heads, key heads, K
BLOCK, POSITIONS = 256, 192


def reference(q, k, v, length, k_new, v_new):
    """XLA's attention in f32: the cached positions before each row's length and the row's new key."""
    group = q.shape[1] // k.shape[2]
    k = jnp.concatenate([k[:q.shape[0]], k_new[:, None]], 1).astype(jnp.float32)
    v = jnp.concatenate([v[:q.shape[0]], v_new[:, None]], 1).astype(jnp.float32)
    k, v = (jnp.repeat(x, group, axis=2) for x in (k, v))
    s = jnp.einsum("rhk,rshk->rhs", q.astype(jnp.float32), k) / np.sqrt(q.shape[-1])
    real = (jnp.arange(k.shape[1])[None] < length[:, None]) | (jnp.arange(k.shape[1])[None] == k.shape[1] - 1)
    s = jnp.where(real[:, None], s, -1e30)
    return jnp.einsum("rhs,rshk->rhk", jax.nn.softmax(s, -1), v)


def variant(shape_name: str, rows: int, form: str, repeats: int) -> dict:
    heads, kv_heads, head_dim = SHAPES[shape_name]
    keys = jax.random.split(jax.random.key(rows), 5)
    q = jax.random.normal(keys[0], (rows, heads, head_dim), jnp.bfloat16)
    k, v = (jax.random.normal(key, (rows, BLOCK, kv_heads, head_dim), jnp.bfloat16) for key in keys[1:3])
    k_new, v_new = (jax.random.normal(key, (rows, kv_heads, head_dim), jnp.bfloat16) for key in keys[3:5])
    length = jnp.full((rows,), POSITIONS, jnp.int32)
    run = jax.jit(lambda q, k, v, n, kn, vn: decode_kernel.attend(q, [k], [v], n, kn, vn, form=form))
    args = (q, k, v, length, k_new, v_new)
    error = float(jnp.max(jnp.abs(run(*args) - reference(*args))))
    start = time.perf_counter()
    for _ in range(repeats):
        out = run(*args)
    out.block_until_ready()
    seconds = (time.perf_counter() - start) / repeats
    moved = 2 * rows * POSITIONS * kv_heads * head_dim * 2
    return {"bench": "decode_kernel", "device": jax.devices()[0].device_kind, "shape": shape_name, "form": form,
            "heads": heads, "kv_heads": kv_heads, "head_dim": head_dim, "rows": rows, "positions": POSITIONS,
            "ms": round(1e3 * seconds, 3), "bytes_read": moved, "gb_per_s": round(moved / seconds / 1e9, 1),
            "max_abs_error": error, "chosen": decode_kernel.form_for(kv_heads, jnp.bfloat16)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="llama3_8b", choices=sorted(SHAPES))
    parser.add_argument("--rows", default="32,128")
    parser.add_argument("--forms", default="vpu,mxu")
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    for rows, form in itertools.product(map(int, args.rows.split(",")), args.forms.split(",")):
        try:
            record = variant(args.shape, rows, form, args.repeats)
        except Exception as e:  # a variant the compiler refuses: say so, go on with the others
            record = {"bench": "decode_kernel", "shape": args.shape, "rows": rows, "form": form,
                      "error": str(e).splitlines()[0][:300]}
        print(json.dumps(record), flush=True)


if __name__ == "__main__":
    main()
