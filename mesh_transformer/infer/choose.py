"""How each row's next token is chosen from its logits, by that row's own sampling values (temperature, top-k,
top-p, seed, and OpenAI's presence and frequency penalties and logit bias): greedy rows skip the sampling work, and
the chosen token's log-probability is computed only when a row asks for it. The decode programs (decode.py) call
`choose` after every prefill and decode step.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from mesh_transformer.infer.sizes import MAX_LOGIT_BIAS


class LogitBias(NamedTuple):
    """Per row, the tokens [R, MAX_LOGIT_BIAS] whose logits get the values added (unused entries: a token id of
    at least the vocab size, dropped)."""
    ids: Any  # i32
    values: Any  # f32


class Sampling(NamedTuple):
    """Per-row sampling values [R], travelling as one pytree with one spec."""
    temperature: Any  # f32, 0 = greedy
    top_k: Any  # i32, 0 = off
    top_p: Any  # f32, 1 = off
    seed: Any  # u32
    logprobs: Any  # bool: whether the row's chosen log-probs are wanted
    presence: Any  # f32: subtracted from the logit of each token drawn before in the completion (0 = off)
    frequency: Any  # f32: subtracted once per earlier draw of the token (0 = off)
    bias: LogitBias | None = None  # the bias itself, at a request's first token (prefill; decode steps keep it)
    adapter: Any = None  # i32: the served LoRA adapter slot (-1: the base alone); None where none are served


def fill_sampling(n: int, placed: Iterable[tuple[int, Any]], bias: bool = False, adapters: bool = False) -> Sampling:
    """Sampling rows [n] (numpy) with each item's temperature, top_k, top_p, seed, logprobs and penalties at its row,
    with `bias` its logit bias ({token id: value}), with `adapters` its served adapter slot (`adapter`, -1: none);
    the other rows are greedy, without log-probs or adapter."""
    rows = Sampling(np.zeros(n, np.float32), np.zeros(n, np.int32), np.ones(n, np.float32), np.zeros(n, np.uint32),
                    np.zeros(n, bool), np.zeros(n, np.float32), np.zeros(n, np.float32),
                    LogitBias(np.full((n, MAX_LOGIT_BIAS), np.iinfo(np.int32).max, np.int32),
                              np.zeros((n, MAX_LOGIT_BIAS), np.float32)) if bias else None,
                    np.full(n, -1, np.int32) if adapters else None)
    for row, item in placed:
        if adapters:
            rows.adapter[row] = item.adapter
        rows.temperature[row], rows.top_k[row], rows.top_p[row] = item.temperature, item.top_k, item.top_p
        rows.seed[row], rows.logprobs[row] = item.seed % 2 ** 32, item.logprobs
        rows.presence[row], rows.frequency[row] = item.presence_penalty, item.frequency_penalty
        if bias and item.logit_bias:
            rows.bias.ids[row, :len(item.logit_bias)] = list(item.logit_bias)
            rows.bias.values[row, :len(item.logit_bias)] = list(item.logit_bias.values())
    return rows


def dense_bias(bias: LogitBias | None, rows: int, vocab: int) -> jax.Array:
    """The logit bias as an array [R, V] to add to the logits (zeros without one)."""
    dense_RxV = jnp.zeros((rows, vocab), jnp.float32)
    if bias is None:
        return dense_RxV
    return dense_RxV.at[jnp.arange(rows)[:, None], bias.ids].add(bias.values, mode="drop")


def adjusted(logits_RxV: jax.Array, sampling: Sampling, counts_RxV: jax.Array, bias_RxV: jax.Array) -> jax.Array:
    """The logits with OpenAI's penalties and bias: logit - count x frequency - (count > 0) x presence + bias, where
    count is how often the row's completion has drawn the token."""
    return (logits_RxV + bias_RxV - sampling.frequency[:, None] * counts_RxV
            - sampling.presence[:, None] * (counts_RxV > 0))


def _ordered(x: jax.Array) -> jax.Array:
    """f32 values as uint32 keys in the same order (-inf lowest; no NaN)."""
    bits = lax.bitcast_convert_type(x, jnp.uint32)
    return jnp.where(bits >> 31 == 0, bits | jnp.uint32(1 << 31), ~bits)


def _value(key: jax.Array) -> jax.Array:
    """`_ordered`'s inverse."""
    bits = jnp.where(key >> 31 == 1, key & jnp.uint32(0x7FFFFFFF), ~key)
    return lax.bitcast_convert_type(bits, jnp.float32)


def _search(lo_B: jax.Array, hi_B: jax.Array, holds: Callable[[jax.Array], jax.Array]) -> jax.Array:
    """The smallest key in [lo, hi] where `holds` (monotone: false below some key, true from it on, true at hi),
    per row, by bisection over the 32 bits."""
    def halve(_, bounds):
        lo, hi = bounds
        mid = lo + (hi - lo) // 2
        ok = holds(_value(mid))
        return jnp.where(ok, lo, mid + 1), jnp.where(ok, mid, hi)
    return lax.fori_loop(0, 32, halve, (lo_B, hi_B))[1]


