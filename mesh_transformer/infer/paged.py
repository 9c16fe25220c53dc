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
clipped on read, where the mask hides them. This is the pure-JAX path of every platform: the gather copies the
pages a step reads. The keys and values are stored as `decode.cache_dtype` says (bits on the CPU), or with
`kv_cache_dtype` "int8" as int8 with a scale per token and head (half the bytes of bf16; dequantized as read).
Shape letters: the legend in model/layers.py (here P pages, M a table's pages, R rows).
"""
from __future__ import annotations

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


class PagedCache(NamedTuple):
    """Per layer, the pages [P, page, H, K] of keys and of values; with an int8 cache (`kv_cache_dtype`) their
    scales [P, page, H] (else None per layer)."""
    k: list
    v: list
    k_scale: list
    v_scale: list


def page_shape(n_pages: int, page: int, cfg: Config) -> tuple[int, int, int, int]:
    return n_pages, page, cfg.n_heads, cfg.head_dim


def zero_cache(n_pages: int, page: int, cfg: Config, policy: Policy) -> PagedCache:
    """An empty cache of n_pages pages (all of them: a dp group holds n_pages / dp)."""
    int8 = cfg.kv_cache_dtype == INT8
    dtype = jnp.int8 if int8 else decode.cache_dtype(cfg, policy)

    def zeros(shape, dtype):
        return [jnp.zeros(shape, dtype) for _ in range(cfg.layers)]

    shape = page_shape(n_pages, page, cfg)
    scales = zeros(shape[:3], jnp.float32) if int8 else [None] * cfg.layers
    return PagedCache(zeros(shape, dtype), zeros(shape, dtype), scales, list(scales))


def cache_specs(layout) -> PagedCache:
    """The cache's PartitionSpecs, field by field (a prefix of its tree)."""
    pages, scales = layout.spec(PAGE_AXES), layout.spec(SCALE_AXES)
    return PagedCache(pages, pages, scales, scales)


def quantize(x_RxTxHxK: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(int8 values, f32 scales [R, T, H]) of keys or values: one scale per token and head, its largest magnitude
    over 127 (1 where all are zero)."""
    x = x_RxTxHxK.astype(jnp.float32)
    peak = jnp.max(jnp.abs(x), axis=-1)
    scale = jnp.where(peak > 0, peak / 127, 1).astype(jnp.float32)
    return jnp.clip(jnp.round(x / scale[..., None]), -127, 127).astype(jnp.int8), scale


def gather_pages(pages: jax.Array, table_RxM: jax.Array, dtype: Any, scales: jax.Array | None = None) -> jax.Array:
    """The positions of each row's pages in order [R, M * page, H, K], as values of `dtype` (an int8 cache's
    dequantized by its `scales`)."""
    rows, m = table_RxM.shape
    taken = jnp.take(pages, table_RxM, axis=0, mode="clip")  # [R, M, page, H, K]
    if scales is None:
        values = decode.cached(taken, dtype)
    else:
        scale = jnp.take(scales, table_RxM, axis=0, mode="clip")[..., None]
        values = (taken.astype(jnp.float32) * scale).astype(dtype)
    return values.reshape(rows, m * pages.shape[1], *pages.shape[2:])


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
    row's start), writes the rows' real new keys and values through the table."""
    table_RxM: jax.Array
    start_R: jax.Array
    length_R: jax.Array
    n_read: int
    dtype: Any
    policy: Policy

    def read(self, state, h_RxTxD):
        if not self.n_read:
            return None
        k, v, k_scale, v_scale = state
        page = k.shape[1]
        past_mask_Rx1xS = (jnp.arange(self.n_read * page)[None, :] < self.start_R[:, None])[:, None, :]
        table_RxM = self.table_RxM[:, :self.n_read]
        past = [[gather_pages(pages, table_RxM, self.dtype, scales)] for pages, scales in ((k, k_scale),
                                                                                          (v, v_scale))]
        past_k, past_v = in_turn(h_RxTxD, past, self.policy)
        return past_k, past_v, past_mask_Rx1xS

    def write(self, state, k_RxTxHxK, v_RxTxHxK, h_RxTxD):
        k, v, k_scale, v_scale = state
        after_Rx1x1x1 = decode.after_reads(h_RxTxD, k_RxTxHxK.dtype)
        tokens = k_RxTxHxK.shape[1]
        position_RxT = self.start_R[:, None] + jnp.arange(tokens)[None]
        real_RxT = jnp.arange(tokens)[None] < self.length_R[:, None]
        at = write_positions(self.table_RxM, position_RxT, real_RxT, k.shape[0], k.shape[1])
        written = []
        for pages, scales, new in ((k, k_scale, k_RxTxHxK), (v, v_scale, v_RxTxHxK)):
            new = new + after_Rx1x1x1
            if scales is None:
                written.append((decode.scatter(pages, at, new.astype(self.dtype)), None))
            else:
                values, scale = quantize(new)
                written.append((pages.at[at].set(values, mode="drop"), scales.at[at].set(scale, mode="drop")))
        (k, k_scale), (v, v_scale) = written
        return k, v, k_scale, v_scale


def paged_logits(params: dict, cache: PagedCache, ids_RxT: jax.Array, start_R: jax.Array, length_R: jax.Array,
                 table_RxM: jax.Array, cfg: Config, n_read: int, tp_axis: str | None = None, *,
                 policy: Policy) -> tuple[jax.Array, PagedCache]:
    """Run R rows of tokens at positions start_r on (`_PagedKV`); the logits after each row's last real token
    [R, V] and the cache with their keys and values written."""
    kv = _PagedKV(table_RxM, start_R, length_R, n_read, gptj.precision(cfg).compute, policy)
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

