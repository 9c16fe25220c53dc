"""THE decode stack: prefill prompts into slots of a KV cache, advance busy slots one token at a time, and choose each
token by its row's own sampling values. The offline sampler and the serving engine both run these programs.

The cache holds N slots of S positions, per layer for keys and for values a list of blocks of consecutive positions
(`block_sizes`; the values' bits, `cache_dtype`), heads split over 'mp' and slots over 'dp'. A decode step reads
only the first blocks, as many as the furthest busy slot needs, in place: slicing a span out of one array per layer
costs a strided copy per layer per step. A block is [N, S_j, H, K] with its axes in the order the platform policy
names (`block_shape`): positions last on the CPU, the layout XLA's CPU dot wants for one-token attention; positions
second for XLA:TPU, which otherwise copies every block into that layout around the sampler's decode loop (6.77 GiB
for GPT-J-6B's 8 slots on a v5e chip: aot_check.py); heads before positions for XLA:GPU (the least it copies). On a
TPU a step of two rows or more attends through `decode_kernel` (`Policy.decode_attention`), which reads the rows'
part of each block in place, where XLA copies it out of the blocks when the rows are fewer than the slots.
Both programs run per device (the Layout's shard_map) with the same forward as training, the layers unrolled over
unstacked params (`params.place_params`): a scan over stacked layers would copy each layer's weights out of the
stack at every token. Each row's token is chosen by `choose.choose`.

A prompt is written from position 0 of its slot (right-padded to its bucket), its rotary positions are its own, and
its queries see only keys at or before their own position. A prompt whose first tokens are cached already (the
server's prefix cache, serve/prefix.py) has only the rest computed (`extend_local`): after the cached keys, held in
its own slot or copied in from another of its dp group. The compiled programs over these functions: programs.py.
Token i of a request is drawn with key fold_in(PRNGKey(seed), i), so a completion does not depend on what else is
batched. Shape letters: the legend in model/layers.py (here N cache slots, R of them computed in a step, S cache
length, T prompt bucket).
"""
from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from mesh_transformer.config import Config
from mesh_transformer.infer import decode_kernel
from mesh_transformer.infer.choose import Sampling, choose, dense_bias
from mesh_transformer.model import gptj, layers, lora_slots
from mesh_transformer.model.order import in_turn, weights_in_turn
from mesh_transformer.platforms import Policy

class Steps(NamedTuple):
    """What a decode step needs per slot [N]: where its last token's key goes, which token of its request is drawn
    (the key's fold-in), and how."""
    position: Any  # i32
    index: Any  # i32
    sampling: Sampling


class KVCache(NamedTuple):
    """Per layer, a list of blocks (`block_shape`) of keys and of values."""
    k: list
    v: list


SEQUENCE_AXES = ("batch", "length", "heads", "head_dim")  # [N, S, H, K], which the policy's cache_order permutes


def block_shape(n_slots: int, length: int, cfg: Config, policy: Policy) -> tuple[int, ...]:
    """A cache block's shape: [N, S_j, H, K] in the policy's order (`cache_order`)."""
    sizes = (n_slots, length, cfg.kv_heads, cfg.head_dim)
    return tuple(sizes[i] for i in policy.cache_order)


def block_axes(policy: Policy) -> tuple[str, ...]:
    """A cache block's logical axes (its placement: slots over dp, heads over mp)."""
    return tuple(SEQUENCE_AXES[i] for i in policy.cache_order)


def _at(order: tuple, rows, positions) -> tuple:
    """The index of these rows' positions in a block of this order. Heads come before the head dim in every order,
    so the values it takes are [rows..., H, K]."""
    index = [slice(None)] * 4
    index[0], index[order.index(1)] = rows, positions
    return tuple(index)


def _as_sequence(block: jax.Array, order: tuple) -> jax.Array:
    """A block as [N, S_j, H, K]."""
    return block.transpose(tuple(int(i) for i in np.argsort(order)))


MIN_BLOCK = 32  # the shortest stretch of the cache a decode step reads: one block of it
SPAN_BUCKETS = 3  # by default a step reads 1, 2 or 4 blocks of seq/4: each block count is a program per row count


