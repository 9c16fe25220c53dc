"""A/B of a decode step's attention over the slot cache on the device this machine has, at GPT-J-6B's shape: every
layer's one query per row against its keys and values in blocks [N, S_j, H, K] (`infer/decode.py`), the first R of N
slots read, as XLA runs it (`model.attention.attend` over the rows sliced out of the blocks: the policy's
decode_attention "xla") and as the Pallas kernel does (`infer/decode_kernel.py`: "kernel", its default grid and form,
and other forms, rows and positions a grid step, `--kernel-variants`). Each layer's output is the next one's query,
so the layers run in turn as in a step. Each record: the step's attention time (of CHAINED steps back to back), the
bytes of keys and values it must read (R rows x the span, every layer), that rate over the datasheet's bandwidth
where one is known, and the largest difference of the first layer's output from an f32 reference.

    python bench/decode_attention_ab.py [--layers 28] [--slots 64] [--rows 1,16,32,64] [--blocks 64,64,64]
        [--kernel-variants vpu:4x64,mxu:8x128]
"""
from __future__ import annotations

import argparse
import functools
import os
import sys
import time

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import best_time_s, datasheet, emit, figure
from bench.suite_parts import error_text
from mesh_transformer.infer import decode_kernel
from mesh_transformer.model.attention import attend

HEADS, HEAD_DIM = 16, 256  # GPT-J-6B's
F32, BF16 = jnp.float32, jnp.bfloat16
CHAINED = 10  # steps timed back to back, each taking the last one's output, with one wait at the end


def xla(q_RxHxK, k_blocks, v_blocks, length_R, k_new, v_new):
    """What decode runs under the policy's "xla": the first R slots sliced out of each block, `attend` with the
    past's mask and the new key."""
    rows = q_RxHxK.shape[0]
    span = sum(b.shape[1] for b in k_blocks)
    past_mask = (jnp.arange(span)[None, :] < length_R[:, None])[:, None, :]
    past = ([b[:rows] for b in k_blocks], [b[:rows] for b in v_blocks], past_mask)
    out = attend(q_RxHxK[:, None], k_new[:, None], v_new[:, None], jnp.ones((rows, 1, 1), bool), past)
    return out.reshape(q_RxHxK.shape).astype(F32)


def reference(q_RxHxK, k_blocks, v_blocks, length_R, k_new, v_new):
    """The attention in f32 (HIGHEST): the rows' positions joined, masked softmax with the new key."""
    rows = q_RxHxK.shape[0]
    k = jnp.concatenate([b[:rows].astype(F32) for b in k_blocks] + [k_new[:, None].astype(F32)], 1)
    v = jnp.concatenate([b[:rows].astype(F32) for b in v_blocks] + [v_new[:, None].astype(F32)], 1)
    s = jnp.einsum("rhk,rshk->rhs", q_RxHxK.astype(F32), k, precision="highest") / jnp.sqrt(F32(HEAD_DIM))
    real = jnp.arange(k.shape[1])[None] < length_R[:, None]
    real = real.at[:, -1].set(True)
    s = jnp.where(real[:, None], s, -jnp.inf)
    return jnp.einsum("rhs,rshk->rhk", jax.nn.softmax(s, -1), v, precision="highest")


def kernel(spec: str = ""):
    """The kernel at a variant's "FORM:ROWSxPOSITIONS" (empty: its defaults)."""
    if not spec:
        return decode_kernel.attend
    form, shape = spec.split(":")
    rows, positions = (int(x) for x in shape.split("x"))
    return functools.partial(decode_kernel.attend, form=form, most_rows=rows, most_positions=positions)


def step(attention, q_RxHxK, layers, length_R):
    """Every layer's attention in turn, each one's output the next one's query (and new key and value)."""
    for k_blocks, v_blocks in layers:
        new = q_RxHxK.astype(BF16)
        q_RxHxK = attention(new, k_blocks, v_blocks, length_R, new, new).astype(BF16)
    return q_RxHxK


def _chained(fn, q, layers, length):
    for _ in range(CHAINED):
        q = fn(q, layers, length)
    return q.block_until_ready()


def make_layers(n_layers: int, slots: int, blocks: list[int]) -> list:
    key = jax.random.PRNGKey(0)
    layers = []
    for i in range(n_layers):
        made = []
        for j in range(2):
            keys = jax.random.split(jax.random.fold_in(key, 2 * i + j), len(blocks))
            made.append([jax.random.normal(k, (slots, s, HEADS, HEAD_DIM), BF16) for k, s in zip(keys, blocks)])
        layers.append(tuple(made))
    return layers


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=28)
    parser.add_argument("--slots", type=int, default=64)
    parser.add_argument("--rows", default="1,16,32,64")
    parser.add_argument("--blocks", default="64,64,64", help="the cache blocks' positions read (the suite's: 3 x 64)")
    parser.add_argument("--kernel-variants", default="",
                        help="more kernel variants, FORM:ROWSxPOSITIONS (form vpu or mxu; rows and positions a grid "
                             "step), comma-separated")
    args = parser.parse_args()
    blocks = [int(b) for b in args.blocks.split(",")]
    span = sum(blocks)
    device = jax.devices()[0]
    sheet_bytes_per_s = datasheet(device)[1]
    variants = {"xla": xla, "kernel": kernel()}
    for spec in filter(None, args.kernel_variants.split(",")):
        variants[f"kernel_{spec}"] = kernel(spec)
    layers = make_layers(args.layers, args.slots, blocks)
    emit(bench="decode_attention_meta", device_kind=device.device_kind, layers=args.layers, slots=args.slots,
         blocks=blocks, heads=HEADS, head_dim=HEAD_DIM, chained=CHAINED, jax=jax.__version__,
         commit=os.environ.get("MTJ_COMMIT", ""))
    for rows in (int(r) for r in args.rows.split(",")):
        q = jax.random.normal(jax.random.PRNGKey(rows), (rows, HEADS, HEAD_DIM), F32).astype(BF16)
        length = jnp.full((rows,), span - 2, jnp.int32).at[0].set(span // 3)  # one shorter row
        want = jax.jit(reference)(q, *layers[0], length, q, q)
        n_bytes = 2 * args.layers * rows * span * HEADS * HEAD_DIM * 2
        for name, attention in variants.items():
            start = time.perf_counter()
            try:
                error = float(jnp.max(jnp.abs(jax.jit(attention)(q, *layers[0], length, q, q) - want)))
                fn = jax.jit(functools.partial(step, attention))
                t = best_time_s(functools.partial(_chained, fn, q, layers, length), repeats=5, warmup=1) / CHAINED
            except Exception as e:  # a variant the compiler refuses must not cost the others their figures
                emit(bench="decode_attention", variant=name, rows=rows, error=error_text(e))
                continue
            rate = n_bytes / t
            emit(bench="decode_attention", variant=name, rows=rows, step_ms=figure(t * 1e3),
                 kv_gb=figure(n_bytes / 1e9), bytes_per_s=figure(rate),
                 fraction_of_datasheet=None if sheet_bytes_per_s is None else figure(rate / sheet_bytes_per_s, 3),
                 max_abs_error=figure(error), wall_s=round(time.perf_counter() - start, 1))


if __name__ == "__main__":
    main()
