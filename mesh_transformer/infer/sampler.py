"""Text generation: prefill, then KV-cache decode in one compiled loop, with per-row samplers and stop handling.

Prompts are left-padded so that every row ends at the same buffer position; rotary positions count a row's real
tokens only and the attention mask hides pad keys, so a row's tokens do not depend on its neighbours. The KV cache
(L arrays [B, H, K, S] each for keys and values) is split like the heads (H over 'mp') and the batch over 'dp';
the same layer functions as training run under `jax.shard_map`. Batch, prompt length and generation length are
bucketed to powers of two, so a new length inside a bucket reuses the compiled program. Shapes: B batch, T prompt
(bucket), N new tokens (bucket), S = T + N cache length, V vocab, L layers, H heads (on this device), K head dim.
"""
from __future__ import annotations

import dataclasses
import numbers
from collections.abc import Sequence
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from mesh_transformer.store import convert
from mesh_transformer.model import gptj, layers
from mesh_transformer.parallel.layout import MEGATRON_RULES, SHARD_MAP, make_layout, unstacked
from mesh_transformer.parallel.layout import param_specs as layout_param_specs
from mesh_transformer.config import Config
from mesh_transformer.parallel.mesh import DP, MP
from mesh_transformer.tokenizer import EOS_ID

MIN_BUCKET = 16
_DONE = -1  # written in place of tokens after a row has finished
_NO_STOP_ID = -2  # pads the stop-id list; never a token


@dataclasses.dataclass(frozen=True)
class Result:
    """One row's completion: tokens (without the stop token), their log-probabilities, and why it ended."""
    tokens: list[int]
    logprobs: list[float] | None
    finish_reason: str  # "stop" (a stop token or stop string) or "length" (max_new_tokens reached)


@dataclasses.dataclass(frozen=True)
class TextResult:
    """One row's completion as text, cut before the first stop string."""
    text: str
    tokens: list[int]
    logprobs: list[float] | None
    finish_reason: str


def bucket(n: int, minimum: int = MIN_BUCKET, maximum: int | None = None) -> int:
    """The power of two (at least `minimum`, at most `maximum`) that a length is padded to, so compiles are reused."""
    size = max(minimum, 1 << max(0, n - 1).bit_length())
    return size if maximum is None else min(size, max(maximum, n))


# ---------------------------------------------------------------------------------------------------- samplers
def filter_logits(logits_BxV: jax.Array, top_k_B: jax.Array, top_p_B: jax.Array) -> jax.Array:
    """Top-k, then top-p (nucleus) filtering: logits outside the kept set become -inf.

    top_k 0 keeps every token. top-p keeps the smallest set of most likely tokens whose probability mass reaches
    top_p (after top-k); tokens tied with the least likely kept one are kept too; top_p 1 keeps all.
    """
    vocab = logits_BxV.shape[-1]
    sorted_BxV = -jnp.sort(-logits_BxV, axis=-1)
    k_B = jnp.where(top_k_B > 0, jnp.minimum(top_k_B, vocab), vocab)
    rank_1xV = jnp.arange(vocab)[None]
    sorted_BxV = jnp.where(rank_1xV < k_B[:, None], sorted_BxV, -jnp.inf)
    probs_BxV = jax.nn.softmax(sorted_BxV, axis=-1)
    mass_before_BxV = jnp.cumsum(probs_BxV, axis=-1) - probs_BxV
    # The first token is always kept (mass before it is 0); p = 1 keeps all even when the cumsum rounds to 1.
    keep_BxV = (mass_before_BxV < top_p_B[:, None]) | (top_p_B[:, None] >= 1.0)
    n_keep_B = jnp.minimum(keep_BxV.sum(-1), k_B)
    threshold_B = jnp.take_along_axis(sorted_BxV, (n_keep_B - 1)[:, None], axis=-1)
    return jnp.where(logits_BxV >= threshold_B, logits_BxV, -jnp.inf)


