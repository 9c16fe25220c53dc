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