def default_block(seq: int) -> int:
    """The serving cache's block length for a context of `seq` positions."""
    return max(MIN_BLOCK, seq >> (SPAN_BUCKETS - 1))


def block_sizes(seq: int, block: int) -> list[int]:
    """The lengths of the cache blocks: `block` positions each, the last one shorter if `seq` is not a multiple."""
    return [min(block, seq - start) for start in range(0, seq, block)]


def _length(block: jax.Array, order: tuple) -> int:
    """How many positions a block of this order holds."""
    return block.shape[order.index(1)]


def _starts(blocks: list, order: tuple) -> list[int]:
    """The first position of each block."""
    starts = [0]
    for b in blocks[:-1]:
        starts.append(starts[-1] + _length(b, order))
    return starts


def after_reads(h_RxTxD: jax.Array, dtype) -> jax.Array:
    """Zeros [R, 1, 1, 1] computed from a layer's output h: added to what a layer writes into the cache, they order
    the write after attention's reads of it (which h comes from). Unordered, XLA keeps the two apart by copying the
    whole cache. (Not zero only where h is NaN, which the row's output would be anyway.)"""
    return 0 * h_RxTxD[:, :1, :1, None].astype(dtype)


# ------------------------------------------------------------------------------------------------------- programs
def cache_dtype(cfg: Config, policy: Policy) -> jnp.dtype:
    """What the cache stores: compute-dtype values, or where the policy says (CPU) the bits of 16-bit ones, as
    unsigned integers of the same width. XLA's CPU scatter has no bf16 kernel: on bf16 values it rewrites each whole
    block in f32 where only the new positions change; on integers a write touches only its positions. But reading a
    block of bits as values is a copy of the block on that backend, every step: f32 values, which its scatter
    handles, are stored as they are (as bits they would cost a third of the decode speed: bench/bench_sampling.py,
    batch 32)."""
    dtype = gptj.precision(cfg).compute
    return jnp.dtype(f"uint{8 * dtype.itemsize}") if policy.cache_bits and dtype.itemsize < 4 else dtype


def scatter(block: jax.Array, index: tuple, values: jax.Array) -> jax.Array:
    """block.at[index].set(values) on a block of the cache (`cache_dtype`), out-of-range rows dropped."""
    return block.at[index].set(lax.bitcast_convert_type(values, block.dtype), mode="drop")


def cached(block: jax.Array, dtype: Any) -> jax.Array:
    """A block of the cache read as values of the compute dtype (of bits: bitcast; of values: as it is)."""
    return lax.bitcast_convert_type(block, dtype)


class _PrefillKV(NamedTuple):
    """Prefill's cache hook (`gptj.KV`): no cached keys to read; each prompt's new keys and values written from
    position 0 of its slot (a target past the end, a padding row's, is dropped). A layer's state: (k, v) blocks."""
    target_R: jax.Array
    dtype: Any
    order: tuple  # the blocks' (`Policy.cache_order`)

    def read(self, state, h_RxTxD):
        return None

    def write(self, state, k_RxTxHxK, v_RxTxHxK, h_RxTxD):
        return tuple(self._written(blocks, new) for blocks, new in zip(state, (k_RxTxHxK, v_RxTxHxK)))

    def _written(self, blocks: list, new_RxTxHxK: jax.Array) -> list:
        width, new_RxTxHxK = new_RxTxHxK.shape[1], new_RxTxHxK.astype(self.dtype)
        written = []
        for start, block in zip(_starts(blocks, self.order), blocks):
            n = min(_length(block, self.order), width - start)
            if n > 0:  # a slice of positions keeps its place in the block: the values in the block's order
                block = scatter(block, _at(self.order, self.target_R, slice(None, n)),
                                new_RxTxHxK[:, start:start + n].transpose(self.order))
            written.append(block)
        return written