def sample(logits_BxV: jax.Array, temperature_B: jax.Array, top_k_B: jax.Array, top_p_B: jax.Array,
           key_Bx2: jax.Array) -> jax.Array:
    """Next tokens [B]: argmax where temperature is 0, else a draw from the tempered, filtered distribution."""
    greedy_B = jnp.argmax(logits_BxV, axis=-1).astype(jnp.int32)

    def draw(_):
        scaled_BxV = logits_BxV / jnp.where(temperature_B > 0, temperature_B, 1.0)[:, None]
        filtered_BxV = filter_logits(scaled_BxV, top_k_B, top_p_B)
        drawn_B = jax.vmap(jax.random.categorical)(key_Bx2, filtered_BxV).astype(jnp.int32)
        return jnp.where(temperature_B > 0, drawn_B, greedy_B)

    # Skip the vocab sort when every row is greedy.
    return lax.cond(jnp.any(temperature_B > 0), draw, lambda _: greedy_B, None)


def chosen_logprobs(logits_BxV: jax.Array, token_B: jax.Array, wanted: jax.Array) -> jax.Array:
    """Each chosen token's log-probability under the untempered, unfiltered distribution, or zeros when `wanted` (a
    traced bool) is false: the log-softmax is a pass over [B, V], skipped at run time when nobody asked for it."""
    return lax.cond(wanted, lambda: jnp.take_along_axis(jax.nn.log_softmax(logits_BxV), token_B[:, None], -1)[:, 0],
                    lambda: jnp.zeros_like(logits_BxV[:, 0]))


# ----------------------------------------------------------------------------------------------- cached forward
def forward_cached(params: dict, ids_BxT: jax.Array, positions_BxT: jax.Array, key_ok_BxS: jax.Array,
                   index: jax.Array | int, cache: tuple[list, list], cfg: Config,
                   tp_axis: str | None = None) -> tuple[jax.Array, tuple[list, list]]:
    """Logits [B, V] after the last of T new tokens written at buffer `index`, and the updated (k, v) caches.

    `params` has its layers unstacked (`gptj.unstack_layers`) and the loop over them is unrolled: a scan over
    the stacked layers would copy every layer's weights out of the stack at every token, doubling what a decode
    step reads. The caches are lists of L arrays [B, H, K, S] (one per layer, as a slice of a stacked cache would
    be copied before every read), positions last, the layout XLA's CPU dot wants for one-token attention; handing
    a layer's cache to the block as [B, S, H, K] is then free. Query t (at buffer index + t)
    sees the non-padding keys at or before it; with `index` the int 0 (a prefill) the cache is not read at all.
    """
    length, cache_len = ids_BxT.shape[1], key_ok_BxS.shape[1]
    h_BxTxD = layers.embed(ids_BxT, params["embed"]["wte"], tp_axis)
    sincos = layers.rotary_sincos(positions_BxT, cfg.pe_rotary_dims)
    new_ok_BxT = lax.dynamic_slice_in_dim(key_ok_BxS, index, length, 1)
    mask_BxTxT = new_ok_BxT[:, None, :] & layers.causal_mask(length)
    read_cache = not (isinstance(index, int) and index == 0)
    past_mask_Bx1xS = (key_ok_BxS & (jnp.arange(cache_len) < index))[:, None, :]
    k_cache, v_cache = list(cache[0]), list(cache[1])
    for layer, layer_params in enumerate(params["layers"]):
        past = ([k_cache[layer].transpose(0, 3, 1, 2)], [v_cache[layer].transpose(0, 3, 1, 2)], past_mask_Bx1xS)
        h_BxTxD, (k_BxTxHxK, v_BxTxHxK) = layers.block(h_BxTxD, layer_params, cfg.head_dim, sincos, mask_BxTxT,
                                                       tp_axis, past if read_cache else None)
        # Only the T new keys and values are written, so the cache is updated in place. The write must come after
        # attention's reads of the cache, else XLA copies the cache to keep them apart: adding 0 * h (which
        # attention produced) makes it depend on them.
        after = 0 * h_BxTxD[:, :1, :1, None].astype(k_cache[layer].dtype)
        k_cache[layer] = lax.dynamic_update_slice_in_dim(k_cache[layer], (k_BxTxHxK + after).transpose(0, 2, 3, 1),
                                                         index, 3)
        v_cache[layer] = lax.dynamic_update_slice_in_dim(v_cache[layer], (v_BxTxHxK + after).transpose(0, 2, 3, 1),
                                                         index, 3)
    logits_BxV = layers.head(h_BxTxD[:, -1:], params["ln_f"], params["lm_head"])[:, 0]
    return gather_vocab(logits_BxV, tp_axis), (k_cache, v_cache)


