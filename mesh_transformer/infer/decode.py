"""Device programs for serving: prefill new requests into slots of a shared KV cache, and advance every busy slot by
one token, each slot at its own position.

The cache holds N slots of S = cfg.seq positions, per layer for keys and for values a list of blocks [N, H, K, S_j]
of consecutive positions (`block_sizes`), heads split over 'mp' and slots over 'dp'. A decode step reads only the
first blocks, as many as the furthest busy slot needs: a span of the cache read in place, where slicing it out of
one array per layer costs a strided copy per layer per step (and a stacked cache a copy of every layer). Within a
block positions come last, the layout XLA's CPU dot wants for one-token attention; handing a block to the layers
as [B, S_j, H, K] is then free. Both programs run under `jax.shard_map` with the same layer functions as training
and sampling, with the layers unrolled over unstacked params (`sampling.place_params`).

A prompt is written from position 0 of its slot (no padding on the left), its rotary positions are its own, and its
queries see only keys at or before their own position. Token i of a request is drawn with key
fold_in(PRNGKey(seed), i), as in sampling.py, so a completion does not depend on what else is batched. Shapes: N
slots (R of them computed in a step), S cache length, T prompt bucket, L layers, H heads (on this device), K head
dim, V vocab.
"""
from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from mesh_transformer.model import layers
from mesh_transformer.config import Config
from mesh_transformer.parallel.mesh import DP, MP
from mesh_transformer.infer.sampler import chosen_logprobs, gather_vocab, param_specs, sample

CACHE_SPEC = P(DP, MP, None, None)  # each block [N, H, K, S_j]: slots over dp, heads over mp


def block_sizes(seq: int, block: int) -> list[int]:
    """The lengths of the cache blocks: `block` positions each, the last one shorter if `seq` is not a multiple."""
    return [min(block, seq - start) for start in range(0, seq, block)]


def _starts(blocks: list) -> list[int]:
    """The first position of each block."""
    starts = [0]
    for b in blocks[:-1]:
        starts.append(starts[-1] + b.shape[-1])
    return starts


