"""One decode step's attention over the slot cache (`infer/decode.py`: per layer, blocks [N, S_j, H, K] of
consecutive positions, slots first) on a TPU, as a Pallas kernel that reads the first R slots of each block in place.

XLA runs this attention as a copy of the R slots out of each block (when R is fewer than the cache's slots), streamed
into VMEM, then a multiply-reduce over the copies for the scores and another for the values: on a v5e, 6.5 ms of an
int8 GPT-J-6B step of 14.2 at 32 rows of 192 positions (2.8 GB of keys and values, half the datasheet's bandwidth).
Here one call walks a group of rows' positions chunk by chunk through all the blocks, Pallas' pipeline copying the
next chunk from HBM while one is computed on (a block's index stays put outside its own chunks, so the pipeline copies
one chunk a step: where every block's first chunk was copied at a group's start, the copies came in bursts and the
call ran at 0.67 of the datasheet's bandwidth); a group's chunks past its longest row are never copied nor computed.

A row's chunk [P, H, K] is computed one of two ways (`form`). "mxu": viewed as [P*H, K] (a reshape that keeps the
TPU's tiles where H fills them), the scores of every head against every position's heads are one matrix product
[H, P*H], of which each head keeps its own columns; the softmax runs on those lane-dense rows and the probabilities
[H, P*H] (zero off a head's own columns) times the values [P*H, K] are the output, a second product. "vpu": the query
times the keys summed over the head dim on the vector unit, and the probabilities times the values summed over
positions (any number of heads). The softmax runs online over the chunks (flash decoding), in f32. The step's own new
key and value are not in the cache when it is read (they are written after attention, `decode._DecodeKV.write`): the
call returns its rows' unnormalized output, maximum and sum (`Partial`), and `attend` joins them with the new key's
score.
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

from mesh_transformer.infer.paged_kernel import MASKED
from mesh_transformer.model.quant_kernel import bf16_exact

F32 = jnp.float32
NAME = "decode_attention"  # the call's name in a compiled program (the estimator's to know: it reads the first R
# slots of its cache operands, not all of them)
ROWS = 4  # rows a grid step copies, at most (a divisor of R)
POSITIONS = 64  # positions of a block a grid step copies, at most (a divisor of the block's)
BUFFERS_BYTES = 40 * 2 ** 20  # the pipeline's buffers (two of each block's keys and values), at most: fewer
# positions and rows a step where they would be more
VMEM_LIMIT = 64 * 2 ** 20  # of a v5e core's 128 MiB: the buffers and a row's work
MIN_ROWS = 2  # a step of one row attends by XLA's: on a v5e, GPT-J-6B's bf16 step of one row took 16.7 ms through
# the kernel against XLA's 15.9 (its 28 calls cost more than a row's 3 MB a layer that XLA reads beside the weights)


class Partial(NamedTuple):
    """Attention before its softmax is normalized, per row and head: the sum over the real positions of exp(s - m) v
    [R, H, K], the scores' maximum m [R, H] (MASKED where there is none) and the sum of exp(s - m) [R, H]."""
    acc: jax.Array
    m: jax.Array
    total: jax.Array


class _Block(NamedTuple):
    """Where one block of the cache lies in the call's walk: its first position and first chunk, its chunks and
    their positions."""
    start: int
    first: int
    chunks: int
    chunk: int


def runs(policy, rows: int) -> bool:
    """Whether a decode step of `rows` rows attends through the kernel: where the policy says "kernel"
    (`Policy.decode_attention`) and the rows are at least MIN_ROWS."""
    return policy.decode_attention == "kernel" and rows >= MIN_ROWS


def _divisor(n: int, most: int) -> int:
    """The largest divisor of n that is at most `most`."""
    return max(d for d in range(1, min(n, most) + 1) if n % d == 0)