class _DecodeKV(NamedTuple):
    """A decode step's cache hook (`gptj.KV`): the first `rows` slots of the first blocks read in place (keys
    strictly before each slot's own position), and each slot's one new key and value written at its position."""
    position_R: jax.Array
    n_blocks: int
    dtype: Any
    policy: Policy

    def read(self, state, h_Rx1xD):
        if decode_kernel.runs(self.policy, self.position_R.shape[0]):
            return lambda q, k, v: self._kernel_attention(state, q, k, v)
        rows, blocks, order = self.position_R.shape[0], state[0][:self.n_blocks], self.policy.cache_order
        span = _starts(blocks, order)[-1] + _length(blocks[-1], order)
        # From a slot's own position on it holds stale keys, if any.
        past_mask_Rx1xS = (jnp.arange(span)[None, :] < self.position_R[:, None])[:, None, :]
        # The first `rows` slots of each block read: a copy unless that is every slot, but only of them.
        past = [[_as_sequence(cached(b[:rows], self.dtype), order) for b in kind[:self.n_blocks]] for kind in state]
        past_k, past_v = in_turn(h_Rx1xD, past, self.policy)
        return past_k, past_v, past_mask_Rx1xS

    def _kernel_attention(self, state, q_Rx1xHxK, k_Rx1xHxK, v_Rx1xHxK):
        """The step's attention by the TPU kernel (`decode_kernel.attend`): the first `rows` slots of the first
        blocks read in place, then the row's own new key and value (written into the cache after, by `write`)."""
        order = self.policy.cache_order  # the TPU's, slots first, is the kernel's: neither a bitcast nor a transpose
        past = [[_as_sequence(cached(b, self.dtype), order) for b in kind[:self.n_blocks]] for kind in state]
        ctx_RxHxK = decode_kernel.attend(q_Rx1xHxK[:, 0], *past, self.position_R, k_Rx1xHxK[:, 0], v_Rx1xHxK[:, 0])
        return ctx_RxHxK.astype(q_Rx1xHxK.dtype).reshape(ctx_RxHxK.shape[0], 1, -1)

    def write(self, state, k_Rx1xHxK, v_Rx1xHxK, h_Rx1xD):
        # Only the one new key and value per slot go back, so the cache is updated in place, after attention's reads.
        after_Rx1x1x1 = after_reads(h_Rx1xD, k_Rx1xHxK.dtype)
        return tuple(self._written(blocks, (new + after_Rx1x1x1)[:, 0].astype(self.dtype))
                     for blocks, new in zip(state, (k_Rx1xHxK, v_Rx1xHxK)))

    def _written(self, blocks: list, new_RxHxK: jax.Array) -> list:
        written, row_R, order = list(blocks), jnp.arange(new_RxHxK.shape[0]), self.policy.cache_order
        for j, start in enumerate(_starts(blocks, order)[:self.n_blocks]):  # a slot's position lies in one block read
            local_R, length = self.position_R - start, _length(blocks[j], order)
            local_R = jnp.where((local_R >= 0) & (local_R < length), local_R, length)
            written[j] = scatter(blocks[j], _at(order, row_R, local_R), new_RxHxK)
        return written


class _ExtendKV(NamedTuple):
    """Prefill's cache hook after a cached prefix (`gptj.KV`): row r's tokens sit at positions start_r on, after
    the first start_r positions of slot source_r, which its queries also see (its whole slot read, masked: one
    program per prompt shape, however long the prefix); the row's slot gets source_r's blocks copied in (when copy_r
    is set: a prefix held by another slot of the group) and the new keys and values written from start_r (a target
    past the end is dropped)."""
    target_R: jax.Array
    source_R: jax.Array
    copy_R: jax.Array
    start_R: jax.Array
    dtype: Any
    order: tuple  # the blocks' (`Policy.cache_order`)

    def read(self, state, h_RxTxD):
        span = sum(_length(block, self.order) for block in state[0])
        past_mask_Rx1xS = (jnp.arange(span)[None, :] < self.start_R[:, None])[:, None, :]
        past = [[_as_sequence(cached(jnp.take(b, self.source_R, 0, mode="clip"), self.dtype), self.order)
                 for b in kind] for kind in state]
        return past[0], past[1], past_mask_Rx1xS

    def write(self, state, k_RxTxHxK, v_RxTxHxK, h_RxTxD):
        # The prefix copied in and the new keys, both after attention's reads of the slot (unordered: a copy of every
        # block of the cache, 192 MiB of the bench config's 32 slots).
        after_Rx1x1x1 = after_reads(h_RxTxD, k_RxTxHxK.dtype)
        return tuple(self._written(blocks, new + after_Rx1x1x1, after_Rx1x1x1)
                     for blocks, new in zip(state, (k_RxTxHxK, v_RxTxHxK)))

    def _written(self, blocks: list, new_RxTxHxK: jax.Array, after_Rx1x1x1: jax.Array) -> list:
        written, new_RxTxHxK = list(blocks), new_RxTxHxK.astype(self.dtype)
        copy_to_R = jnp.where(self.copy_R, self.target_R, blocks[0].shape[0])
        position_RxT = self.start_R[:, None] + jnp.arange(new_RxTxHxK.shape[1])[None]
        for j, start in enumerate(_starts(blocks, self.order)):
            source = jnp.take(written[j], self.source_R, 0, mode="clip")
            source = lax.bitcast_convert_type(cached(source, after_Rx1x1x1.dtype) + after_Rx1x1x1, source.dtype)
            block = written[j].at[copy_to_R].set(source, mode="drop")
            local_RxT, length = position_RxT - start, _length(block, self.order)
            local_RxT = jnp.where((local_RxT >= 0) & (local_RxT < length), local_RxT, length)
            written[j] = scatter(block, _at(self.order, self.target_R[:, None], local_RxT), new_RxTxHxK)
        return written


