"""One decode step's attention over the paged cache on a TPU, as a Pallas kernel that reads each row's pages in
place, int8 pages with their per-token scales included.

JAX's own TPU paged attention kernel (`jax.experimental.pallas.ops.tpu.paged_attention`) takes int8 pages only with
scales of the pages' full shape: given a scale per token and head, its wrapper broadcasts them to [H, P, page, K] f32
every step, four times the int8 pages' bytes (22.5 GB a step for GPT-J-6B's 1,536 pages of 16, measured from the
compiled program). This kernel applies a key's scale to its score and a value's to its probability instead, so a
step reads the int8 pages and a float per token and head (1.6% of a GPT-J page's bytes; the runtime lays the
[P, page, H] scales out pages-minor, so XLA copies each layer's to this kernel's row-major layout and back every step:
docs/performance.md).

The grid walks the rows in order, one at a time. A row's pages are read in blocks of `pages_per_block` pages
(`pages_per_block * page` positions, the last block's positions past the row's length masked), copied from HBM into
one of two VMEM buffers while the other is computed on; the block after a row's last is the next row's first, so the
copies never wait between rows. Only the pages a row reads are copied: at Llama-2-7B's serving shape a last block is
half read on average (rows of 1,024 to 2,048 positions, blocks of 512). A row of length 0 (a step's row that takes
no token: a free slot's) copies and computes nothing, where it copied a page and computed a whole block: a step of
17 requests computes 64 rows (the decode programs' row counts are 1, 4, 16 and 64).
Per key head, a block's scores are rows [G, positions] (its G query heads times the keys, by the matrix unit; G is
1 without grouped-query attention), scaled by the keys' scales (as rows: the block's [positions, H] scales
transposed once, by the matrix unit too), softmax runs online over the blocks (flash decoding), and the
probabilities, scaled by the values' scales, times the values give the head's output.

How a block's heads are computed is a form (`FORMS`). "dense", the default: every key head's two products are
independent of the others', their scores stored as rows of one [H, positions] scratch and their outputs as rows of
[H, K], and the softmax, the running maximum and sums and the output's update run once on all heads' dense rows. "mxu"
(the first form, kept as the baseline of `bench/paged_kernel_bench.py`): each head's softmax and update on its own
rows of the running state, before the next head's products. On a v5e at one Llama-2-7B layer's serving shape (12 rows
of 1,536 positions, 32 heads of 128, int8 pages of 16) "dense" takes 0.247 ms, "mxu" 0.460 and the pages' copies
alone 0.266 (docs/performance.md).

Layouts: pages [P, H_kv, page, K] (a page's heads together: one copy a page), scales [P, page, H_kv] (a page's
tokens by heads: one small copy a page).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from mesh_transformer.model.quant_kernel import bf16_exact

PAGE_ORDER = (0, 2, 1, 3)  # the pages' axes, as positions of [P, page, H, K]
SCALE_ORDER = (0, 1, 2)  # the scales' axes, as positions of [P, page, H]
VMEM_LIMIT = 64 * 2 ** 20  # of a v5e core's 128 MiB: two blocks of 512 bf16 positions' keys and values and their work
MASKED = -1e30  # a masked score: exp(MASKED - m) is 0 for any real m, and no inf - inf


def _dot_t(a: jax.Array, b: jax.Array, **kw) -> jax.Array:
    """a @ b.T in f32."""
    return lax.dot_general(a, b, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32, **kw)


def _rows(x_SxH: jax.Array) -> jax.Array:
    """x transposed [H, S] by a product with the identity at full precision (the matrix unit's transpose)."""
    heads = x_SxH.shape[1]
    eye = (lax.broadcasted_iota(jnp.int32, (heads, heads), 0) == lax.broadcasted_iota(jnp.int32, (heads, heads), 1))
    return _dot_t(eye.astype(jnp.float32), x_SxH, precision=lax.Precision.HIGHEST)


def _mxu(q_ref, head, k_scales, v_scales, start, length, m_ref, l_ref, acc_ref, *, kv_heads: int, group: int,
         span: int, work):
    """A block head by head: each key head's products, then its softmax and output on its own rows of m, l and acc."""
    real = start + lax.broadcasted_iota(jnp.int32, (1, span), 1) < length
    if k_scales is not None:
        k_scales, v_scales = _rows(k_scales), _rows(v_scales)  # [H_kv, span]
    for h in range(kv_heads):
        at = pl.ds(h * group, group)
        q = q_ref[at, :]  # [G, K]
        s = _dot_t(q, head("k", h, q.dtype), precision=bf16_exact(q.dtype))  # [G, span]
        s = jnp.where(real, s * k_scales[h:h + 1] if k_scales is not None else s, MASKED)
        m_prev = m_ref[at, :]
        m_next = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
        p = jnp.exp(s - m_next)
        alpha = jnp.exp(m_prev - m_next)
        l_ref[at, :] = alpha * l_ref[at, :] + jnp.sum(p, axis=1, keepdims=True)
        m_ref[at, :] = m_next
        if v_scales is not None:
            p = p * v_scales[h:h + 1]
        acc_ref[at, :] = alpha * acc_ref[at, :] + jnp.dot(p.astype(q.dtype), head("v", h, q.dtype),
                                                          precision=bf16_exact(q.dtype),
                                                          preferred_element_type=jnp.float32)


def _dense(q_ref, head, k_scales, v_scales, start, length, m_ref, l_ref, acc_ref, *, kv_heads: int, group: int,
           span: int, work):
    """A block by the matrix unit, each key head's products independent of the others': its scores stored as rows of
    `work`'s [H, span] and its output as rows of its [H, K], the softmax and the output's update once for all heads on
    those dense rows."""
    s_ref, o_ref = work
    if k_scales is not None:
        k_scales, v_scales = _rows(k_scales), _rows(v_scales)  # [H_kv, span]
    for h in range(kv_heads):
        q = q_ref[pl.ds(h * group, group), :]  # [G, K]
        s = _dot_t(q, head("k", h, q.dtype), precision=bf16_exact(q.dtype))  # [G, span]
        s_ref[pl.ds(h * group, group), :] = s * k_scales[h:h + 1] if k_scales is not None else s
    real = start + lax.broadcasted_iota(jnp.int32, (1, span), 1) < length
    s = jnp.where(real, s_ref[...], MASKED)
    m_prev = m_ref[...]
    m_next = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
    p = jnp.exp(s - m_next)
    alpha = jnp.exp(m_prev - m_next)
    l_ref[...] = alpha * l_ref[...] + jnp.sum(p, axis=1, keepdims=True)
    m_ref[...] = m_next
    for h in range(kv_heads):
        p_h = p[h * group:(h + 1) * group]
        if v_scales is not None:
            p_h = p_h * v_scales[h:h + 1]
        o_ref[pl.ds(h * group, group), :] = jnp.dot(p_h.astype(q_ref.dtype), head("v", h, q_ref.dtype),
                                                    precision=bf16_exact(q_ref.dtype),
                                                    preferred_element_type=jnp.float32)
    acc_ref[...] = alpha * acc_ref[...] + o_ref[...]


FORMS = {"dense": _dense, "mxu": _mxu}


def _kernel(length_ref, table_ref, q_ref, k_hbm, v_hbm, *rest, n_rows: int, width: int, per_block: int,
            scaled: bool, form):
    if scaled:
        k_scale_hbm, v_scale_hbm, out_ref, k_buf, v_buf, k_scale_buf, v_scale_buf, sems, slot_ref, m_ref, l_ref, \
            acc_ref, *work = rest
    else:
        out_ref, k_buf, v_buf, sems, slot_ref, m_ref, l_ref, acc_ref, *work = rest
    kv_heads, page, head_dim = k_buf.shape[2:]
    group = q_ref.shape[0] // kv_heads  # query heads per key head (grouped-query attention)
    span = per_block * page
    row = pl.program_id(0)
    attend = FORMS[form] if isinstance(form, str) else form

    def copies(r, block, slot, act: str):
        """Start or wait (`act`) the copies of row r's block `block` into buffer `slot`: each page of it the row
        reads (the block's pages past the row's length are left as they were) and, int8, their scales."""
        needed = lax.div(length_ref[r] + page - 1, page)
        for j in range(per_block):
            at = block * per_block + j

            @pl.when(at < needed)
            def one_page(j=j, at=at):
                page_id = table_ref[r * width + jnp.minimum(at, width - 1)]
                pairs = [(k_hbm, k_buf, 0), (v_hbm, v_buf, 1)]
                if scaled:
                    pairs += [(k_scale_hbm, k_scale_buf, 0), (v_scale_hbm, v_scale_buf, 1)]
                for hbm, buf, sem in pairs:
                    getattr(pltpu.make_async_copy(hbm.at[page_id], buf.at[slot, j], sems.at[sem, slot]), act)()

    def n_blocks(r):
        return lax.div(length_ref[r] + span - 1, span)  # (lengths are positive; // lowers through sign)

    @pl.when(row == 0)
    def first():
        # A block's pages past its row's length keep what an earlier copy left, masked; until one did, what the
        # buffers held: zeros here, so a masked position's value is finite (0 x NaN would be NaN).
        for buf in (k_scale_buf, v_scale_buf) if scaled else (k_buf, v_buf):
            buf[...] = jnp.zeros(buf.shape, buf.dtype)
        slot_ref[0] = 0
        copies(0, 0, 0, "start")

    m_ref[...] = jnp.full(m_ref.shape, MASKED, jnp.float32)
    l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
    acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)
    length, count = length_ref[row], n_blocks(row)

    @pl.when((count == 0) & (row + 1 < n_rows))
    def pass_on():
        # A row of no position (one a step computes but takes no token of) copies and computes nothing: the next
        # row's first block, which a row's last block would have started, starts here.
        copies(row + 1, 0, slot_ref[0], "start")

    def block(i, carry):
        slot = slot_ref[0]
        last = i + 1 >= count
        next_row, next_block = jnp.where(last, row + 1, row), jnp.where(last, 0, i + 1)

        @pl.when(next_row < n_rows)
        def prefetch():
            copies(next_row, next_block, 1 - slot, "start")

        copies(row, i, slot, "wait")

        def head(kind, h, dtype):
            """Head h's keys or values of the block as [span, K] of `dtype`."""
            x = (k_buf if kind == "k" else v_buf)[slot, :, h].astype(jnp.float32).reshape(span, head_dim)
            return x if dtype == jnp.float32 else x.astype(dtype)

        k_scales, v_scales = ((buf[slot].reshape(span, kv_heads) for buf in (k_scale_buf, v_scale_buf)) if scaled
                              else (None, None))  # [span, H_kv]
        attend(q_ref, head, k_scales, v_scales, i * span, length, m_ref, l_ref, acc_ref, kv_heads=kv_heads,
               group=group, span=span, work=work)
        slot_ref[0] = 1 - slot
        return carry

    lax.fori_loop(0, count, block, 0)
    # (a row of length 0 has acc 0 and l 0: its output 0; a real row's l is at least 1, its maximum's own term)
    out_ref[...] = (acc_ref[...] / jnp.maximum(l_ref[...], 1.0)).astype(out_ref.dtype)


