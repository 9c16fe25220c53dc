"""A paged KV cache: per layer, the keys and the values of every request of a dp group in pages of `page` positions
[P, page, H, K], heads split over 'mp' and pages over 'dp' (each group its own pool). A request holds a page table
[M] of its group's page ids, in order, taken as it grows (serve/pages.py keeps them); a request that shares a cached
prefix names the same pages, so a prefix is reused without a copy. A memory sized for a few long slots then serves
as many requests as their tokens fill.

One forward serves every program: R rows, row r computing tokens at positions start_r .. start_r + T - 1 (the first
length_r of them real, the rest padding, written nowhere), its queries seeing the keys of its pages before start_r
(the first `n_read` pages of its table gathered: `n_read` is static, a program per page-count bucket) and its own
new keys causally. A prompt is start 0 and n_read 0 (nothing read); a prompt tail after a cached prefix has start at
the prefix's end; a decode step is T = 1 at the row's position. The new keys are written at their positions through
the table after attention has read the pages. Out-of-range page ids (the table's padding) are dropped on write and
clipped on read, where the mask hides them. The pure-JAX path, every platform's by default, gathers the pages a
step reads (a copy of them); where the platform policy says "kernel" (`Policy.paged_attention`), pages hold heads
first and decode steps attend through JAX's TPU paged attention kernel, which reads them in place. The keys and
values are stored as `decode.cache_dtype` says (bits on the CPU), or with
`kv_cache_dtype` "int8" as int8 with a scale per token and head (half the bytes of bf16; dequantized as read).
Shape letters: the legend in model/layers.py (here P pages, M a table's pages, R rows).
"""
from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from mesh_transformer.config import Config
from mesh_transformer.infer import decode
from mesh_transformer.model import gptj
from mesh_transformer.model.order import in_turn
from mesh_transformer.platforms import Policy

PAGE_AXES = ("batch", "length", "heads", "head_dim")  # [P, page, H, K]: pages over dp, heads over mp
SCALE_AXES = ("batch", "length", "heads")  # [P, page, H]: an int8 cache's scale per token and head
INT8 = "int8"
KERNEL = "kernel"
KERNEL_BLOCK_TOKENS = 512  # the TPU kernel's pages per compute block: about this many positions
# The TPU kernel reads an int8 value as q * h / 127.5 (its quantization_utils.MAX_INT8): heads-first pages store
# h = scale * 127.5 for our scale, so that the kernel reads them in place.
KERNEL_INT8_RANGE = 127.5


class PagedCache(NamedTuple):
    """Per layer, the pages [P, page, H, K] of keys and of values; with an int8 cache (`kv_cache_dtype`) their
    scales [P, page, H] (else None per layer). With the policy's kernel, heads first: [H, P, page, K], [H, P, page]
    (the scales times KERNEL_INT8_RANGE)."""
    k: list
    v: list
    k_scale: list
    v_scale: list


def heads_first(policy: Policy) -> bool:
    """Whether pages hold heads first ([H, P, page, K]): the layout JAX's TPU paged attention kernel reads."""
    return policy.paged_attention == KERNEL


def _order(axes: tuple, policy: Policy) -> tuple:
    """Axes in the policy's page layout: the heads axis moved first where `heads_first`."""
    return (axes[2], *axes[:2], *axes[3:]) if heads_first(policy) else axes


def page_shape(n_pages: int, page: int, cfg: Config, policy: Policy) -> tuple[int, int, int, int]:
    return _order((n_pages, page, cfg.n_heads, cfg.head_dim), policy)


def zero_cache(n_pages: int, page: int, cfg: Config, policy: Policy) -> PagedCache:
    """An empty cache of n_pages pages (all of them: a dp group holds n_pages / dp)."""
    int8 = cfg.kv_cache_dtype == INT8
    dtype = jnp.int8 if int8 else decode.cache_dtype(cfg, policy)

    def zeros(shape, dtype):
        return [jnp.zeros(shape, dtype) for _ in range(cfg.layers)]

    shape = page_shape(n_pages, page, cfg, policy)
    scales = zeros(_order((n_pages, page, cfg.n_heads), policy), jnp.float32) if int8 else [None] * cfg.layers
    return PagedCache(zeros(shape, dtype), zeros(shape, dtype), scales, list(scales))


def cache_specs(layout) -> PagedCache:
    """The cache's PartitionSpecs, field by field (a prefix of its tree)."""
    policy = layout.policy
    pages, scales = layout.spec(_order(PAGE_AXES, policy)), layout.spec(_order(SCALE_AXES, policy))
    return PagedCache(pages, pages, scales, scales)