def gather_vocab(logits_BxV: jax.Array, tp_axis: str | None) -> jax.Array:
    """This device's vocab columns placed into the full vocab, summed over tp_axis: the same [B, V] everywhere.

    A psum rather than an all_gather, because its result is typed as identical on every device (check_vma), so
    the sampled tokens can leave shard_map unsplit over tp_axis.
    """
    if tp_axis is None:
        return logits_BxV
    vocab_local = logits_BxV.shape[-1]
    full_BxV = jnp.zeros((logits_BxV.shape[0], vocab_local * lax.axis_size(tp_axis)), logits_BxV.dtype)
    full_BxV = lax.dynamic_update_slice_in_dim(full_BxV, logits_BxV, lax.axis_index(tp_axis) * vocab_local, 1)
    return lax.psum(full_BxV, tp_axis)


def _vary(x: jax.Array, axes: tuple[str, ...]) -> jax.Array:
    """Marks a freshly made array as differing per device on `axes`, as the loop carry it starts will."""
    return lax.pcast(x, axes, to="varying") if axes else x


def generate_local(params: dict, ids_BxT: jax.Array, valid_BxT: jax.Array, temperature_B: jax.Array,
                   top_k_B: jax.Array, top_p_B: jax.Array, seed_B: jax.Array, done_B: jax.Array,
                   stop_ids: jax.Array, max_new: jax.Array, logprobs: jax.Array, *, cfg: Config, n_new: int,
                   tp_axis: str | None = None, dp_axis: str | None = None) -> tuple[jax.Array, jax.Array]:
    """Prefill and decode up to `max_new` (<= n_new) tokens per row; returns tokens and log-probs [B, N].

    Runs per device (or globally without axis names). A row is done after a stop id; later slots hold -1. The loop
    ends when every row of the global batch is done. Log-probs are of the untempered, unfiltered distribution
    (zeros unless `logprobs`, a bool).
    """
    batch, prompt_len = ids_BxT.shape
    cache_len = prompt_len + n_new
    heads = cfg.n_heads // lax.axis_size(tp_axis) if tp_axis else cfg.n_heads
    axes = tuple(a for a in (dp_axis, tp_axis) if a)
    row_axes = (dp_axis,) if dp_axis else ()
    dtype = params["layers"][0]["fused"]["in"].dtype
    cache = tuple([_vary(jnp.zeros((batch, heads, cfg.head_dim, cache_len), dtype), axes)
                   for _ in range(cfg.layers)] for _ in range(2))
    key_ok_BxS = jnp.concatenate([valid_BxT, jnp.ones((batch, n_new), bool)], axis=1)
    real_len_B = valid_BxT.sum(-1)
    key_Bx2 = jax.vmap(jax.random.PRNGKey)(seed_B)

    def choose(logits_BxV, step, done_B):
        keys = jax.vmap(jax.random.fold_in, (0, None))(key_Bx2, step)
        token_B = sample(logits_BxV, temperature_B, top_k_B, top_p_B, keys)
        logprob_B = chosen_logprobs(logits_BxV, token_B, logprobs)
        token_B = jnp.where(done_B, _DONE, token_B)
        return token_B, logprob_B, done_B | jnp.isin(token_B, stop_ids)

    def any_active(done_B):
        active = jnp.any(~done_B).astype(jnp.int32)
        return (lax.psum(active, dp_axis) if dp_axis else active) > 0

    positions_BxT = jnp.maximum(jnp.cumsum(valid_BxT, axis=1) - 1, 0)
    logits_BxV, cache = forward_cached(params, ids_BxT, positions_BxT, key_ok_BxS, 0, cache, cfg, tp_axis)
    token_B, logprob_B, done_B = choose(logits_BxV, 0, done_B)
    tokens_BxN = _vary(jnp.full((batch, n_new), _DONE, jnp.int32), row_axes).at[:, 0].set(token_B)
    logprobs_BxN = _vary(jnp.zeros((batch, n_new), jnp.float32), row_axes).at[:, 0].set(logprob_B)

    def body(state):
        i, token_B, done_B, cache, tokens_BxN, logprobs_BxN, _ = state
        ids_Bx1 = jnp.maximum(token_B, 0)[:, None]
        logits_BxV, cache = forward_cached(params, ids_Bx1, (real_len_B + i - 1)[:, None], key_ok_BxS,
                                           prompt_len + i - 1, cache, cfg, tp_axis)
        token_B, logprob_B, done_B = choose(logits_BxV, i, done_B)
        tokens_BxN = lax.dynamic_update_index_in_dim(tokens_BxN, token_B, i, 1)
        logprobs_BxN = lax.dynamic_update_index_in_dim(logprobs_BxN, logprob_B, i, 1)
        return i + 1, token_B, done_B, cache, tokens_BxN, logprobs_BxN, any_active(done_B)

    state = (jnp.int32(1), token_B, done_B, cache, tokens_BxN, logprobs_BxN, any_active(done_B))
    state = lax.while_loop(lambda s: (s[0] < max_new) & s[-1], body, state)
    return state[4], state[5]