def _tile_rows(dtype) -> int:
    """The rows (sublanes) of one TPU tile of `dtype`: 8 of f32, 16 of bf16, 32 of int8."""
    return 8 * (4 // jnp.dtype(dtype).itemsize)


def form_for(heads: int, dtype) -> str:
    """"mxu" where a chunk's (key) heads fill whole tiles of sublanes (8 of f32, 16 of bf16) and are a power of two (the
    head of a column is its low bits), and bf16 chunks of 8 heads viewed through f32 (Llama-3-8B's: on a v5e, 0.30 ms
    against the vector form's 1.39 at 128 rows, bench/decode_kernel_bench.py), else "vpu"."""
    tiles = heads % _tile_rows(dtype) == 0 or (jnp.dtype(dtype) == jnp.bfloat16 and heads % _tile_rows(F32) == 0)
    return "mxu" if tiles and heads & (heads - 1) == 0 else "vpu"


def _online(s, real, m_prev, axis: int):
    """One chunk's step of the online softmax over `axis` (positions): the scores masked where not `real`, the new
    maximum, the chunk's probabilities (0 where not real) and the factor the sums so far are rescaled by."""
    s = jnp.where(real, s, MASKED)
    m_next = jnp.maximum(m_prev, jnp.max(s, axis=axis, keepdims=axis == 1))
    p = jnp.where(real, jnp.exp(s - (m_next[None] if axis == 0 else m_next)), 0.0)
    return m_next, p, jnp.exp(m_prev - m_next)


def _row_vpu(q_HxK, k_PxNxK, v_PxNxK, first_position, length, scale, m_Hx1, l_Hx1, acc_HxK):
    positions, kv_heads, head_dim = k_PxNxK.shape  # N key heads, each read by G = H / N query heads
    q_1xNxGxK = q_HxK.astype(F32).reshape(1, kv_heads, -1, head_dim)
    s_PxHx1 = (jnp.sum(k_PxNxK.astype(F32)[:, :, None] * q_1xNxGxK, axis=-1) * scale).reshape(positions, -1, 1)
    real = first_position + lax.broadcasted_iota(jnp.int32, s_PxHx1.shape, 0) < length
    m_next, p_PxHx1, alpha = _online(s_PxHx1, real, m_Hx1, axis=0)
    p_PxNxGx1 = p_PxHx1.reshape(positions, kv_heads, -1, 1)
    acc_HxK = alpha * acc_HxK + jnp.sum(v_PxNxK.astype(F32)[:, :, None] * p_PxNxGx1, axis=0).reshape(-1, head_dim)
    return m_next, alpha * l_Hx1 + jnp.sum(p_PxHx1, axis=0), acc_HxK


def _row_mxu(q_HxK, k_PxNxK, v_PxNxK, first_position, length, scale, m_Hx1, l_Hx1, acc_HxK):
    positions, kv_heads, head_dim = k_PxNxK.shape
    group = q_HxK.shape[0] // kv_heads  # query heads per key head: query head h reads key head h // group
    if kv_heads % _tile_rows(k_PxNxK.dtype):  # (bf16 heads fewer than a tile's 16 sublanes: through f32's 8)
        k, v = (x.astype(F32).reshape(positions * kv_heads, head_dim).astype(x.dtype) for x in (k_PxNxK, v_PxNxK))
    else:
        k, v = (x.reshape(positions * kv_heads, head_dim) for x in (k_PxNxK, v_PxNxK))
    s_HxC = lax.dot_general(q_HxK.astype(k.dtype), k, (((1,), (1,)), ((), ())), precision=bf16_exact(k.dtype),
                            preferred_element_type=F32) * scale
    column = lax.broadcasted_iota(jnp.int32, s_HxC.shape, 1)
    row = lax.broadcasted_iota(jnp.int32, s_HxC.shape, 0)
    own = (column & (kv_heads - 1)) == (row if group == 1 else lax.div(row, group))  # (// lowers through sign)
    real = own & (first_position + (column >> (kv_heads.bit_length() - 1)) < length)
    m_next, p_HxC, alpha = _online(s_HxC, real, m_Hx1, axis=1)
    acc_HxK = alpha * acc_HxK + jnp.dot(p_HxC.astype(v.dtype), v, precision=bf16_exact(v.dtype),
                                        preferred_element_type=F32)
    return m_next, alpha * l_Hx1 + jnp.sum(p_HxC, axis=1, keepdims=True), acc_HxK


def _kernel(length_ref, needed_ref, q_ref, *refs, blocks: tuple, rows: int, form: str, scale: float):
    n = len(blocks)
    k_refs, v_refs, (acc_ref, m_ref, l_ref) = refs[:n], refs[n:2 * n], refs[2 * n:]
    group, c = pl.program_id(0), pl.program_id(1)
    row_fn = _row_mxu if form == "mxu" else _row_vpu

    @pl.when(c == 0)
    def init():
        acc_ref[...] = jnp.zeros(acc_ref.shape, F32)
        m_ref[...] = jnp.full(m_ref.shape, MASKED, F32)
        l_ref[...] = jnp.zeros(l_ref.shape, F32)

    for block, k_ref, v_ref in zip(blocks, k_refs, v_refs):
        @pl.when((c >= block.first) & (c < block.first + block.chunks) & (c < needed_ref[group]))
        def compute(block=block, k_ref=k_ref, v_ref=v_ref):
            first_position = block.start + (c - block.first) * block.chunk

            def row(r, carry):
                m, total, acc = row_fn(q_ref[r], k_ref[r], v_ref[r], first_position, length_ref[group * rows + r],
                                       scale, m_ref[r], l_ref[r], acc_ref[r])
                m_ref[r], l_ref[r], acc_ref[r] = m, total, acc
                return carry

            lax.fori_loop(0, rows, row, 0)


@functools.partial(jax.jit, static_argnames=("most_rows", "most_positions", "form"))
def cached_partial(q_RxHxK: jax.Array, k_blocks: list, v_blocks: list, length_R: jax.Array, *, most_rows: int = ROWS,
                   most_positions: int = POSITIONS, form: str | None = None) -> Partial:
    """The first R slots' attention over the cache's blocks: queries [R, H, K] against the keys and values of
    blocks [N, S_j, H_kv, K] (N >= R; consecutive positions from 0; any float dtype; H_kv key heads, each read by
    H / H_kv query heads), of which row r sees the positions before length_R[r]. A grid step copies at most
    `most_rows` rows and `most_positions` positions of a block; `form` (None: `form_for`) is how a row's chunk is
    computed."""
    n_rows, heads, head_dim = q_RxHxK.shape
    kv_heads, dtype = k_blocks[0].shape[2], k_blocks[0].dtype
    form = form or form_for(kv_heads, dtype)
    per_position = len(k_blocks) * kv_heads * head_dim * dtype.itemsize  # of a row, every block's, keys or values
    most_positions = max(1, min(most_positions, BUFFERS_BYTES // (2 * 2 * per_position)))
    layout, start, first = [], 0, 0
    for k_block in k_blocks:
        span = k_block.shape[1]
        chunk = _divisor(span, most_positions)
        layout.append(_Block(start, first, span // chunk, chunk))
        start, first = start + span, first + span // chunk
    most_rows = max(1, min(most_rows, BUFFERS_BYTES // (2 * 2 * max(b.chunk for b in layout) * per_position)))
    rows = _divisor(n_rows, most_rows)
    groups = n_rows // rows
    longest_G = jnp.max(length_R.astype(jnp.int32).reshape(groups, rows), axis=1)
    needed_G = sum((jnp.clip(longest_G - b.start, 0, b.chunks * b.chunk) + b.chunk - 1) // b.chunk for b in layout)

    def rows_of(g, c, length, needed):
        return g, 0, 0

    def chunk_of(block: _Block):
        def index(g, c, length, needed):
            # Before the block's first chunk, the one it held since the group before (its last; the first group's
            # first), so its first is copied during the step before it, as every other chunk is; past the group's
            # last chunk, the one it holds.
            at = jnp.minimum(c, needed[g] - 1) - block.first
            before = at < 0
            return (jnp.where(before & (g > 0), g - 1, g), jnp.where(before & (g > 0), block.chunks - 1,
                                                                       jnp.clip(at, 0, block.chunks - 1)), 0, 0)
        return pl.BlockSpec((rows, block.chunk, kv_heads, head_dim), index)

    kv_specs = [chunk_of(b) for b in layout]
    out = pl.BlockSpec((rows, heads, head_dim), rows_of)
    stat = pl.BlockSpec((rows, heads, 1), rows_of)
    kernel = functools.partial(_kernel, blocks=tuple(layout), rows=rows, form=form, scale=1 / math.sqrt(head_dim))
    acc, m, total = pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(num_scalar_prefetch=2, grid=(groups, first),
                                               in_specs=[out, *kv_specs, *kv_specs], out_specs=[out, stat, stat]),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary"),
                                             vmem_limit_bytes=VMEM_LIMIT),
        out_shape=[jax.ShapeDtypeStruct((n_rows, heads, head_dim), F32),
                   *[jax.ShapeDtypeStruct((n_rows, heads, 1), F32)] * 2],
        name=NAME,
    )(length_R.astype(jnp.int32), needed_G.astype(jnp.int32), q_RxHxK, *k_blocks, *v_blocks)
    return Partial(acc, m[..., 0], total[..., 0])


def attend(q_RxHxK: jax.Array, k_blocks: list, v_blocks: list, length_R: jax.Array, k_new_RxHxK: jax.Array,
           v_new_RxHxK: jax.Array, **grid) -> jax.Array:
    """Each of R rows' one query [R, H, K] against its slot's cached positions before length_R[r], held in the
    blocks (consecutive positions from 0, each [N, S_j, H, K]), and its own new key and value: the attention's
    output [R, H, K] in f32. `grid`: `cached_partial`'s most_rows, most_positions and form."""
    past = cached_partial(q_RxHxK, k_blocks, v_blocks, length_R, **grid)
    group = q_RxHxK.shape[1] // k_new_RxHxK.shape[1]  # fewer key heads: each read by its group of query heads
    k_new_RxHxK, v_new_RxHxK = (jnp.repeat(x, group, axis=1) for x in (k_new_RxHxK, v_new_RxHxK))
    s_new_RxH = jnp.sum(q_RxHxK.astype(F32) * k_new_RxHxK.astype(F32), axis=-1) / math.sqrt(q_RxHxK.shape[-1])
    m_RxH = jnp.maximum(past.m, s_new_RxH)
    new_RxH, alpha_RxH = jnp.exp(s_new_RxH - m_RxH), jnp.exp(past.m - m_RxH)
    acc_RxHxK = alpha_RxH[..., None] * past.acc + new_RxH[..., None] * v_new_RxHxK.astype(F32)
    return acc_RxHxK / (alpha_RxH * past.total + new_RxH)[..., None]
