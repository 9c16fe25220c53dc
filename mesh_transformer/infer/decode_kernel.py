"""One decode step's attention over the slot cache (`infer/decode.py`: per layer, blocks [N, S_j, H, K] of
consecutive positions, slots first) on a TPU, as a Pallas kernel that reads the first R slots of each block in place.

XLA runs this attention as a copy of the R slots out of each block (when R is fewer than the cache's slots), streamed
into VMEM, then a multiply-reduce over the copies for the scores and another for the values: on a v5e, 6.5 ms of an
int8 GPT-J-6B step of 14.2 at 32 rows of 192 positions (2.8 GB of keys and values, half the datasheet's bandwidth).
Here Pallas' pipeline copies a grid step's rows and positions from HBM while the step before is computed on, and a row
group's positions past its longest row are never copied (the grid's block index stays put, so the copy is skipped).

Per row, the scores are the query times each position's keys summed over the head dim on the vector unit (a product
of one query row would use a sliver of the matrix unit), the softmax runs online over chunks of positions (flash
decoding), and the probabilities times the values summed over positions are the output. The step's own new key and
value are not in the cache when it is read (they are written after attention, `decode._DecodeKV.write`): each
block's call returns its rows' unnormalized output, running maximum and sum (`Partial`), and `attend` joins the
blocks' partials with the new key's score, in f32.
"""
from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

F32 = jnp.float32
MASKED = -1e30  # a masked score's running maximum: exp(MASKED - m) is 0 for any real m, and no inf - inf
ROWS = 8  # rows a grid step copies, at most (a divisor of R)
POSITIONS = 64  # positions a grid step copies, at most (a divisor of the block's): 8 rows x 64 x GPT-J's 8 KiB
# per position, 4 MiB of keys and 4 of values a step, twice for the pipeline's two buffers
VMEM_LIMIT = 64 * 2 ** 20  # of a v5e core's 128 MiB: the buffers and a row's f32 work


class Partial(NamedTuple):
    """A block's attention for each row and head, before the softmax is normalized: sum over its real positions of
    exp(s - m) v [R, H, K], the scores' maximum m [R, H] (MASKED where it has none) and sum of exp(s - m) [R, H]."""
    acc: jax.Array
    m: jax.Array
    total: jax.Array


def _divisor(n: int, most: int) -> int:
    """The largest divisor of n that is at most `most`."""
    return max(d for d in range(1, min(n, most) + 1) if n % d == 0)


def _kernel(length_ref, chunks_ref, q_ref, k_ref, v_ref, acc_ref, m_ref, l_ref, *, start: int, chunk: int,
            rows: int):
    group, c = pl.program_id(0), pl.program_id(1)

    @pl.when(c == 0)
    def init():
        acc_ref[...] = jnp.zeros(acc_ref.shape, F32)
        m_ref[...] = jnp.full(m_ref.shape, MASKED, F32)
        l_ref[...] = jnp.zeros(l_ref.shape, F32)

    @pl.when(c < chunks_ref[group])  # a chunk past the group's longest row: not copied, not computed
    def compute():
        def row(r, carry):
            q_HxK = q_ref[r]
            s_PxHx1 = jnp.sum(k_ref[r].astype(F32) * q_HxK[None], axis=-1, keepdims=True)
            position = start + c * chunk + lax.broadcasted_iota(jnp.int32, s_PxHx1.shape, 0)
            real = position < length_ref[group * rows + r]
            s_PxHx1 = jnp.where(real, s_PxHx1, MASKED)
            m_prev_Hx1 = m_ref[r]
            m_next_Hx1 = jnp.maximum(m_prev_Hx1, jnp.max(s_PxHx1, axis=0))
            p_PxHx1 = jnp.where(real, jnp.exp(s_PxHx1 - m_next_Hx1[None]), 0.0)
            alpha_Hx1 = jnp.exp(m_prev_Hx1 - m_next_Hx1)
            l_ref[r] = alpha_Hx1 * l_ref[r] + jnp.sum(p_PxHx1, axis=0)
            acc_ref[r] = alpha_Hx1 * acc_ref[r] + jnp.sum(v_ref[r].astype(F32) * p_PxHx1, axis=0)
            m_ref[r] = m_next_Hx1
            return carry

        lax.fori_loop(0, rows, row, 0)