# ------------------------------------------------------------------------------------------------------ engine
def _per_row(name: str, value: Any, n: int, kind: type) -> list:
    values = list(value) if isinstance(value, (list, tuple, np.ndarray)) else [value] * n
    if len(values) != n:
        raise ValueError(f"{name} has {len(values)} values for {n} prompts; give one value or one per prompt")
    for v in values:
        if isinstance(v, bool) or not isinstance(v, numbers.Real if kind is float else numbers.Integral):
            raise ValueError(f"{name} must be {'a number' if kind is float else 'an integer'}, got {v!r}")
    return [kind(v) for v in values]


def check_sampling(temperature: Sequence[float], top_k: Sequence[int], top_p: Sequence[float]) -> None:
    """Raises a ValueError naming the first sampling value out of range."""
    if bad := [t for t in temperature if not t >= 0]:  # NaN fails too
        raise ValueError(f"temperature must be at least 0 (0 = greedy), got {bad[0]}")
    if any(k < 0 for k in top_k):
        raise ValueError(f"top_k must be at least 0 (0 = off), got {min(top_k)}")
    if any(not 0 < p <= 1 for p in top_p):
        raise ValueError(f"top_p must be in (0, 1], got {next(p for p in top_p if not 0 < p <= 1)}")


def cut_at_stop(text: str, stop: Sequence[str]) -> tuple[str, bool]:
    """The text before the earliest stop string, and whether one was found."""
    cut = min((i for s in stop if (i := text.find(s)) >= 0), default=-1)
    return (text, False) if cut < 0 else (text[:cut], True)


def _placed(x: Any, sharding: NamedSharding, dtype: Any) -> jax.Array:
    """One param leaf on its shards in `dtype`; no copy when it is already there (a 6B model has no room for two)."""
    if not isinstance(x, jax.Array):
        return jax.device_put(np.asarray(x, dtype), sharding)  # each device receives only its slice
    if not x.sharding.is_equivalent_to(sharding, x.ndim):
        x = jax.device_put(x, sharding)
    return x if x.dtype == dtype else x.astype(dtype)


def place_params(params: dict, cfg: Config, mesh: Mesh) -> dict:
    """The params for the inference programs: on their shards, in the compute dtype, layers unstacked into a list,
    each layer's projections joined (`layers.fuse_layer`).

    A stacked leaf is placed and split before the next one is touched, and a layer is joined before the next, so
    the device holds little besides the result.
    """
    dtype = gptj.DTYPES[cfg.compute_dtype]
    shardings = make_layout(dataclasses.replace(cfg, parallelism=SHARD_MAP), mesh=mesh).param_shardings()
    placed = jax.tree.map(partial(_placed, dtype=dtype), {k: v for k, v in params.items() if k != "layers"},
                          {k: v for k, v in shardings.items() if k != "layers"})
    layer_shardings = iter(jax.tree.leaves(shardings["layers"]))

    def split(x):
        sharding = next(layer_shardings)
        one = NamedSharding(mesh, P(*sharding.spec[1:]))
        return jax.jit(lambda s: [s[i] for i in range(cfg.layers)], out_shardings=[one] * cfg.layers)(
            _placed(x, sharding, dtype))

    unstacked = gptj.unstack_layers({**placed, "layers": params["layers"]}, split)
    fuse = jax.jit(partial(layers.fuse_layer, tp_size=mesh.shape[MP]),
                   out_shardings=jax.tree.map(partial(NamedSharding, mesh), param_specs(cfg)["layers"][0],
                                              is_leaf=lambda x: isinstance(x, P)))
    layer_list = unstacked.pop("layers")
    return {**unstacked, "layers": [fuse(layer_list.pop(0)) for _ in range(cfg.layers)]}


