"""A paged KV cache: per layer, the keys and the values of every request of a dp group in pages of `page` positions
[P, page, H, K], heads split over 'mp' and pages over 'dp' (each group its own pool). A request holds a page table
[M] of its group's page ids, in order, taken as it grows (infer/pages.py keeps them); a request that shares a cached
prefix names the same pages, so a prefix is reused without a copy. A memory sized for a few long slots then serves
as many requests as their tokens fill.

One forward serves every program: R rows, row r computing tokens at positions start_r .. start_r + T - 1 (the first
length_r of them real, the rest padding, written nowhere), its queries seeing the keys of its pages before start_r
(the first `n_read` pages of its table gathered: `n_read` is static, a program per page-count bucket) and its own
new keys causally. A prompt is start 0 and n_read 0 (nothing read); a prompt tail after a cached prefix has start at
the prefix's end; a decode step is T = 1 at the row's position. The new keys are written at their positions through
the table after attention has read the pages. Out-of-range page ids (the table's padding) are dropped on write and
clipped on read, where the mask hides them. The pure-JAX path (the CPU's and GPUs') gathers the pages a step reads
(a copy of them); where the platform policy says "kernel" (`Policy.paged_attention`: TPUs from v4), a page holds its
heads together and decode steps attend through the TPU kernel of `infer/paged_kernel.py`, which reads the pages in
place (prompt tails after a cached prefix still gather). The keys and values are stored as `decode.cache_dtype`
says (bits on the CPU), or with `kv_cache_dtype` "int8" as int8 with a scale per token and head (half the bytes of
bf16; the scales applied to attention's scores and probabilities, the int8 values read by its dots as they are).
Shape letters: the legend in model/layers.py (here P pages, M a table's pages, R rows).
"""
from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from mesh_transformer.config import Config
from mesh_transformer.infer import decode, paged_kernel
from mesh_transformer.model import gptj
from mesh_transformer.model.attention import Scaled
from mesh_transformer.model.order import in_turn, waits_for
from mesh_transformer.platforms import Policy

PAGE_AXES = ("batch", "length", "heads", "head_dim")  # [P, page, H, K]: pages over dp, heads over mp
SCALE_AXES = ("batch", "length", "heads")  # [P, page, H]: an int8 cache's scale per token and head
INT8 = "int8"
KERNEL = "kernel"
KERNEL_BLOCK_TOKENS = 512  # the TPU kernel's pages per block: about this many positions (a row of 384 in one)


class PagedCache(NamedTuple):
    """Per layer, the pages [P, page, H, K] of keys and of values; with an int8 cache (`kv_cache_dtype`) their
    scales [P, page, H] (else None per layer), their axes in the policy's order (`page_order`, `scale_order`): a
    page's heads together for the kernel ([P, H, page, K]; its scales as they are), positions last on the CPU."""
    k: list
    v: list
    k_scale: list
    v_scale: list


def kernel_pages(policy: Policy) -> bool:
    """Whether decode steps attend through the TPU kernel, which reads pages in its own layout."""
    return policy.paged_attention == KERNEL


def page_order(policy: Policy) -> tuple[int, ...]:
    """A page array's axes, as positions of [P, page, H, K]: the kernel's ([P, H, page, K]), else the platform's
    cache order (`Policy.cache_order`: positions last on the CPU, the layout its one-token dot reads in place)."""
    return paged_kernel.PAGE_ORDER if kernel_pages(policy) else policy.cache_order


def scale_order(policy: Policy) -> tuple[int, ...]:
    """An int8 cache's scale array's axes, as positions of [P, page, H]: the kernel's, else the pages' without
    the head dim."""
    return paged_kernel.SCALE_ORDER if kernel_pages(policy) else tuple(i for i in page_order(policy) if i != 3)


def _ordered(sizes: tuple, order: tuple) -> tuple:
    return tuple(sizes[i] for i in order)


def page_shape(n_pages: int, page: int, cfg: Config, policy: Policy) -> tuple[int, int, int, int]:
    return _ordered((n_pages, page, cfg.kv_heads, cfg.head_dim), page_order(policy))


def zero_cache(n_pages: int, page: int, cfg: Config, policy: Policy) -> PagedCache:
    """An empty cache of n_pages pages (all of them: a dp group holds n_pages / dp)."""
    int8 = cfg.kv_cache_dtype == INT8
    dtype = jnp.int8 if int8 else decode.cache_dtype(cfg, policy)

    def zeros(shape, dtype):
        return [jnp.zeros(shape, dtype) for _ in range(cfg.layers)]

    scale_shape = _ordered((n_pages, page, cfg.kv_heads), scale_order(policy))
    scales = zeros(scale_shape, jnp.float32) if int8 else [None] * cfg.layers
    return PagedCache(zeros(page_shape(n_pages, page, cfg, policy), dtype), zeros(page_shape(
        n_pages, page, cfg, policy), dtype), scales, list(scales))


