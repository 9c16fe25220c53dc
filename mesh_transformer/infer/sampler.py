"""Offline generation: a client of the decode programs (decode.py) that the serving engine runs too.

A batch of prompts is prefilled into slots of a cache sized for it (prompt bucket + new-token bucket), then decoded
by one program that loops on the device until every row has stopped or max_new_tokens are made (`generate_local`):
no dispatch per token, no host in the loop. Rows are padded to a power of two per dp group and prompts to a power
of two, so a new length inside a bucket reuses the compiled programs. A row's tokens depend only on its prompt,
its sampling values and its seed.
"""
from __future__ import annotations

import dataclasses
import numbers
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from mesh_transformer import config
from mesh_transformer.infer.choose import fill_sampling
from mesh_transformer.infer.decode import Steps
from mesh_transformer.infer.programs import Programs
from mesh_transformer.infer.sizes import bucket, prompt_problem
from mesh_transformer.infer.params import abstract_params, place_params
from mesh_transformer.parallel.layout import Layout
from mesh_transformer.parallel.mesh import DP
from mesh_transformer.model import families
from mesh_transformer.tokenizer import eos_ids


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


def _per_row(name: str, value: Any, n: int, kind: type) -> list:
    values = list(value) if isinstance(value, (list, tuple, np.ndarray)) else [value] * n
    if len(values) != n:
        raise ValueError(f"{name} has {len(values)} values for {n} prompts; give one value or one per prompt")
    for v in values:
        if isinstance(v, bool) or not isinstance(v, numbers.Real if kind is float else numbers.Integral):
            raise ValueError(f"{name} must be {'a number' if kind is float else 'an integer'}, got {v!r}")
    return [kind(v) for v in values]


def cut_at_stop(text: str, stop: Sequence[str]) -> tuple[str, bool]:
    """The text before the earliest stop string, and whether one was found."""
    cut = min((i for s in stop if (i := text.find(s)) >= 0), default=-1)
    return (text, False) if cut < 0 else (text[:cut], True)


def tokens_within(tokenizer: Any, tokens: list[int], n_chars: int) -> int:
    """The most leading tokens whose decoded text is at most n_chars long (binary search: length grows with n)."""
    lo, hi = 0, len(tokens)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if len(tokenizer.decode(tokens[:mid])) <= n_chars:
            lo = mid
        else:
            hi = mid - 1
    return lo


@dataclasses.dataclass(frozen=True)
class _RowSampling:
    temperature: float
    top_k: int
    top_p: float
    seed: int
    logprobs: bool
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class _Plan:
    """A generate call's programs' arguments but the params, the cache and the slots: slots per dp group, the
    cache's block length, prefill's (ids, lengths, slot, sampling), generate's (steps, live, stop ids, steps to
    take) and its static arguments."""
    n_local: int
    n_slots: int
    cache_sizes: list[int]
    prefill: tuple
    generate: tuple
    static: dict


