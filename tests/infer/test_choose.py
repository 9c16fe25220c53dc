"""Choosing tokens: OpenAI's presence and frequency penalties and logit bias against a NumPy reference."""
import dataclasses

import jax
import numpy as np

from mesh_transformer.infer import choose


@dataclasses.dataclass
class Row:
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    logprobs: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict = dataclasses.field(default_factory=dict)


def reference(logits, counts, row: Row):
    """OpenAI's rule: mu[j] - c[j] * frequency - (c[j] > 0) * presence, plus the bias."""
    out = logits - counts * row.frequency_penalty - (counts > 0) * row.presence_penalty
    for token, value in row.logit_bias.items():
        out[token] += value
    return out


def test_penalties_and_bias_per_row_equal_the_numpy_reference():
    rng = np.random.default_rng(0)
    vocab = 50
    rows = [Row(presence_penalty=0.5, frequency_penalty=1.5), Row(),
            Row(logit_bias={3: 100.0, 7: -100.0, 49: 2.5}, frequency_penalty=-2.0), Row(presence_penalty=-1.0)]
    logits = rng.standard_normal((4, vocab)).astype(np.float32)
    counts = rng.integers(0, 3, (4, vocab)).astype(np.int32)
    sampling = choose.fill_sampling(4, enumerate(rows), bias=True)
    bias = choose.dense_bias(sampling.bias, 4, vocab)
    got = jax.jit(lambda: choose.adjusted(logits, sampling, counts, bias))()
    for r, row in enumerate(rows):
        np.testing.assert_allclose(got[r], reference(logits[r].copy(), counts[r], row), rtol=1e-6, atol=1e-5)
    # Greedy draws the adjusted argmax; the log-probs stay the model's own.
    tokens, logprobs = jax.jit(lambda: choose.choose(logits, sampling._replace(logprobs=np.ones(4, bool)),
                                                     np.zeros(4, np.int32), 2, (counts, bias)))()
    assert tokens[2] == 3 and list(tokens) == list(np.argmax(got, -1))
    log_softmax = jax.nn.log_softmax(logits)
    np.testing.assert_allclose(logprobs.chosen, log_softmax[np.arange(4), tokens], rtol=1e-5)


def kept_by_sorting(logits, top_k, top_p):
    """Top-k then top-p by sorting one row (NumPy): the smallest prefix of the sorted top-k whose mass before each
    kept token is below top_p, and every token tied with the last kept one."""
    order = np.sort(logits)[::-1]
    k = min(top_k, len(logits)) if top_k > 0 else len(logits)
    top = order[:k].astype(np.float64)
    probs = np.exp(top - top[0]) / np.exp(top - top[0]).sum()
    before = np.cumsum(probs) - probs
    n = k if top_p >= 1 else int((before < top_p).sum())
    return (logits >= order[n - 1]) & np.isfinite(logits)  # a masked token stays masked


def test_top_k_and_top_p_by_bisection_equal_sorting_with_ties_and_masked_tokens():
    rng = np.random.default_rng(0)
    for trial in range(12):
        vocab = int(rng.integers(2, 200))
        logits = (rng.standard_normal((16, vocab)) * rng.uniform(0.2, 4)).astype(np.float32)
        if trial % 2:
            logits = np.round(logits, 1)  # many ties
        if trial % 3 == 0:
            logits[:, : vocab // 3] = -np.inf  # masked tokens (a logit bias of -100 and below, say)
        top_k = rng.integers(0, vocab + 3, 16).astype(np.int32)
        top_k[::4] = 0
        # top_p away from the rounding of a cumulative sum (f32 here, f64 in the reference)
        top_p = rng.uniform(0.05, 1.0, 16).astype(np.float32)
        top_p[::5] = 1.0
        kept = np.isfinite(np.asarray(jax.jit(choose.filter_logits)(logits, top_k, top_p)))
        for row in range(16):
            np.testing.assert_array_equal(kept[row], kept_by_sorting(logits[row], top_k[row], top_p[row]))


def test_top_k_by_argmax_equals_lax_top_k_ties_by_the_lower_id():
    rng = np.random.default_rng(1)
    x = np.round(rng.standard_normal((8, 300)), 1).astype(np.float32)
    values, ids = jax.jit(choose.top_k, static_argnums=1)(x, 5)
    want_values, want_ids = jax.lax.top_k(x, 5)
    np.testing.assert_array_equal(np.asarray(values), np.asarray(want_values))
    np.testing.assert_array_equal(np.asarray(ids), np.asarray(want_ids))