def cache_specs(layout) -> PagedCache:
    """The cache's PartitionSpecs, field by field (a prefix of its tree)."""
    pages = layout.spec(_ordered(PAGE_AXES, page_order(layout.policy)))
    scales = layout.spec(_ordered(SCALE_AXES, scale_order(layout.policy)))
    return PagedCache(pages, pages, scales, scales)


def quantize(x_RxTxHxK: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(int8 values, f32 scales [R, T, H]) of keys or values: one scale per token and head, its largest magnitude
    over 127 (1 where all are zero)."""
    x = x_RxTxHxK.astype(jnp.float32)
    peak = jnp.max(jnp.abs(x), axis=-1)
    scale = jnp.where(peak > 0, peak / 127, 1).astype(jnp.float32)
    return jnp.clip(jnp.round(x / scale[..., None]), -127, 127).astype(jnp.int8), scale


def _rows(pages: jax.Array, table_RxM: jax.Array, order: tuple) -> jax.Array:
    """Each row's pages as one sequence [R, M * page, H(, K)], from pages whose axes are `order`: taken by the table,
    their M pages joined next to the positions (one copy), then viewed in sequence order (for the dot, which takes
    the positions where the order holds them)."""
    taken = jnp.take(pages, table_RxM, axis=order.index(0), mode="clip")
    names = list(order)
    names[order.index(0):order.index(0) + 1] = ["R", "M"]
    joined = ["R"] + [n for o in order if o != 0 for n in (("M", 1) if o == 1 else (o,))]
    x = taken.transpose([names.index(n) for n in joined])
    at = joined.index("M")
    x = x.reshape(*x.shape[:at], x.shape[at] * x.shape[at + 1], *x.shape[at + 2:])
    rest = [o for o in order if o != 0]  # x's axes after R, the positions now one
    return x.transpose([0, *(1 + rest.index(o) for o in sorted(rest))])


def gather_pages(pages: jax.Array, table_RxM: jax.Array, dtype: Any, scales: jax.Array | None = None,
                 order: tuple = (0, 1, 2, 3), scales_order: tuple = (0, 1, 2)) -> jax.Array | Scaled:
    """The positions of each row's pages in order [R, M * page, H, K], as values of `dtype`, or an int8 cache's as
    `Scaled` (its int8 values and their scales [R, M * page, H], applied by `attend` to scores and probabilities),
    from pages and scales whose axes are `order` and `scales_order` (`page_order`, `scale_order`)."""
    values = _rows(pages, table_RxM, order)
    if scales is None:
        return decode.cached(values, dtype)
    return Scaled(values, _rows(scales, table_RxM, scales_order))


def _after(gathered: list) -> jax.Array:
    """Zeros [R, 1, 1, 1] computed from gathered pages (arrays or `Scaled`, [R, S, H, K]): what a write waits for."""
    firsts = [(g.values if isinstance(g, Scaled) else g)[:, :1, :1, :1] for g in gathered]
    return sum(0 * f.astype(jnp.float32) for f in firsts)


def _index(order: tuple, page_RxT: jax.Array, offset_RxT: jax.Array) -> tuple:
    """The index of these tokens' (page, offset) in pages whose axes are `order`."""
    index: list = [slice(None)] * len(order)
    index[order.index(0)], index[order.index(1)] = page_RxT, offset_RxT
    return tuple(index)


def _laid(x_RxTx_: jax.Array, order: tuple) -> jax.Array:
    """Values [R, T, H(, K)] in the axes `_index` selects them as: numpy's rule puts the two index arrays' [R, T] where
    they stand when they are next to each other, else first."""
    a, b = sorted((order.index(0), order.index(1)))
    rest = [o for o in order if o > 1]
    if b == a + 1:
        dims = [*rest[:a], "R", "T", *rest[a:]]
    else:
        dims = ["R", "T", *rest]
    src = ["R", "T", *sorted(rest)]
    return x_RxTx_.transpose([src.index(d) for d in dims])


def write_positions(table_RxM: jax.Array, position_RxT: jax.Array, real_RxT: jax.Array, n_pages: int,
                    page: int) -> tuple[jax.Array, jax.Array]:
    """Where each token's key goes: (page id, offset in it) [R, T]; a padding token's, one at a negative position
    (a row a step takes no token of) or one past the table's pages, is page n_pages (out of range: the scatter drops
    it)."""
    slot_RxT = position_RxT // page
    inside_RxT = real_RxT & (slot_RxT >= 0) & (slot_RxT < table_RxM.shape[1])
    page_RxT = jnp.take_along_axis(table_RxM, jnp.clip(slot_RxT, 0, table_RxM.shape[1] - 1), axis=1)
    return jnp.where(inside_RxT, page_RxT, n_pages), position_RxT % page


class _PagedKV(NamedTuple):
    """The paged cache's hook (`gptj.KV`): reads the first `n_read` pages of each row's table (keys before the
    row's start), writes the rows' real new keys and values through the table. Where the policy runs decode through
    the TPU kernel (`kernel_pages`), a one-token step's read is instead the attention itself (`_kernel_attention`):
    it writes the new keys first, then attends over the pages up to and including them; its written pages wait in
    `pending` for the layer's `write`, which returns them. A gathered read leaves in `read_ties` a value of what it
    gathered, which the layer's write waits for (`_after`): written before the gather, the pages would have to be
    copied whole to keep the read's values."""
    table_RxM: jax.Array
    start_R: jax.Array
    length_R: jax.Array
    n_read: int
    dtype: Any
    policy: Policy
    pending: list
    read_ties: list

    def read(self, state, h_RxTxD):
        if kernel_pages(self.policy) and h_RxTxD.shape[1] == 1 and self.n_read:
            return lambda q, k, v: self._kernel_attention(state, q, k, v)
        if not self.n_read:
            return None
        k, v, k_scale, v_scale = state
        order = page_order(self.policy)
        page = k.shape[order.index(1)]
        past_mask_Rx1xS = (jnp.arange(self.n_read * page)[None, :] < self.start_R[:, None])[:, None, :]
        # The gather waits for the layer's input: unordered, XLA:TPU gathers every layer's pages up front, all alive
        # at once (GPT-J-6B's 4 x 256-token tail prefill: 5.5 GiB of temporaries on a v5e).
        table_RxM = waits_for(h_RxTxD, self.table_RxM[:, :self.n_read])
        past = [[gather_pages(pages, table_RxM, self.dtype, scales, order, scale_order(self.policy))]
                for pages, scales in ((k, k_scale), (v, v_scale))]
        past_k, past_v = in_turn(h_RxTxD, past, self.policy)
        self.read_ties.append(_after([past_k[0], past_v[0]]))
        return past_k, past_v, past_mask_Rx1xS

    def write(self, state, k_RxTxHxK, v_RxTxHxK, h_RxTxD):
        """The layer's new keys and values written through the table: after its gather of the pages, where it read
        some; else at once. (Tied to the layer's output instead, as the slot cache's extend is, XLA:TPU keeps every
        layer's attention scores of a 2048-token prefill alive together: compiled for a v5e, GPT-J-6B int8's
        program needed 6.04 GiB of temporaries that way, 2.00 this way.)"""
        if self.pending:  # written before the kernel read them
            return self.pending.pop()
        after = self.read_ties.pop().astype(k_RxTxHxK.dtype) if self.read_ties else 0
        return self._written(state, k_RxTxHxK, v_RxTxHxK, after)

    def _written(self, state, k_RxTxHxK, v_RxTxHxK, after_Rx1x1x1):
        k, v, k_scale, v_scale = state
        order = page_order(self.policy)
        tokens = k_RxTxHxK.shape[1]
        position_RxT = self.start_R[:, None] + jnp.arange(tokens)[None]
        real_RxT = jnp.arange(tokens)[None] < self.length_R[:, None]
        page_RxT, offset_RxT = write_positions(self.table_RxM, position_RxT, real_RxT, k.shape[order.index(0)],
                                               k.shape[order.index(1)])
        scales_order = scale_order(self.policy)
        at, at_scale = _index(order, page_RxT, offset_RxT), _index(scales_order, page_RxT, offset_RxT)
        written = []
        for pages, scales, new in ((k, k_scale, k_RxTxHxK), (v, v_scale, v_RxTxHxK)):
            new = new + after_Rx1x1x1
            if scales is None:
                written.append((decode.scatter(pages, at, _laid(new.astype(self.dtype), order)), None))
            else:
                values, scale = quantize(new)
                written.append((pages.at[at].set(_laid(values, order), mode="drop"),
                                scales.at[at_scale].set(_laid(scale, scales_order), mode="drop")))
        (k, k_scale), (v, v_scale) = written
        return k, v, k_scale, v_scale

    def _kernel_attention(self, state, q_Rx1xHxK, k_Rx1xHxK, v_Rx1xHxK):
        """One decode step's attention by the TPU kernel (`paged_kernel.paged_decode_attention`): the row's new key
        and value written first, then its query against its first `n_read` pages up to its own position."""
        state = self._written(state, k_Rx1xHxK, v_Rx1xHxK, 0)
        self.pending.append(state)
        k, v, k_scale, v_scale = state
        if k_scale is None:  # values as they are (a TPU's); bits where a policy stores them so (a copy: tests on CPU)
            k, v = decode.cached(k, self.dtype), decode.cached(v, self.dtype)
        n_pages, page = k.shape[0], k.shape[2]
        head_dim = q_Rx1xHxK.shape[-1]
        q_RxHxK = (q_Rx1xHxK[:, 0].astype(jnp.float32) / math.sqrt(head_dim)).astype(q_Rx1xHxK.dtype)
        # A table's padding names a page out of range: the kernel copies the pages a row's length spans, so it is held
        # in range. A row that takes no token (position -1) has length 0: the kernel passes over it.
        table_RxM = jnp.minimum(self.table_RxM[:, :self.n_read], n_pages - 1)
        length_R = jnp.clip(self.start_R + 1, 0, self.n_read * page)
        per_block = max(1, min(self.n_read, KERNEL_BLOCK_TOKENS // page))
        ctx_RxHxK = paged_kernel.paged_decode_attention(q_RxHxK, k, v, k_scale, v_scale, length_R, table_RxM,
                                                        pages_per_block=per_block)
        return ctx_RxHxK.astype(q_Rx1xHxK.dtype).reshape(ctx_RxHxK.shape[0], 1, -1)


def paged_logits(params: dict, cache: PagedCache, ids_RxT: jax.Array, start_R: jax.Array, length_R: jax.Array,
                 table_RxM: jax.Array, cfg: Config, n_read: int, tp_axis: str | None = None, *,
                 policy: Policy, adapters=None) -> tuple[jax.Array, PagedCache]:
    """Run R rows of tokens at positions start_r on (`_PagedKV`); the logits after each row's last real token
    [R, V] and the cache with their keys and values written."""
    kv = _PagedKV(table_RxM, start_R, length_R, n_read, gptj.precision(cfg).compute, policy, [], [])
    positions_RxT = start_R[:, None] + gptj.positions(ids_RxT)
    mask = jnp.ones((ids_RxT.shape[0], 1, 1), bool) if ids_RxT.shape[1] == 1 else None  # None: causal
    logits_RxV, cache = decode.run_cached(params, cache, ids_RxT, positions_RxT, kv, cfg, tp_axis, policy,
                                           mask_BxTxS=mask, columns_BxC=(length_R - 1)[:, None],
                                           adapters=adapters)
    return logits_RxV, cache


def prefill_local(params, cache, slots_N: decode.Slots, ids_RxT, start_R, length_R, table_RxM, slot_R, sampling_R,
                  index_R, *, cfg, policy, n_read: int, top: int = 0, tp_axis=None):
    """`decode.prefill_local` on the paged cache: prompts (start 0, n_read 0) or prompt tails after cached prefixes,
    row r's tokens written through its table; each row's next token chosen (as its completion's token index_R[r])
    and written into its slot of slots_N (the per-request sampling state, as with the slot cache)."""
    logits_RxV, cache = paged_logits(params, cache, ids_RxT, start_R, length_R, table_RxM, cfg, n_read, tp_axis,
                                     policy=policy, adapters=decode.served(sampling_R))
    return decode.first_tokens(logits_RxV, cache, slots_N, slot_R, sampling_R, top, index_R)


def decode_local(params, cache, slots_N: decode.Slots, steps_N: decode.Steps, table_NxM, *, cfg, policy, rows: int,
                 n_read: int, top: int = 0, tp_axis=None):
    """`decode.decode_local` on the paged cache: one token for each of the first `rows` slots, whose keys before
    their positions lie in the first `n_read` pages of their tables."""
    position_R = steps_N.position[:rows]
    logits_RxV, cache = paged_logits(params, cache, slots_N.last[:rows, None], position_R,
                                     jnp.ones_like(position_R), table_NxM[:rows], cfg, n_read, tp_axis,
                                     policy=policy, adapters=decode.served(steps_N.sampling, rows))
    return decode.next_tokens(logits_RxV, cache, slots_N, steps_N, rows, top)