@functools.partial(jax.jit, static_argnames=("start", "most_rows", "most_positions"))
def block_partial(q_RxHxK: jax.Array, k_block: jax.Array, v_block: jax.Array, length_R: jax.Array, *,
                  start: int, most_rows: int = ROWS, most_positions: int = POSITIONS) -> Partial:
    """The first R slots' attention over one block of the cache: queries [R, H, K] (f32, scaled by 1/sqrt(K)
    already) against the block's keys and values [N, S_j, H, K] (N >= R; any float dtype), which hold positions
    start .. start + S_j - 1, of which row r sees those before length_R[r]. A grid step copies at most `most_rows`
    rows and `most_positions` positions."""
    n_rows, heads, head_dim = q_RxHxK.shape
    span = k_block.shape[1]
    rows, chunk = _divisor(n_rows, most_rows), _divisor(span, most_positions)
    groups = n_rows // rows
    longest_G = jnp.max(length_R.astype(jnp.int32).reshape(groups, rows), axis=1)
    chunks_G = (jnp.clip(longest_G - start, 0, span) + chunk - 1) // chunk

    def row_block(g, c, length, chunks):
        return g, 0, 0

    def kv_block(g, c, length, chunks):  # past the group's last chunk: the last one again, so nothing is copied
        return g, jnp.maximum(jnp.minimum(c, chunks[g] - 1), 0), 0, 0

    kv_spec = pl.BlockSpec((rows, chunk, heads, head_dim), kv_block)
    out = pl.BlockSpec((rows, heads, head_dim), row_block)
    stat = pl.BlockSpec((rows, heads, 1), row_block)
    kernel = functools.partial(_kernel, start=start, chunk=chunk, rows=rows)
    acc, m, total = pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(num_scalar_prefetch=2, grid=(groups, span // chunk),
                                               in_specs=[out, kv_spec, kv_spec], out_specs=[out, stat, stat]),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary"),
                                             vmem_limit_bytes=VMEM_LIMIT),
        out_shape=[jax.ShapeDtypeStruct((n_rows, heads, head_dim), F32),
                   *[jax.ShapeDtypeStruct((n_rows, heads, 1), F32)] * 2],
    )(length_R.astype(jnp.int32), chunks_G.astype(jnp.int32), q_RxHxK.astype(F32), k_block, v_block)
    return Partial(acc, m[..., 0], total[..., 0])


def attend(q_RxHxK: jax.Array, k_blocks: list, v_blocks: list, length_R: jax.Array, k_new_RxHxK: jax.Array,
           v_new_RxHxK: jax.Array, **grid) -> jax.Array:
    """Each of R rows' one query [R, H, K] against its slot's cached positions before length_R[r], held in the
    blocks (consecutive positions from 0, each [N, S_j, H, K]), and its own new key and value: the attention's
    output [R, H, K] in f32. `grid`: `block_partial`'s most_rows and most_positions."""
    q_RxHxK = q_RxHxK.astype(F32) / math.sqrt(q_RxHxK.shape[-1])
    parts, start = [], 0
    for k_block, v_block in zip(k_blocks, v_blocks):
        parts.append(block_partial(q_RxHxK, k_block, v_block, length_R, start=start, **grid))
        start += k_block.shape[1]
    s_new_RxH = jnp.sum(q_RxHxK * k_new_RxHxK.astype(F32), axis=-1)
    m_RxH = functools.reduce(jnp.maximum, [part.m for part in parts], s_new_RxH)
    new_RxH = jnp.exp(s_new_RxH - m_RxH)
    acc_RxHxK, l_RxH = new_RxH[..., None] * v_new_RxHxK.astype(F32), new_RxH
    for part in parts:
        alpha_RxH = jnp.exp(part.m - m_RxH)
        acc_RxHxK, l_RxH = acc_RxHxK + alpha_RxH[..., None] * part.acc, l_RxH + alpha_RxH * part.total
    return acc_RxHxK / l_RxH[..., None]