def run_cached(params: dict, cache: KVCache, ids_RxT: jax.Array, positions_RxT: jax.Array, kv, cfg: Config,
                tp_axis: str | None, policy: Policy, **kw) -> tuple[jax.Array, KVCache]:
    """`gptj.run` over the cache's layers with the KV hook `kv`; the logits of its one column per row, over the whole
    vocab [R, V], and the cache written. The cache is a NamedTuple of per-layer lists (`KVCache`, or the paged
    cache's); each layer's state is its fields' entries for that layer."""
    def head(params, h_Rx1xD):
        lm_head = weights_in_turn(h_Rx1xD, params["lm_head"], policy)
        return layers.gather_shards(layers.head(h_Rx1xD, params["ln_f"], lm_head, policy)[:, 0], tp_axis)

    logits_RxV, states = gptj.run(params, ids_RxT, positions_RxT, cfg, policy=policy, tp_axis=tp_axis, kv=kv,
                                  kv_states=list(zip(*cache)), head=head, **kw)
    return logits_RxV, type(cache)(*map(list, zip(*states)))


def prefill_logits(params: dict, cache: KVCache, ids_RxT: jax.Array, length_R: jax.Array, slot_R: jax.Array,
                   cfg: Config, tp_axis: str | None = None, *, policy: Policy,
                   adapters: lora_slots.Rows | None = None) -> tuple[jax.Array, KVCache]:
    """Run R prompts (right-padded to T) together, write each one's keys and values from position 0 of its slot
    (a slot of -1 is a padding row, written nowhere), and return the logits after each prompt's last token [R, V]."""
    target_R = jnp.where(slot_R >= 0, slot_R, cache.k[0][0].shape[0])  # past the end: the scatter drops it
    kv = _PrefillKV(target_R, gptj.precision(cfg).compute, policy.cache_order)
    return run_cached(params, cache, ids_RxT, gptj.positions(ids_RxT), kv, cfg, tp_axis, policy,
                       columns_BxC=(length_R - 1)[:, None], adapters=adapters)


def extend_logits(params: dict, cache: KVCache, ids_RxT: jax.Array, start_R: jax.Array, length_R: jax.Array,
                  slot_R: jax.Array, source_R: jax.Array, cfg: Config, tp_axis: str | None = None, *,
                  policy: Policy, adapters: lora_slots.Rows | None = None) -> tuple[jax.Array, KVCache]:
    """`prefill_logits` of prompt tails (right-padded to T) that follow a cached prefix: row r's `length_r` tokens go
    to positions start_r on of its slot, after the prefix held by slot source_r (its own, or another of the group,
    copied in); return the logits after each tail's last token [R, V]."""
    n_slots = cache.k[0][0].shape[0]
    target_R = jnp.where(slot_R >= 0, slot_R, n_slots)
    kv = _ExtendKV(target_R, source_R, (slot_R >= 0) & (source_R != slot_R), start_R, gptj.precision(cfg).compute,
                   policy.cache_order)
    positions_RxT = start_R[:, None] + gptj.positions(ids_RxT)
    return run_cached(params, cache, ids_RxT, positions_RxT, kv, cfg, tp_axis, policy,
                       columns_BxC=(length_R - 1)[:, None], adapters=adapters)