def quantize(x_RxTxHxK: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(int8 values, f32 scales [R, T, H]) of keys or values: one scale per token and head, its largest magnitude
    over 127 (1 where all are zero)."""
    x = x_RxTxHxK.astype(jnp.float32)
    peak = jnp.max(jnp.abs(x), axis=-1)
    scale = jnp.where(peak > 0, peak / 127, 1).astype(jnp.float32)
    return jnp.clip(jnp.round(x / scale[..., None]), -127, 127).astype(jnp.int8), scale


def _taken(pages: jax.Array, table_RxM: jax.Array, first: bool) -> jax.Array:
    """Each row's pages [R, M, page, ...] (the heads after the positions), from pages of either layout."""
    if not first:
        return jnp.take(pages, table_RxM, axis=0, mode="clip")
    taken = jnp.take(pages, table_RxM, axis=1, mode="clip")  # [H, R, M, page, ...]
    return jnp.moveaxis(taken, 0, 3)


def gather_pages(pages: jax.Array, table_RxM: jax.Array, dtype: Any, scales: jax.Array | None = None,
                 first: bool = False) -> jax.Array:
    """The positions of each row's pages in order [R, M * page, H, K], as values of `dtype` (an int8 cache's
    dequantized by its `scales`); `first`: the pages hold heads first."""
    rows, m = table_RxM.shape
    taken = _taken(pages, table_RxM, first)  # [R, M, page, H, K]
    if scales is None:
        values = decode.cached(taken, dtype)
    else:
        scale = _taken(scales, table_RxM, first)[..., None] / (KERNEL_INT8_RANGE if first else 1)
        values = (taken.astype(jnp.float32) * scale).astype(dtype)
    return values.reshape(rows, m * taken.shape[2], *taken.shape[3:])


def write_positions(table_RxM: jax.Array, position_RxT: jax.Array, real_RxT: jax.Array, n_pages: int,
                    page: int) -> tuple[jax.Array, jax.Array]:
    """Where each token's key goes: (page id, offset in it) [R, T]; a padding token's, or one past the table's
    pages, is page n_pages (out of range: the scatter drops it)."""
    slot_RxT = position_RxT // page
    inside_RxT = real_RxT & (slot_RxT < table_RxM.shape[1])
    page_RxT = jnp.take_along_axis(table_RxM, jnp.minimum(slot_RxT, table_RxM.shape[1] - 1), axis=1)
    return jnp.where(inside_RxT, page_RxT, n_pages), position_RxT % page


class _PagedKV(NamedTuple):
    """The paged cache's hook (`gptj.KV`): reads the first `n_read` pages of each row's table (keys before the
    row's start), writes the rows' real new keys and values through the table. Where the policy runs decode through
    the TPU kernel (`heads_first`), a one-token step's read is instead the attention itself (`_kernel_attention`):
    it writes the new keys first, then attends over the pages up to and including them; its written pages wait in
    `pending` for the layer's `write`, which returns them."""
    table_RxM: jax.Array
    start_R: jax.Array
    length_R: jax.Array
    n_read: int
    dtype: Any
    policy: Policy
    pending: list

    def read(self, state, h_RxTxD):
        if heads_first(self.policy) and h_RxTxD.shape[1] == 1 and self.n_read:
            return lambda q, k, v: self._kernel_attention(state, q, k, v)
        if not self.n_read:
            return None
        k, v, k_scale, v_scale = state
        page = k.shape[2 if heads_first(self.policy) else 1]
        past_mask_Rx1xS = (jnp.arange(self.n_read * page)[None, :] < self.start_R[:, None])[:, None, :]
        table_RxM = self.table_RxM[:, :self.n_read]
        past = [[gather_pages(pages, table_RxM, self.dtype, scales, heads_first(self.policy))]
                for pages, scales in ((k, k_scale), (v, v_scale))]
        past_k, past_v = in_turn(h_RxTxD, past, self.policy)
        return past_k, past_v, past_mask_Rx1xS

    def write(self, state, k_RxTxHxK, v_RxTxHxK, h_RxTxD):
        if self.pending:  # written before the kernel read them
            return self.pending.pop()
        return self._written(state, k_RxTxHxK, v_RxTxHxK, decode.after_reads(h_RxTxD, k_RxTxHxK.dtype))

    def _written(self, state, k_RxTxHxK, v_RxTxHxK, after_Rx1x1x1):
        k, v, k_scale, v_scale = state
        first = heads_first(self.policy)
        tokens = k_RxTxHxK.shape[1]
        position_RxT = self.start_R[:, None] + jnp.arange(tokens)[None]
        real_RxT = jnp.arange(tokens)[None] < self.length_R[:, None]
        n_pages, page = (k.shape[1], k.shape[2]) if first else (k.shape[0], k.shape[1])
        at = write_positions(self.table_RxM, position_RxT, real_RxT, n_pages, page)
        at = (slice(None), *at) if first else at

        def laid(x_RxTxH_):  # the values in the pages' order: [H, R, T, ...] where heads come first
            return jnp.moveaxis(x_RxTxH_, 2, 0) if first else x_RxTxH_

        written = []
        for pages, scales, new in ((k, k_scale, k_RxTxHxK), (v, v_scale, v_RxTxHxK)):
            new = new + after_Rx1x1x1
            if scales is None:
                written.append((decode.scatter(pages, at, laid(new.astype(self.dtype))), None))
            else:
                values, scale = quantize(new)
                scale = scale * KERNEL_INT8_RANGE if first else scale
                written.append((pages.at[at].set(laid(values), mode="drop"),
                                scales.at[at].set(laid(scale), mode="drop")))
        (k, k_scale), (v, v_scale) = written
        return k, v, k_scale, v_scale

    def _kernel_attention(self, state, q_Rx1xHxK, k_Rx1xHxK, v_Rx1xHxK):
        """One decode step's attention by JAX's TPU paged attention kernel: the row's new key and value written
        first, then its query against its first `n_read` pages up to its own position."""
        from jax.experimental.pallas.ops.tpu.paged_attention import paged_attention
        from jax.experimental.pallas.ops.tpu.paged_attention.quantization_utils import QuantizedTensor

        state = self._written(state, k_Rx1xHxK, v_Rx1xHxK, 0)
        self.pending.append(state)
        k, v, k_scale, v_scale = state
        if k_scale is not None:
            k, v = QuantizedTensor(k, k_scale[..., None]), QuantizedTensor(v, v_scale[..., None])
        else:  # values as they are (a TPU's); bits where a policy stores them so (a copy: tests on the CPU)
            k, v = decode.cached(k, self.dtype), decode.cached(v, self.dtype)
        page = state[0].shape[2]
        block = math.gcd(self.n_read, max(1, KERNEL_BLOCK_TOKENS // page))
        head_dim = q_Rx1xHxK.shape[-1]
        q_RxHxK = (q_Rx1xHxK[:, 0].astype(jnp.float32) / math.sqrt(head_dim)).astype(q_Rx1xHxK.dtype)
        ctx_RxHxK = paged_attention(q_RxHxK, k, v, self.start_R + 1, self.table_RxM[:, :self.n_read],
                                    pages_per_compute_block=block)
        return ctx_RxHxK.reshape(ctx_RxHxK.shape[0], 1, -1)


def paged_logits(params: dict, cache: PagedCache, ids_RxT: jax.Array, start_R: jax.Array, length_R: jax.Array,
                 table_RxM: jax.Array, cfg: Config, n_read: int, tp_axis: str | None = None, *,
                 policy: Policy) -> tuple[jax.Array, PagedCache]:
    """Run R rows of tokens at positions start_r on (`_PagedKV`); the logits after each row's last real token
    [R, V] and the cache with their keys and values written."""
    kv = _PagedKV(table_RxM, start_R, length_R, n_read, gptj.precision(cfg).compute, policy, [])
    positions_RxT = start_R[:, None] + gptj.positions(ids_RxT)
    mask = jnp.ones((ids_RxT.shape[0], 1, 1), bool) if ids_RxT.shape[1] == 1 else None  # None: causal
    logits_RxV, cache = decode.run_cached(params, cache, ids_RxT, positions_RxT, kv, cfg, tp_axis, policy,
                                           mask_BxTxS=mask, columns_BxC=(length_R - 1)[:, None])
    return logits_RxV, cache


def prefill_local(params, cache, slots_N: decode.Slots, ids_RxT, start_R, length_R, table_RxM, slot_R, sampling_R,
                  *, cfg, policy, n_read: int, top: int = 0, tp_axis=None):
    """`decode.prefill_local` on the paged cache: prompts (start 0, n_read 0) or prompt tails after cached prefixes,
    row r's tokens written through its table; each row's first token chosen and written into its slot of slots_N
    (the per-request sampling state, as with the slot cache)."""
    logits_RxV, cache = paged_logits(params, cache, ids_RxT, start_R, length_R, table_RxM, cfg, n_read, tp_axis,
                                     policy=policy)
    return decode.first_tokens(logits_RxV, cache, slots_N, slot_R, sampling_R, top)


def decode_local(params, cache, slots_N: decode.Slots, steps_N: decode.Steps, table_NxM, *, cfg, policy, rows: int,
                 n_read: int, top: int = 0, penalized: bool = False, tp_axis=None):
    """`decode.decode_local` on the paged cache: one token for each of the first `rows` slots, whose keys before
    their positions lie in the first `n_read` pages of their tables."""
    position_R = steps_N.position[:rows]
    logits_RxV, cache = paged_logits(params, cache, slots_N.last[:rows, None], position_R,
                                     jnp.ones_like(position_R), table_NxM[:rows], cfg, n_read, tp_axis,
                                     policy=policy)
    return decode.next_tokens(logits_RxV, cache, slots_N, steps_N, rows, top, penalized)