def _plan(programs: Programs, prompts: list[list[int]], rows: list[_RowSampling], max_new_tokens: int,
          stop_token_ids: set[int]) -> _Plan:
    cfg, dp = programs.layout.cfg, programs.layout.mesh.shape[DP]
    seq = cfg.seq
    n_local = bucket(-(-len(prompts) // dp), minimum=1)
    n_slots = n_local * dp
    width = bucket(max(map(len, prompts)), maximum=seq)
    ids_NxT, length_N = np.zeros((n_slots, width), np.int32), np.ones(n_slots, np.int32)
    slot_N = np.full(n_slots, -1, np.int32)  # padding rows: written nowhere
    for row, prompt in enumerate(prompts):
        ids_NxT[row, :len(prompt)], length_N[row], slot_N[row] = prompt, len(prompt), row % n_local
    sampling = jax.device_put(fill_sampling(n_slots, enumerate(rows)), programs.row_sharding)
    steps = jax.device_put(Steps(length_N, np.ones(n_slots, np.int32), sampling), programs.row_sharding)
    stops = sorted(t for t in stop_token_ids if 0 <= t < cfg.n_vocab)  # others are never drawn
    stop_S = np.full(bucket(len(stops), minimum=4), -1, np.int32)  # -1: no token
    stop_S[:len(stops)] = stops
    live_N = jax.device_put(np.arange(n_slots) < len(prompts), programs.row_sharding)
    return _Plan(n_local, n_slots, [min(width + bucket(max_new_tokens, maximum=seq), seq)],
                 (ids_NxT, length_N, slot_N, sampling), (steps, live_N, stop_S, np.int32(max_new_tokens - 1)),
                 {"rows": n_local, "n_blocks": 1, "out_len": bucket(max_new_tokens, maximum=seq)})


def _stops(cfg: config.Config, stop_token_ids: Sequence[int] | None) -> Sequence[int]:
    return (families.of(cfg).eos_id,) if stop_token_ids is None else stop_token_ids


def compile_ahead(programs: Programs, n_prompts: int, longest: int, max_new_tokens: int,
                  stop_token_ids: Sequence[int] | None = None) -> None:
    """Compile the programs a `Sampler.generate` of n_prompts prompts (the longest `longest` tokens) runs, from
    shapes alone, before any weights exist: a tool that knows its prompt compiles first, so the compiler's working
    memory (GPT-J-6B on the CPU: 0.45 GB for the prefill and the decode loop) comes and goes before the weights
    arrive instead of on top of them. Prompts the sampler would refuse are left to it."""
    seq = programs.layout.cfg.seq
    if not 1 <= longest <= seq - max_new_tokens or n_prompts < 1 or max_new_tokens < 1:
        return
    plan = _plan(programs, [[0] * longest] * n_prompts, [_RowSampling(0.0, 0, 1.0, 0, False)] * n_prompts,
                 max_new_tokens, set(_stops(programs.layout.cfg, stop_token_ids)))
    params, cache = abstract_params(programs.layout), programs.abstract_cache(plan.n_slots, plan.cache_sizes)
    slots = programs.new_slots(plan.n_slots)
    programs.compile("prefill", (params, cache, slots, *plan.prefill), {"top": 0})
    if max_new_tokens > 1:
        programs.compile("generate", (params, cache, slots, *plan.generate), plan.static)


class Sampler:
    """Generates from a GPT-J on a shard_map Layout; params are kept placed for decoding, in the compute dtype."""

    def __init__(self, layout: Layout, params: dict, programs: Programs | None = None):
        self.layout, self.cfg = layout, layout.cfg
        self.dp = layout.mesh.shape[DP]
        self.params = place_params(params, layout)
        self.programs = programs or Programs(layout)

    @property
    def compile_count(self) -> int:
        """How many programs have been traced (and so compiled) so far: one per distinct bucket."""
        return self.programs.traces

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
            if problem := prompt_problem(prompt := [t.item() if hasattr(t, "item") else t for t in prompt], vocab):
                raise ValueError(f"prompt {i} {problem}")
            if len(prompt) + max_new_tokens > seq:
                if not truncate_left:
                    raise ValueError(f"prompt {i} has {len(prompt)} tokens; with max_new_tokens {max_new_tokens} "
                                     f"that is beyond the context of {seq} tokens (pass truncate_left=True to cut "
                                     f"the prompt from the left)")
                prompt = prompt[len(prompt) + max_new_tokens - seq:]
            out.append(prompt)
        return out

    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int, *, temperature: Any = 1.0,
                 top_k: Any = 0, top_p: Any = 1.0, seed: Any = 0, stop_token_ids: Sequence[int] | None = None,
                 return_logprobs: bool = False, truncate_left: bool = False) -> list[Result]:
        """Complete each prompt (a list of token ids) with up to `max_new_tokens` tokens.

        temperature (0 = greedy), top_k (0 = off), top_p (1 = off) and seed are scalars for every row or one value
        per prompt; a row's tokens depend only on its prompt, its sampling values and its seed. A row ends at the
        first of `stop_token_ids` (by default the family's end of text: `Family.eos_id`), which is not returned.
        Log-probs are those of the chosen tokens under the model's untempered, unfiltered distribution.
        """
        prompts = self._prepare_prompts(prompts, max_new_tokens, truncate_left)
        n = len(prompts)
        temperature, top_k = _per_row("temperature", temperature, n, float), _per_row("top_k", top_k, n, int)
        top_p, seed = _per_row("top_p", top_p, n, float), _per_row("seed", seed, n, int)
        config.check_sampling(temperature, top_k, top_p)
        rows = [_RowSampling(*values, return_logprobs) for values in zip(temperature, top_k, top_p, seed)]
        stop_token_ids = _stops(self.layout.cfg, stop_token_ids)
        tokens_NxS, logprobs_NxS = self._decode(prompts, rows, max_new_tokens, {int(t) for t in stop_token_ids})
        return [_result(tokens_NxS[row], logprobs_NxS[row], max_new_tokens, stop_token_ids, return_logprobs)
                for row in range(n)]

    def _decode(self, prompts: list[list[int]], rows: list[_RowSampling], max_new_tokens: int,
                stop_token_ids: set[int]) -> tuple[np.ndarray, np.ndarray]:
        """Prefill the prompts into slots, then decode until every row has stopped or has max_new_tokens tokens;
        returns tokens and log-probs [slots, at least max_new_tokens] (after a row's stop token, anything)."""
        programs = self.programs
        plan = _plan(programs, prompts, rows, max_new_tokens, stop_token_ids)
        cache = programs.new_cache(plan.n_slots, plan.cache_sizes)
        token, logprob, last, cache = programs.prefill(self.params, cache, programs.new_slots(plan.n_slots),
                                                       *plan.prefill)
        logprob = logprob.chosen
        if max_new_tokens == 1:
            return np.asarray(token)[:, None], np.asarray(logprob)[:, None]
        tokens_NxS, logprobs_NxS, _ = programs.generate(self.params, cache, last, *plan.generate, **plan.static)
        return (np.concatenate([np.asarray(token)[:, None], np.asarray(tokens_NxS)], 1),
                np.concatenate([np.asarray(logprob)[:, None], np.asarray(logprobs_NxS)], 1))

    def generate_text(self, tokenizer: Any, prompts: Sequence[str], max_new_tokens: int, *,
                      stop: Sequence[str] = (), **kwargs: Any) -> list[TextResult]:
        """Complete text prompts; a completion is cut before the first of the `stop` strings it contains.

        Takes the keyword arguments of `generate`. The tokens returned are those whose text lies wholly before the
        cut; a cut completion's finish_reason is "stop".
        """
        if any(not isinstance(s, str) or not s for s in stop):
            raise ValueError(f"stop strings must be non-empty strings, got {list(stop)!r}")
        kwargs.setdefault("stop_token_ids", eos_ids(tokenizer))  # the tokenizer's end of text, not GPT-2's alone
        results = self.generate([tokenizer.encode(p) for p in prompts], max_new_tokens, **kwargs)
        out = []
        for result in results:
            text, cut = cut_at_stop(tokenizer.decode(result.tokens), stop)
            tokens, logprobs, reason = result.tokens, result.logprobs, result.finish_reason
            if cut:
                kept = tokens_within(tokenizer, tokens, len(text))
                tokens, logprobs, reason = tokens[:kept], logprobs and logprobs[:kept], "stop"
            out.append(TextResult(text, tokens, logprobs, reason))
        return out


def _result(tokens_S: np.ndarray, logprobs_S: np.ndarray, max_new_tokens: int, stop_token_ids: Sequence[int],
            return_logprobs: bool) -> Result:
    """One row's Result: its tokens up to the first stop token (not included) or max_new_tokens."""
    tokens, stop_ids = tokens_S[:max_new_tokens].tolist(), set(stop_token_ids)
    stops = [i for i, t in enumerate(tokens) if t in stop_ids]
    kept = stops[0] if stops else len(tokens)
    return Result(tokens[:kept], logprobs_S[:kept].tolist() if return_logprobs else None,
                  "stop" if stops else "length")