def filter_logits(logits_BxV: jax.Array, top_k_B: jax.Array, top_p_B: jax.Array) -> jax.Array:
    """Top-k, then top-p (nucleus) filtering: logits outside the kept set become -inf.

    top_k 0 keeps every token. top-p keeps the smallest set of most likely tokens whose probability mass reaches
    top_p (after top-k); tokens tied with the least likely kept one are kept too; top_p 1 keeps all.

    No sort: the thresholds are found by bisection over the values' bits (32 passes over [B, V] each), exact, and
    cheap to compile, where XLA:TPU takes about 10 s to compile a sort of a vocab (a v5e target, on a CPU host), in
    every program that samples.
    """
    vocab = logits_BxV.shape[-1]
    x_BxV = logits_BxV.astype(jnp.float32)
    k_B = jnp.where(top_k_B > 0, jnp.minimum(top_k_B, vocab), vocab)
    top_B, low_B = x_BxV.max(-1), x_BxV.min(-1)
    # The k-th largest value: the largest v with at least k values >= v, i.e. one below the smallest with fewer.
    fewer = _search(_ordered(low_B), _ordered(top_B) + 1,
                    lambda v_B: (x_BxV >= v_B[:, None]).sum(-1) < k_B)
    kth_B = _value(fewer - 1)
    # The top-k's softmax: every value above the k-th, and as many of those equal to it as make k.
    above_BxV = x_BxV > kth_B[:, None]
    e_BxV = jnp.where(above_BxV, jnp.exp(x_BxV - top_B[:, None]), 0.0)
    ties_B = k_B - above_BxV.sum(-1)
    z_B = e_BxV.sum(-1) + ties_B * jnp.exp(kth_B - top_B)
    p_BxV = e_BxV / z_B[:, None]
    # The least likely kept value: the smallest v >= the k-th whose mass strictly above it is below top_p.
    threshold = _search(_ordered(kth_B), _ordered(top_B),
                        lambda v_B: jnp.where(x_BxV > v_B[:, None], p_BxV, 0.0).sum(-1) < top_p_B)
    threshold_B = jnp.where(top_p_B >= 1.0, kth_B, _value(threshold))
    return jnp.where(logits_BxV >= threshold_B[:, None], logits_BxV, -jnp.inf)


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


class Logprobs(NamedTuple):
    """Per row, under the untempered, unfiltered distribution: the chosen token's log-probability [R], and the k
    most likely tokens' ids and log-probabilities [R, k] (k = 0 unless asked), most likely first."""
    chosen: Any
    top_ids: Any
    top: Any


def top_k(x_BxV: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """`lax.top_k` (values and ids, largest first, ties by the lower id) for a small k as k argmaxes: XLA:TPU
    compiles top_k over a vocab as a sort (seconds, in every program that asks for log-probs)."""
    values, ids = [], []
    for _ in range(k):
        i_B = jnp.argmax(x_BxV, -1)
        values.append(jnp.take_along_axis(x_BxV, i_B[:, None], -1)[:, 0])
        ids.append(i_B)
        x_BxV = x_BxV.at[jnp.arange(x_BxV.shape[0]), i_B].set(-jnp.inf)
    if not k:
        return x_BxV[:, :0], jnp.zeros_like(x_BxV[:, :0], jnp.int32)
    return jnp.stack(values, -1), jnp.stack(ids, -1).astype(jnp.int32)


def logprobs(logits_BxV: jax.Array, token_B: jax.Array, wanted: jax.Array, k: int = 0) -> Logprobs:
    """The chosen tokens' log-probabilities and the top k, or zeros when `wanted` (a traced bool) is false: the
    log-softmax is a pass over [B, V], skipped at run time when nobody asked for it."""
    def computed():
        log_probs_BxV = jax.nn.log_softmax(logits_BxV)
        top_BxK, ids_BxK = top_k(log_probs_BxV, k)
        chosen_B = jnp.take_along_axis(log_probs_BxV, token_B[:, None], -1)[:, 0]
        return Logprobs(chosen_B, ids_BxK.astype(jnp.int32), top_BxK)

    def skipped():  # zeros typed like the logits (under shard_map: varying over the same axes)
        return Logprobs(jnp.zeros_like(logits_BxV[:, 0]), jnp.zeros_like(logits_BxV[:, :k], jnp.int32),
                        jnp.zeros_like(logits_BxV[:, :k]))

    return lax.cond(wanted, computed, skipped)


def choose(logits_RxV: jax.Array, sampling: Sampling, index_R: jax.Array, top: int = 0,
           penalties: tuple[jax.Array, jax.Array] | None = None) -> tuple[jax.Array, Logprobs]:
    """Token `index` of each row, drawn with key fold_in(PRNGKey(seed), index) from its logits, `adjusted` by its
    penalties and bias where `penalties` (its counts and bias [R, V]) are given, and its `logprobs` under the
    model's own distribution (untempered, unadjusted, unfiltered) with the `top` most likely (computed when any row
    asks for log-probs, else zeros)."""
    key_Rx2 = jax.vmap(lambda seed, i: jax.random.fold_in(jax.random.PRNGKey(seed), i))(sampling.seed, index_R)
    drawn_from = logits_RxV if penalties is None else adjusted(logits_RxV, sampling, *penalties)
    token_R = sample(drawn_from, sampling.temperature, sampling.top_k, sampling.top_p, key_Rx2)
    return token_R, logprobs(logits_RxV, token_R, jnp.any(sampling.logprobs), top)