def choose(logits_BxV: jax.Array, temperature_B: jax.Array, top_k_B: jax.Array, top_p_B: jax.Array,
           seed_B: jax.Array, index_B: jax.Array, logprobs_B: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Token i of each row drawn with key fold_in(PRNGKey(seed), i), and its untempered log-probability (computed
    when any row asks for it, else zeros)."""
    key_Bx2 = jax.vmap(lambda seed, i: jax.random.fold_in(jax.random.PRNGKey(seed), i))(seed_B, index_B)
    token_B = sample(logits_BxV, temperature_B, top_k_B, top_p_B, key_Bx2)
    return token_B, chosen_logprobs(logits_BxV, token_B, jnp.any(logprobs_B))


def prefill_local(params: dict, k_cache: list, v_cache: list, token_N: jax.Array, ids_RxT: jax.Array,
                  length_R: jax.Array, slot_R: jax.Array, temperature_R: jax.Array, top_k_R: jax.Array,
                  top_p_R: jax.Array, seed_R: jax.Array, logprobs_R: jax.Array, *, cfg: Config,
                  tp_axis: str | None = None, dp_axis: str | None = None):
    """Run R prompts (right-padded to T) together and write each one's keys and values from position 0 of its slot.

    Every dp group computes every prompt; each writes only the rows whose slots it holds (a slot of -1 is a padding
    row, written nowhere). Returns the first tokens and their log-probs [R], the slots' last tokens [N] with these
    written into theirs (the next decode step's input), and the updated caches.
    """
    width = ids_RxT.shape[1]
    n_local = k_cache[0][0].shape[0]
    h_RxTxD = layers.embed(ids_RxT, params["embed"]["wte"], tp_axis)
    sincos = layers.rotary_sincos(jnp.arange(width)[None], cfg.pe_rotary_dims)
    mask_1xTxT = layers.causal_mask(width)
    kv = []
    for layer_params in params["layers"]:
        h_RxTxD, kv_layer = layers.block(h_RxTxD, layer_params, cfg.head_dim, sincos, mask_1xTxT, tp_axis)
        kv.append(kv_layer)
    last_Rx1xD = jnp.take_along_axis(h_RxTxD, (length_R - 1)[:, None, None], axis=1)
    logits_RxV = gather_vocab(layers.head(last_Rx1xD, params["ln_f"], params["lm_head"])[:, 0], tp_axis)
    token_R, logprob_R = choose(logits_RxV, temperature_R, top_k_R, top_p_R, seed_R, jnp.zeros_like(length_R),
                                logprobs_R)
    local_R = slot_R - (lax.axis_index(dp_axis) * n_local if dp_axis else 0)
    # Rows this group does not hold point past the end of its slots, and the scatter drops them.
    target_R = jnp.where((slot_R >= 0) & (local_R >= 0) & (local_R < n_local), local_R, n_local)

    def write(blocks, new_RxTxHxK):
        new_RxHxKxT = new_RxTxHxK.transpose(0, 2, 3, 1).astype(blocks[0].dtype)
        written = []
        for start, block_NxHxKxS in zip(_starts(blocks), blocks):
            n = min(block_NxHxKxS.shape[-1], width - start)
            if n > 0:
                block_NxHxKxS = block_NxHxKxS.at[target_R, :, :, :n].set(new_RxHxKxT[..., start:start + n],
                                                                         mode="drop")
            written.append(block_NxHxKxS)
        return written

    k_cache = [write(blocks, k) for blocks, (k, _) in zip(k_cache, kv)]
    v_cache = [write(blocks, v) for blocks, (_, v) in zip(v_cache, kv)]
    token_N = token_N.at[target_R].set(token_R, mode="drop")
    return token_R, logprob_R, token_N, k_cache, v_cache


def decode_local(params: dict, k_cache: list, v_cache: list, token_N: jax.Array, position_N: jax.Array,
                 temperature_N: jax.Array, top_k_N: jax.Array, top_p_N: jax.Array, seed_N: jax.Array,
                 index_N: jax.Array, logprobs_N: jax.Array, *, cfg: Config, rows: int, n_blocks: int,
                 tp_axis: str | None = None):
    """One token for each of the first `rows` slots: write the last token's key at the slot's own position, attend
    to the cache positions in the first `n_blocks` blocks (keys after a slot's own position are masked), sample the
    next token.

    Returns tokens and log-probs [R], the slots' last tokens [N] with these written into the first R, and the
    updated caches.
    """
    token_R, position_R = token_N[:rows], position_N[:rows]
    h_Rx1xD = layers.embed(token_R[:, None], params["embed"]["wte"], tp_axis)
    sincos = layers.rotary_sincos(position_R[:, None], cfg.pe_rotary_dims)
    starts = _starts(k_cache[0])[:n_blocks]
    span = starts[-1] + k_cache[0][n_blocks - 1].shape[-1]
    # Cached keys strictly before each slot's own position: from there on the slot holds stale keys, if any.
    past_mask_Rx1xS = (jnp.arange(span)[None, :] < position_R[:, None])[:, None, :]
    new_mask_Rx1x1 = jnp.ones((rows, 1, 1), bool)
    row_R = jnp.arange(rows)

    def write(blocks, new_RxHxK):
        written = list(blocks)
        for j, start in enumerate(starts):  # each slot's position lies in one of the blocks read; elsewhere dropped
            local_R = position_R - start
            local_R = jnp.where((local_R >= 0) & (local_R < blocks[j].shape[-1]), local_R, blocks[j].shape[-1])
            written[j] = blocks[j].at[row_R, :, :, local_R].set(new_RxHxK, mode="drop")
        return written

    k_cache, v_cache = list(k_cache), list(v_cache)
    for layer, layer_params in enumerate(params["layers"]):
        # The first `rows` slots of each block read: a copy unless that is every slot, but only of them.
        past = ([b[:rows].transpose(0, 3, 1, 2) for b in k_cache[layer][:n_blocks]],
                [b[:rows].transpose(0, 3, 1, 2) for b in v_cache[layer][:n_blocks]], past_mask_Rx1xS)
        h_Rx1xD, (k_Rx1xHxK, v_Rx1xHxK) = layers.block(h_Rx1xD, layer_params, cfg.head_dim, sincos, new_mask_Rx1x1,
                                                       tp_axis, past)
        # Only the one new key and value per slot go back, so the cache is updated in place. The write must come
        # after attention's reads of the cache, else XLA copies the whole cache to keep them apart: adding 0 * h
        # (which attention produced) makes it depend on them.
        after_R11 = 0 * h_Rx1xD[:, :, :1, None].astype(k_cache[layer][0].dtype)
        k_cache[layer] = write(k_cache[layer], (k_Rx1xHxK + after_R11)[:, 0])
        v_cache[layer] = write(v_cache[layer], (v_Rx1xHxK + after_R11)[:, 0])
    logits_RxV = gather_vocab(layers.head(h_Rx1xD, params["ln_f"], params["lm_head"])[:, 0], tp_axis)
    token_R, logprob_R = choose(logits_RxV, temperature_N[:rows], top_k_N[:rows], top_p_N[:rows], seed_N[:rows],
                                index_N[:rows], logprobs_N[:rows])
    return token_R, logprob_R, lax.dynamic_update_slice_in_dim(token_N, token_R, 0, 0), k_cache, v_cache


class Programs:
    """Jitted prefill and decode for one model shape on one mesh; engines sharing them share compiles."""

    def __init__(self, cfg: Config, mesh: Mesh):
        self.cfg, self.mesh = cfg, mesh
        specs, replicated = param_specs(cfg), P()
        fn = partial(prefill_local, cfg=cfg, tp_axis=MP, dp_axis=DP)
        self.prefill = jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=(specs, CACHE_SPEC, CACHE_SPEC, P(DP),
                                                                      *[replicated] * 8),
                                             out_specs=(replicated, replicated, P(DP), CACHE_SPEC, CACHE_SPEC),
                                             check_vma=True), donate_argnums=(1, 2, 3))
        self.decode = jax.jit(self._decode, static_argnames=("rows", "n_blocks"), donate_argnums=(1, 2, 3))

    def _decode(self, params, k_cache, v_cache, *slots, rows: int, n_blocks: int):
        fn = partial(decode_local, cfg=self.cfg, rows=rows, n_blocks=n_blocks, tp_axis=MP)
        row = P(DP)
        return jax.shard_map(fn, mesh=self.mesh, in_specs=(param_specs(self.cfg), CACHE_SPEC, CACHE_SPEC,
                                                           *[row] * len(slots)),
                             out_specs=(row, row, row, CACHE_SPEC, CACHE_SPEC),
                             check_vma=True)(params, k_cache, v_cache, *slots)


_PROGRAMS: dict[tuple, Programs] = {}


def programs(cfg: Config, mesh: Mesh) -> Programs:
    """The programs for this model shape and mesh, made once and shared (so are their compiles)."""
    # Keyed by what the traced code reads from the config; array shapes and dtypes are jit's own cache keys.
    key = (mesh, cfg.layers, cfg.head_dim, cfg.pe_rotary_dims)
    if key not in _PROGRAMS:
        _PROGRAMS[key] = Programs(cfg, mesh)
    return _PROGRAMS[key]