def decode_logits(params: dict, cache: KVCache, token_R: jax.Array, position_R: jax.Array, cfg: Config,
                  n_blocks: int, tp_axis: str | None = None, *, policy: Policy,
                  adapters: lora_slots.Rows | None = None) -> tuple[jax.Array, KVCache]:
    """Feed one token to each of the first R slots: write its key at the slot's own position, attend to the cache
    positions in the first `n_blocks` blocks (keys after a slot's own position are masked), return logits [R, V]."""
    kv = _DecodeKV(position_R, n_blocks, gptj.precision(cfg).compute, policy)
    return run_cached(params, cache, token_R[:, None], position_R[:, None], kv, cfg, tp_axis, policy,
                       mask_BxTxS=jnp.ones((token_R.shape[0], 1, 1), bool), adapters=adapters)


def served(sampling: Sampling, rows: int | None = None) -> lora_slots.Rows | None:
    """The first `rows` rows' served adapter slots (all rows' where None), or None where no slots are served."""
    return None if sampling.adapter is None else lora_slots.Rows(sampling.adapter[:rows])


class Slots(NamedTuple):
    """What the decode steps carry per cache slot [N] from one to the next: its last token (the next step's input),
    how often its completion has drawn each token [N, V] and its logit bias [N, V] (`choose.adjusted`)."""
    last: Any  # i32
    counts: Any  # i32
    bias: Any  # f32


def new_slots(n_slots: int, vocab: int) -> Slots:
    """Slots (numpy) with no last token, counts or bias."""
    return Slots(np.zeros(n_slots, np.int32), np.zeros((n_slots, vocab), np.int32),
                 np.zeros((n_slots, vocab), np.float32))


def prefill_local(params, cache, slots_N: Slots, ids_RxT, length_R, slot_R, sampling_R, *, cfg, policy, top: int = 0,
                  tp_axis=None):
    """`prefill_logits`, then each row's first token: returns tokens [R] and their `Logprobs` (with the `top` most
    likely), the `Slots` with these rows' written into theirs (the next decode step's input; counts and bias
    restarted), and the cache. Per dp group: its own rows, its own slots."""
    logits_RxV, cache = prefill_logits(params, cache, ids_RxT, length_R, slot_R, cfg, tp_axis, policy=policy,
                                       adapters=served(sampling_R))
    return first_tokens(logits_RxV, cache, slots_N, slot_R, sampling_R, top)


def first_tokens(logits_RxV, cache, slots_N: Slots, slot_R, sampling_R, top, index_R=None):
    """Each prefilled row's first token (its completion's token index_R[r], 0 where None: a key's fold), chosen with
    its bias, and written into its slot with the bias and the token's count."""
    rows, vocab = logits_RxV.shape
    bias_RxV = dense_bias(sampling_R.bias, rows, vocab)
    counts_RxV = jnp.zeros((rows, vocab), jnp.int32)
    index_R = jnp.zeros_like(slot_R) if index_R is None else index_R
    token_R, logprob_R = choose(logits_RxV, sampling_R, index_R, top, (counts_RxV, bias_RxV))
    target_R = jnp.where(slot_R >= 0, slot_R, slots_N.last.shape[0])
    counts_RxV = counts_RxV.at[jnp.arange(rows), token_R].set(1)
    slots_N = Slots(*(x.at[target_R].set(new, mode="drop")
                      for x, new in zip(slots_N, (token_R, counts_RxV, bias_RxV))))
    return token_R, logprob_R, slots_N, cache


def extend_local(params, cache, slots_N: Slots, ids_RxT, start_R, length_R, slot_R, source_R, sampling_R, *, cfg,
                 policy, top: int = 0, tp_axis=None):
    """`prefill_local` of prompt tails after cached prefixes (`extend_logits`)."""
    logits_RxV, cache = extend_logits(params, cache, ids_RxT, start_R, length_R, slot_R, source_R, cfg, tp_axis,
                                      policy=policy, adapters=served(sampling_R))
    return first_tokens(logits_RxV, cache, slots_N, slot_R, sampling_R, top)


