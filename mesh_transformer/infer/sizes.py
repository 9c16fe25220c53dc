"""The sizes that counts and lengths are padded up to, so that a few compiled programs cover every request: prompt
lengths and row counts to powers of two (`bucket`), slot counts up a ladder of powers (`ladder`, `fit`); and the one
check of a token prompt (`prompt_problem`). Pure Python: the HTTP API's validation imports it."""
from __future__ import annotations

import json
import numbers
from collections.abc import Sequence
from typing import Any

MIN_BUCKET = 16
MAX_LOGIT_BIAS = 300  # token biases per request at most, as OpenAI allows


def bucket(n: int, minimum: int = MIN_BUCKET, maximum: int | None = None) -> int:
    """The power of two (at least `minimum`, at most `maximum`) that a length is padded to, so compiles are reused."""
    size = max(minimum, 1 << max(0, n - 1).bit_length())
    return size if maximum is None else min(size, max(maximum, n))


def ladder(n: int, base: int) -> list[int]:
    """1, base, base^2, ... below n, then n: the sizes a count is padded up to (`fit`), so that few programs cover
    every count up to n."""
    sizes = [1]
    while sizes[-1] * base < n:
        sizes.append(sizes[-1] * base)
    return sizes + [n] if n > 1 else sizes


def fit(n: int, sizes: list[int]) -> int:
    """The smallest of `sizes` (ascending) that holds n."""
    return next(size for size in sizes if size >= n)


def prompt_problem(prompt: Sequence[Any], vocab: int) -> str | None:
    """What is wrong with a token prompt, said after the word "prompt" (empty; an id that is not an integer in
    [0, vocab)), or None: the one check of the sampler, the serving engine and the HTTP API."""
    if len(prompt) == 0:
        return "is empty; give at least one token"
    for t in prompt:
        if isinstance(t, bool) or not isinstance(t, numbers.Integral) or not 0 <= t < vocab:
            shown = t if isinstance(t, numbers.Integral) and not isinstance(t, bool) else json.dumps(t, default=str)
            return f"has token id {str(shown)[:50]} outside the vocabulary: ids must be integers in [0, {vocab})"
    return None