@functools.partial(jax.jit, static_argnames=("pages_per_block", "form"))
def paged_decode_attention(q_RxHxK: jax.Array, k_pages: jax.Array, v_pages: jax.Array, k_scales: jax.Array | None,
                           v_scales: jax.Array | None, length_R: jax.Array, table_RxM: jax.Array, *,
                           pages_per_block: int, form="dense") -> jax.Array:
    """Each row's query [R, H, K] (scaled by 1/sqrt(K) already) against the first length_r positions of its pages
    (table_RxM, page ids in range; a row of length 0 reads nothing and its output is 0); returns the attention's
    output [R, H, K] in f32. Pages [P, H_kv,
    page, K] of any dtype (H_kv key heads, each read by H / H_kv query heads); with int8 pages their scales [P, page,
    H_kv] (f32: a value is int8 x scale), else None. `form`: how a block is computed, a name of FORMS (or a function of
    a form's arguments: the bench's floors)."""
    n_rows, heads, head_dim = q_RxHxK.shape
    kv_heads, page = k_pages.shape[1:3]
    width = table_RxM.shape[1]
    scaled = k_scales is not None
    hbm = pl.BlockSpec(memory_space=pl.ANY)
    row_spec = pl.BlockSpec((None, heads, head_dim), lambda r, *_: (r, 0, 0))
    buffers = [pltpu.VMEM((2, pages_per_block, kv_heads, page, head_dim), k_pages.dtype)] * 2
    if scaled:
        buffers += [pltpu.VMEM((2, pages_per_block, page, kv_heads), jnp.float32)] * 2
    scratch = [*buffers, pltpu.SemaphoreType.DMA((2, 2)), pltpu.SMEM((1,), jnp.int32),
               pltpu.VMEM((heads, 1), jnp.float32), pltpu.VMEM((heads, 1), jnp.float32),
               pltpu.VMEM((heads, head_dim), jnp.float32),  # m, l, acc; then the dense form's work: scores, output
               pltpu.VMEM((heads, pages_per_block * page), jnp.float32), pltpu.VMEM((heads, head_dim), jnp.float32)]
    kernel = functools.partial(_kernel, n_rows=n_rows, width=width, per_block=pages_per_block, scaled=scaled,
                               form=form)
    pages = [k_pages, v_pages, *([k_scales, v_scales] if scaled else [])]
    return pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(num_scalar_prefetch=2, grid=(n_rows,),
                                               in_specs=[row_spec, *[hbm] * len(pages)], out_specs=row_spec,
                                               scratch_shapes=scratch),
        # rows in order: a row's last block starts the next row's first copy, so they run on one core in turn
        compiler_params=pltpu.CompilerParams(dimension_semantics=("arbitrary",), vmem_limit_bytes=VMEM_LIMIT),
        out_shape=jax.ShapeDtypeStruct((n_rows, heads, head_dim), jnp.float32),
    )(length_R.astype(jnp.int32), table_RxM.reshape(-1).astype(jnp.int32), q_RxHxK, *pages)