def decode_local(params, cache, slots_N: Slots, steps_N: Steps, *, cfg, policy, rows: int, n_blocks: int,
                 top: int = 0, tp_axis=None):
    """One token for each of the first `rows` slots, from its last token. Returns tokens [R] and their `Logprobs`
    (with the `top` most likely), the `Slots` with these written into the first R, the steps advanced by one token,
    and the cache. The rows' tokens are chosen with their penalties and bias, and counted (every row's: a row
    without penalties has them 0, which leave its logits as they are, and a prefill restarts its counts)."""
    logits_RxV, cache = decode_logits(params, cache, slots_N.last[:rows], steps_N.position[:rows], cfg, n_blocks,
                                      tp_axis, policy=policy, adapters=served(steps_N.sampling, rows))
    return next_tokens(logits_RxV, cache, slots_N, steps_N, rows, top)


def next_tokens(logits_RxV, cache, slots_N: Slots, steps_N: Steps, rows: int, top: int):
    """A decode step's tokens from its logits: chosen by each row's sampling with its penalties and bias, counted
    and written into the first `rows` slots, the steps advanced; `decode_local`'s results. (One program for every
    request: the [rows, vocab] counts and bias cost a step well under 1% of its weights' reading, where a program
    without them for each shape doubled the decode programs to compile and to hold on the device.)"""
    sampling_R = jax.tree.map(lambda x: x[:rows], steps_N.sampling)
    penalties = (slots_N.counts[:rows], slots_N.bias[:rows])
    token_R, logprob_R = choose(logits_RxV, sampling_R, steps_N.index[:rows], top, penalties)
    slots_N = slots_N._replace(last=lax.dynamic_update_slice_in_dim(slots_N.last, token_R, 0, 0),
                               counts=slots_N.counts.at[jnp.arange(rows), token_R].add(1))
    advanced = steps_N._replace(position=steps_N.position + 1, index=steps_N.index + 1)
    return token_R, logprob_R, slots_N, advanced, cache


def generate_local(params, cache, slots_N: Slots, steps_N: Steps, live_N, stop_S, n_steps, *, cfg, policy, rows: int,
                   n_blocks: int, out_len: int, tp_axis=None, dp_axis=None):
    """Up to `n_steps` (at most out_len) decode steps of the first `rows` slots in one program, ending early once
    every live row of every dp group has drawn one of `stop_S` (padded with -1) since its last token: tokens and
    log-probs [R, out_len] (a step not run holds zeros) and the cache. The offline sampler's loop: one dispatch for
    a whole completion, where a host loop pays the dispatch of every token (5% of a small model's batch-1 step)."""
    def busy(done_R):
        any_R = jnp.any(~done_R).astype(jnp.int32)
        return (lax.psum(any_R, dp_axis) if dp_axis else any_R) > 0

    def body(state):
        i, slots_N, steps_N, cache, tokens_RxS, logprobs_RxS, done_R, _ = state
        token_R, logprob_R, slots_N, steps_N, cache = decode_local(params, cache, slots_N, steps_N, cfg=cfg,
                                                                   policy=policy, rows=rows, n_blocks=n_blocks,
                                                                   tp_axis=tp_axis)
        tokens_RxS = lax.dynamic_update_index_in_dim(tokens_RxS, token_R, i, 1)
        logprobs_RxS = lax.dynamic_update_index_in_dim(logprobs_RxS, logprob_R.chosen, i, 1)
        done_R = done_R | jnp.isin(token_R, stop_S)
        return i + 1, slots_N, steps_N, cache, tokens_RxS, logprobs_RxS, done_R, busy(done_R)

    def rows_of(dtype):  # typed as varying over dp, like the rows the loop writes into it
        zeros = jnp.zeros((rows, out_len), dtype)
        return lax.pcast(zeros, (dp_axis,), to="varying") if dp_axis else zeros

    done_R = ~live_N[:rows] | jnp.isin(slots_N.last[:rows], stop_S)
    state = (jnp.int32(0), slots_N, steps_N, cache, rows_of(jnp.int32), rows_of(jnp.float32), done_R, busy(done_R))
    state = lax.while_loop(lambda s: (s[0] < n_steps) & s[-1], body, state)
    return state[4], state[5], state[3]
