"""int8 weights' products for the few rows of a decode step as a Pallas TPU kernel: x [R, K] @ w [N, K].T * scale [N],
the int8 matrix read a block of rows at a time into VMEM and converted there, so no converted copy of it is written.

XLA:TPU converts an int8 weight inside its matrix-vector fusions, relaying it out into the tiling the fusion wants
(docs/performance.md). On a v5e GPT-J-6B's int8 decode step runs 1.14x faster through this kernel at batch 1 and 32
(103 and 2,077 tokens/s against 90 and 1,827), 1.03x at 64 rows, while the paged engine's step of 64 slots ran 0.95x
XLA's: so it takes products of up to `MAX_ROWS` rows, both dims multiples of the TPU's 128 lanes (the TPU policy's
`int8_dot: "kernel"`, `model/layers.py`), and XLA's product the rest.

A product may read a range of w's rows and columns in place (`rows`, `cols`): a layer whose attention and MLP read
different inputs (two norms: Llama, GPT-NeoX sequential) multiplies each side by its rows of the joined "in" and its
columns of "out". A custom call's operand is a whole array, so w[a:b] given to it is first copied out by XLA: on a
v5e, Llama-2-7B's int8 decode step at batch 1 spent 15 of its 25 ms copying those slices.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

BLOCK_BYTES = 4 << 20  # the int8 rows of w a grid step reads (two in flight)
MAX_ROWS = 32  # more rows of x than this (64 slots, a prefill) are XLA's
LANES = 128
VMEM_LIMIT = 64 << 20  # of a v5e core's 128 MiB: two int8 blocks, the converted one and x
INTERPRET = False  # run in Pallas' interpreter (the CPU's tests)


def applies(x: jax.Array, w_NxK: jax.Array, rows: tuple[int, int] | None = None,
            cols: tuple[int, int] | None = None) -> bool:
    """Whether the kernel takes this product (of w's `rows` and `cols` ranges, default all): few rows of x, the
    ranges' starts and sizes whole lanes."""
    (r0, r1), (c0, c1) = rows or (0, w_NxK.shape[0]), cols or (0, w_NxK.shape[1])
    return x.size // x.shape[-1] <= MAX_ROWS and all(v % LANES == 0 for v in (r0, r1 - r0, c0, c1 - c0))


def _block_rows(n: int, k: int) -> int:
    """The rows of w a grid step reads: about BLOCK_BYTES of them, a multiple of the lanes dividing n."""
    rows = max(LANES, min(n, BLOCK_BYTES // k // LANES * LANES))
    while n % rows:
        rows -= LANES
    return rows


def bf16_exact(dtype) -> lax.Precision | None:
    """A Pallas kernel's products of `dtype` at the default precision where it is bf16, whatever a caller set: exact at
    any, and Mosaic refuses them at "highest"; other dtypes follow the caller's setting."""
    return lax.Precision.DEFAULT if dtype == jnp.bfloat16 else None


def _kernel(x_ref, w_ref, s_ref, o_ref):
    w = w_ref[...].astype(x_ref.dtype)
    acc = lax.dot_general(x_ref[...], w, (((1,), (1,)), ((), ())), precision=bf16_exact(x_ref.dtype),
                          preferred_element_type=jnp.float32)
    o_ref[...] = (acc * s_ref[...]).astype(o_ref.dtype)


def by_rows(x: jax.Array, w_NxK: jax.Array, scale_N: jax.Array, rows: tuple[int, int] | None = None,
            cols: tuple[int, int] | None = None) -> jax.Array:
    """x @ w[r0:r1, c0:c1].T * scale[r0:r1] for an int8 w (`rows` (r0, r1) and `cols` (c0, c1), default all, read
    in place), returned in x's dtype, as `quant.by_rows` computes it (products of x's dtype accumulated in f32, then
    scaled): the grid walks blocks of the rows, x whole in VMEM."""
    (r0, r1), (c0, c1) = rows or (0, w_NxK.shape[0]), cols or (0, w_NxK.shape[1])
    k, n = c1 - c0, r1 - r0
    if x.shape[-1] != k:
        raise ValueError(f"x has {x.shape[-1]} columns, the product reads {k} of w's")
    x_RxK = x.reshape(-1, k)
    n_x = x_RxK.shape[0]
    block = _block_rows(math.gcd(n, r0), k)  # whole blocks from r0: block r0 // block is the range's first
    first = r0 // block
    # columns from c0: in blocks of k where c0 is one's start, else at an element offset (Mosaic takes element
    # offsets in every dim of a block or in none)
    w_spec = (pl.BlockSpec((block, k), lambda j: (first + j, c0 // k)) if c0 % k == 0
              else pl.BlockSpec((pl.Element(block), pl.Element(k)), lambda j: ((first + j) * block, c0)))
    out = pl.pallas_call(
        _kernel, grid=(n // block,),
        in_specs=[pl.BlockSpec((n_x, k), lambda j: (0, 0)), w_spec, pl.BlockSpec((1, block), lambda j: (0, first + j))],
        out_specs=pl.BlockSpec((n_x, block), lambda j: (0, j)),
        out_shape=jax.ShapeDtypeStruct((n_x, n), x.dtype),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel",), vmem_limit_bytes=VMEM_LIMIT),
        interpret=INTERPRET)(x_RxK, w_NxK, scale_N.reshape(1, -1).astype(jnp.float32))
    return out.reshape(*x.shape[:-1], n)