def param_specs(cfg: Config) -> dict:
    """shard_map in_specs of `place_params`' tree."""
    specs = unstacked(layout_param_specs(MEGATRON_RULES), cfg.layers)
    fused = {"ln_1": specs["layers"][0]["ln_1"],
             "fused": {"in": P(MP, None, None), "in_bias": P(MP, None), "out": P(MP, None, None), "out_bias": P()}}
    return {**specs, "layers": [fused] * cfg.layers}


class Sampler:
    """Generates from a GPT-J on a ('dp', 'mp') mesh; params are kept sharded, in the compute dtype."""

    def __init__(self, cfg: Config, mesh: Mesh, params: dict):
        self.cfg, self.mesh = cfg, mesh
        self.dp = mesh.shape[DP]
        self.params = place_params(params, cfg, mesh)
        self._traces = 0
        self._generate = jax.jit(self._trace_generate, static_argnames="n_new")

    @property
    def compile_count(self) -> int:
        """How many programs have been traced (and so compiled) so far: one per distinct bucket."""
        return self._traces

    def _trace_generate(self, params, *batch, n_new: int):
        self._traces += 1
        row, rows = P(DP), P(DP, None)
        fn = jax.shard_map(partial(generate_local, cfg=self.cfg, n_new=n_new, tp_axis=MP, dp_axis=DP),
                           mesh=self.mesh, in_specs=(param_specs(self.cfg), rows, rows, *[row] * 5, P(), P(), P()),
                           out_specs=(rows, rows), check_vma=True)
        return fn(params, *batch)

    def _prepare_prompts(self, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                         truncate_left: bool) -> list[list[int]]:
        seq, vocab = self.cfg.seq, self.cfg.n_vocab
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, numbers.Integral) or max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be an integer of at least 1, got {max_new_tokens!r}")
        if max_new_tokens >= seq:
            raise ValueError(f"max_new_tokens ({max_new_tokens}) leaves no room for a prompt in the context of "
                             f"{seq} tokens")
        if not prompts:
            raise ValueError("no prompts given")
        out = []
        for i, prompt in enumerate(prompts):
            if isinstance(prompt, str):
                raise ValueError(f"prompt {i} is text; give token ids (or use generate_text with a tokenizer)")
            prompt = [int(t) for t in prompt]
            if not prompt:
                raise ValueError(f"prompt {i} is empty; give at least one token")
            if bad := [t for t in prompt if not 0 <= t < vocab]:
                raise ValueError(f"prompt {i} has token id {bad[0]} outside the vocabulary [0, {vocab})")
            if len(prompt) + max_new_tokens > seq:
                if not truncate_left:
                    raise ValueError(f"prompt {i} has {len(prompt)} tokens; with max_new_tokens {max_new_tokens} "
                                     f"that is beyond the context of {seq} tokens (pass truncate_left=True to cut "
                                     f"the prompt from the left)")
                prompt = prompt[len(prompt) + max_new_tokens - seq:]
            out.append(prompt)
        return out

    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int, *, temperature: Any = 1.0,
                 top_k: Any = 0, top_p: Any = 1.0, seed: Any = 0, stop_token_ids: Sequence[int] = (EOS_ID,),
                 return_logprobs: bool = False, truncate_left: bool = False) -> list[Result]:
        """Complete each prompt (a list of token ids) with up to `max_new_tokens` tokens.

        temperature (0 = greedy), top_k (0 = off), top_p (1 = off) and seed are scalars for every row or one value
        per prompt; a row's tokens depend only on its prompt, its sampling values and its seed. A row ends at the
        first of `stop_token_ids`, which is not returned. Log-probs are those of the chosen tokens under the model's
        untempered, unfiltered distribution.
        """
        prompts = self._prepare_prompts(prompts, max_new_tokens, truncate_left)
        n = len(prompts)
        temperature, top_k = _per_row("temperature", temperature, n, float), _per_row("top_k", top_k, n, int)
        top_p, seed = _per_row("top_p", top_p, n, float), _per_row("seed", seed, n, int)
        check_sampling(temperature, top_k, top_p)
        stop_token_ids = [int(t) for t in stop_token_ids]

        batch = self.dp * bucket(-(-n // self.dp), minimum=1)
        prompt_len = bucket(max(map(len, prompts)), maximum=self.cfg.seq)
        n_new = bucket(max_new_tokens, maximum=self.cfg.seq)
        ids_BxT = np.zeros((batch, prompt_len), np.int32)
        valid_BxT = np.zeros((batch, prompt_len), bool)
        for row, prompt in enumerate(prompts):
            ids_BxT[row, prompt_len - len(prompt):] = prompt
            valid_BxT[row, prompt_len - len(prompt):] = True
        valid_BxT[n:, -1] = True  # batch padding rows: one token, done from the start

        def rows(values, dtype, fill):
            return np.array(values + [fill] * (batch - n), dtype)

        stop_ids = np.full(bucket(len(stop_token_ids), minimum=4), _NO_STOP_ID, np.int32)
        stop_ids[:len(stop_token_ids)] = stop_token_ids
        seed_B = rows([s % 2 ** 32 for s in seed], np.uint32, 0)
        done_B = np.arange(batch) >= n
        tokens_BxN, logprobs_BxN = self._generate(
            self.params, ids_BxT, valid_BxT, rows(temperature, np.float32, 0.0), rows(top_k, np.int32, 0),
            rows(top_p, np.float32, 1.0), seed_B, done_B, stop_ids, np.int32(max_new_tokens),
            np.bool_(return_logprobs), n_new=n_new)
        tokens_BxN, logprobs_BxN = np.asarray(tokens_BxN), np.asarray(logprobs_BxN)

        results = []
        for row in range(n):
            tokens = tokens_BxN[row, :max_new_tokens]
            length = int(np.argmax(tokens == _DONE)) if (tokens == _DONE).any() else max_new_tokens
            stopped = length > 0 and int(tokens[length - 1]) in stop_token_ids
            kept = length - stopped
            results.append(Result(tokens[:kept].tolist(),
                                  logprobs_BxN[row, :kept].tolist() if return_logprobs else None,
                                  "stop" if stopped else "length"))
        return results

    def generate_text(self, tokenizer: Any, prompts: Sequence[str], max_new_tokens: int, *,
                      stop: Sequence[str] = (), **kwargs: Any) -> list[TextResult]:
        """Complete text prompts; a completion is cut before the first of the `stop` strings it contains.

        Takes the keyword arguments of `generate`. The tokens returned are those whose text lies wholly before the
        cut; a cut completion's finish_reason is "stop".
        """
        if any(not isinstance(s, str) or not s for s in stop):
            raise ValueError(f"stop strings must be non-empty strings, got {list(stop)!r}")
        results = self.generate([tokenizer.encode(p) for p in prompts], max_new_tokens, **kwargs)
        out = []
        for result in results:
            text, cut = cut_at_stop(tokenizer.decode(result.tokens), stop)
            tokens, logprobs, reason = result.tokens, result.logprobs, result.finish_reason
            if cut:
                kept = _tokens_within(tokenizer, tokens, len(text))
                tokens, logprobs, reason = tokens[:kept], logprobs and logprobs[:kept], "stop"
            out.append(TextResult(text, tokens, logprobs, reason))
        return out


def _tokens_within(tokenizer: Any, tokens: list[int], n_chars: int) -> int:
    """The most leading tokens whose decoded text is at most n_chars long (binary search: length grows with n)."""
    lo, hi = 0, len(tokens)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if len(tokenizer.decode(tokens[:mid])) <= n_chars:
            lo = mid
        else:
            hi = mid - 1
    return lo


# ----------------------------------------------------------------------------------------------------- loading
def load_params(cfg: Config, mesh: Mesh, ckpt_path: str | None = None) -> dict:
    """The params (never the optimizer state) of a checkpoint, sharded on `mesh`, in the compute dtype.

    `ckpt_path` is one of our checkpoints (a root, whose latest committed step is read, or a step directory), an
    original mesh-transformer-jax checkpoint or an HF GPT-J directory; None means cfg.model_path. A checkpoint
    whose shapes differ from the config is a ConfigError (a ValueError); no checkpoint there, FileNotFoundError.
    """
    layout = make_layout(dataclasses.replace(cfg, parallelism=SHARD_MAP), mesh=mesh)
    return convert.load_params(layout, ckpt_path or cfg.model_path)
