"""Scoring token sequences in one forward: each scored token's log-probability, whether it was the argmax, and the
k most likely tokens at its position. The lm-eval adapter (harness.py) and the server's echo + logprobs use it.

Rows are packed: a row holds several units, each a context and the continuations scored after it. The context
(but its last token) is laid down once; each continuation follows it as a segment of its own that starts with the
context's last token, sits at the positions right after the context, and sees the context and itself only. A
multiple-choice question with four answers so costs its context once, not four times, and short requests share a
row instead of padding it. Every token carries its rotary position, its unit (`group`) and its segment (0 = the
shared context), from which the program builds the attention mask. Rows and widths are padded to fixed buckets,
so a new length does not recompile. Shape letters: the legend in model/layers.py (C the continuations' tokens).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from mesh_transformer.config import Config
from mesh_transformer.infer.sizes import bucket
from mesh_transformer.infer.params import place_params
from mesh_transformer.infer.programs import checks_vma
from mesh_transformer.model import attention, gptj, layers, lora_slots
from mesh_transformer.parallel.layout import Layout
from mesh_transformer.parallel.mesh import DP
from mesh_transformer.platforms import Policy

MAX_TOP = 5  # the most alternatives a position reports (OpenAI's limit for completions)


class Rows(NamedTuple):
    """Packed rows (numpy, int32): token ids, rotary positions, unit and segment of each token (-1: padding) [R, T];
    the columns that are scored, in order, and the token each is scored against [R, C] (-1: padding). Only the
    scored columns go through the LM head, the largest matrix product by far: a shared context is not scored."""
    ids: np.ndarray
    positions: np.ndarray
    groups: np.ndarray
    segments: np.ndarray
    columns: np.ndarray
    targets: np.ndarray


class Scores(NamedTuple):
    """Per scored column [R, C]: the target's log-prob and whether it is the argmax; the top k ids and log-probs
    [R, C, k] (k = 0 unless asked)."""
    logprob: np.ndarray
    greedy: np.ndarray
    top_ids: np.ndarray
    top_logprobs: np.ndarray


@dataclasses.dataclass(frozen=True)
class Unit:
    """A context (at least one token) and the continuations scored after it."""
    context: tuple[int, ...]
    continuations: tuple[tuple[int, ...], ...]

    @property
    def length(self) -> int:
        return len(self.context) - 1 + sum(map(len, self.continuations))


@dataclasses.dataclass(frozen=True)
class Placed:
    """Where one continuation's scores lie: row, first scored column (an index into Rows.columns), token count."""
    row: int
    start: int
    length: int


def packed_mask(groups_RxT: jax.Array, segments_RxT: jax.Array) -> jax.Array:
    """Attention mask [R, T, T]: a query sees earlier keys of its unit, in the shared context or its own segment."""
    causal_1xTxT = attention.causal_mask(groups_RxT.shape[1])
    same_unit_RxTxT = groups_RxT[:, :, None] == groups_RxT[:, None, :]
    visible_RxTxT = (segments_RxT[:, None, :] == 0) | (segments_RxT[:, :, None] == segments_RxT[:, None, :])
    return causal_1xTxT & same_unit_RxTxT & visible_RxTxT


def _greedy(logits_RxTxV: jax.Array, targets_RxT: jax.Array, tp_axis: str | None) -> jax.Array:
    """Whether each target is the argmax (the first of tied maxima, as torch's), over a vocab-sharded axis."""
    local_max_RxT = logits_RxTxV.max(-1)
    offset = layers.vocab_offset(logits_RxTxV.shape[-1], tp_axis)
    local_arg_RxT = jnp.argmax(logits_RxTxV, -1).astype(jnp.int32) + offset
    if tp_axis is None:
        return local_arg_RxT == targets_RxT
    best_RxT = lax.pmax(local_max_RxT, tp_axis)
    candidate_RxT = jnp.where(local_max_RxT == best_RxT, local_arg_RxT, jnp.iinfo(jnp.int32).max)
    return lax.pmin(candidate_RxT, tp_axis) == targets_RxT


def _top(logits_RxTxV: jax.Array, k: int, tp_axis: str | None) -> tuple[jax.Array, jax.Array]:
    """The k most likely ids and their log-probs [R, T, k] over the whole vocab: each shard's top k, gathered, then
    the top k of those."""
    values_RxTxk, ids_RxTxk = lax.top_k(logits_RxTxV, k)
    ids_RxTxk = ids_RxTxk.astype(jnp.int32) + layers.vocab_offset(logits_RxTxV.shape[-1], tp_axis)
    if tp_axis is not None:
        values_RxTxk, ids_RxTxk = (layers.gather_shards(x, tp_axis) for x in (values_RxTxk, ids_RxTxk))
        values_RxTxk, order_RxTxk = lax.top_k(values_RxTxk, k)
        ids_RxTxk = jnp.take_along_axis(ids_RxTxk, order_RxTxk, -1)
    lse_RxT = jax.nn.logsumexp(logits_RxTxV, -1)
    if tp_axis is not None:
        max_RxT = lax.pmax(lse_RxT, tp_axis)
        lse_RxT = jnp.log(lax.psum(jnp.exp(lse_RxT - max_RxT), tp_axis)) + max_RxT
    return ids_RxTxk, values_RxTxk - lse_RxT[..., None]


def score_local(params: dict, rows: Rows, adapter_R, *, cfg: Config, policy: Policy, top_k: int,
                tp_axis: str | None = None):
    """Per device: the forward over packed rows (each row through its served LoRA adapter's slot, -1: the base,
    where the params hold slots), then `Scores` of each position (this dp group's rows)."""
    mask_RxTxT = packed_mask(rows.groups, rows.segments)
    adapters = lora_slots.Rows(adapter_R) if "lora" in params["layers"][0] else None
    logits_RxTxV, _ = gptj.run(params, rows.ids, rows.positions, cfg, policy=policy, tp_axis=tp_axis,
                               mask_BxTxS=mask_RxTxT, columns_BxC=rows.columns, adapters=adapters)
    targets_RxT = jnp.maximum(rows.targets, 0)
    logprob_RxT = -layers.cross_entropy(logits_RxTxV, targets_RxT, tp_axis)
    greedy_RxT = _greedy(logits_RxTxV, targets_RxT, tp_axis)
    if top_k == 0:
        empty = jnp.zeros((*targets_RxT.shape, 0))
        return logprob_RxT, greedy_RxT, empty.astype(jnp.int32), empty
    return (logprob_RxT, greedy_RxT, *_top(logits_RxTxV, top_k, tp_axis))


class Scorer:
    """The scoring program of one shard_map Layout over params placed for decoding; `batch_rows` rows (a multiple
    of dp) per program, so compiles are one per width bucket (and top k). Without params it only compiles
    (`aot`)."""

    def __init__(self, layout: Layout, params: dict | None, batch_rows: int = 8):
        self.layout, self.cfg = layout, layout.cfg
        dp = layout.mesh.shape[DP]
        self.batch_rows = -(-max(1, batch_rows) // dp) * dp
        self.params = None if params is None else place_params(params, layout)
        self.traces = 0
        self._program = jax.jit(self._score, static_argnames=("top_k",))

    def _score(self, params: dict, rows: Rows, adapter_R, *, top_k: int):
        self.traces += 1
        row = self.layout.spec(("batch", "length"))
        top = self.layout.spec(("batch", "length", None))
        fn = partial(score_local, cfg=self.cfg, policy=self.layout.policy, top_k=top_k, tp_axis=self.layout.tp_axis)
        in_specs = (self.layout.placed_specs(), Rows(*[row] * 6), self.layout.spec(("batch",)))
        return self.layout.per_device(fn, in_specs, (row, row, top, top), checks_vma(self.layout.policy))(
            params, rows, adapter_R)

    def width(self, longest: int) -> int:
        """The row width for units of at most `longest` tokens: a power of two, at most seq (a longer unit is cut
        into pieces that each repeat its context)."""
        return bucket(min(longest, self.cfg.seq), maximum=self.cfg.seq)

    def run(self, rows: Rows, top_k: int = 0, adapter: int = -1) -> Scores:
        """Scores of packed rows (padded here to a multiple of batch_rows), with the top_k (at most MAX_TOP)
        alternatives: one program finds MAX_TOP for every k, so k does not add compiles. `adapter`: the served LoRA
        adapter slot every row runs (-1: the base)."""
        if not 0 <= top_k <= MAX_TOP:
            raise ValueError(f"top_k must be in [0, {MAX_TOP}], got {top_k}")
        n = rows.ids.shape[0]
        padded = -(-n // self.batch_rows) * self.batch_rows
        out = []
        for start in range(0, padded, self.batch_rows):
            chunk = Rows(*[_pad_rows(x[start:start + self.batch_rows], self.batch_rows, fill)
                           for x, fill in zip(rows, PAD)])
            adapter_R = np.full(self.batch_rows, adapter, np.int32)
            out.append(self._program(self.params, chunk, adapter_R, top_k=MAX_TOP if top_k else 0))
        logprob, greedy, top_ids, top_logprobs = (np.concatenate([np.asarray(o[i]) for o in out])[:n]
                                                  for i in range(4))
        return Scores(logprob, greedy, top_ids[..., :top_k], top_logprobs[..., :top_k])


PAD = Rows(0, 0, -1, -1, 0, -1)  # what a padding token holds in each field


def _pad_rows(x_RxT: np.ndarray, rows: int, fill: int) -> np.ndarray:
    padding = np.full((rows - x_RxT.shape[0], x_RxT.shape[1]), fill, x_RxT.dtype)
    return np.concatenate([x_RxT, padding])


def split_units(units: Sequence[Unit], width: int) -> list[tuple[int, int, Unit]]:
    """(unit index, first continuation index, unit) pieces that each fit `width`: a unit too long for one row is
    cut into several, each repeating the context."""
    pieces = []
    for u, unit in enumerate(units):
        first, taken = 0, []
        for i, cont in enumerate(unit.continuations):
            if taken and len(unit.context) - 1 + sum(map(len, taken)) + len(cont) > width:
                pieces.append((u, first, Unit(unit.context, tuple(taken))))
                first, taken = i, []
            taken.append(cont)
        pieces.append((u, first, Unit(unit.context, tuple(taken))))
    return pieces


def pack(units: Sequence[Unit], width: int) -> tuple[Rows, list[list[Placed]]]:
    """Units packed into rows of `width` tokens, longest first into the first row with room (first-fit
    decreasing); returns the rows and, per unit, where each of its continuations is scored."""
    pieces = sorted(split_units(units, width), key=lambda p: -p[2].length)
    fill: list[int] = []  # tokens used in each row
    placed: list[list[Placed | None]] = [[None] * len(u.continuations) for u in units]
    arrays = []
    for group, (u, first, unit) in enumerate(pieces):
        row = next((r for r, used in enumerate(fill) if used + unit.length <= width), len(fill))
        if row == len(fill):
            fill.append(0)
            arrays.append(np.full((5, width), -1, np.int32))
        col = fill[row]
        ctx = unit.context
        _lay(arrays[row], col, ctx[:-1], range(len(ctx) - 1), group, 0, ())
        col += len(ctx) - 1
        for i, cont in enumerate(unit.continuations):
            if not cont:  # nothing to score: the sum is 0
                placed[u][first + i] = Placed(row, col, 0)
                continue
            tokens = (ctx[-1], *cont[:-1])
            _lay(arrays[row], col, tokens, range(len(ctx) - 1, len(ctx) - 1 + len(cont)), group, i + 1, cont)
            placed[u][first + i] = Placed(row, col, len(cont))
            col += len(cont)
        fill[row] = col
    arrays = arrays or [np.full((5, width), -1, np.int32)]
    ids, positions, groups, segments, targets_RxT = (np.stack([a[i] for a in arrays]) for i in range(5))
    scored = [np.flatnonzero(t >= 0) for t in targets_RxT]
    columns_RxC = np.full((len(arrays), bucket(max(map(len, scored)), minimum=1, maximum=width)), -1, np.int32)
    targets_RxC = np.full(columns_RxC.shape, -1, np.int32)
    for r, cols in enumerate(scored):
        columns_RxC[r, :len(cols)], targets_RxC[r, :len(cols)] = cols, targets_RxT[r, cols]
    placed = [[dataclasses.replace(p, start=int(np.searchsorted(scored[p.row], p.start))) for p in unit]
              for unit in placed]
    rows = Rows(ids, positions, groups, segments, columns_RxC, targets_RxC)
    return Rows(*[np.where(x < 0, fill, x) for x, fill in zip(rows, PAD)]), placed


def _lay(row_5xT: np.ndarray, col: int, tokens: Sequence[int], positions: range, group: int, segment: int,
         targets: Sequence[int]) -> None:
    """Write one stretch of tokens into a row: ids, positions, unit, segment, targets (-1: not scored)."""
    end = col + len(tokens)
    row_5xT[0, col:end], row_5xT[1, col:end] = tokens, list(positions)
    row_5xT[2, col:end], row_5xT[3, col:end] = group, segment
    scored = list(targets)[:len(tokens)]
    row_5xT[4, col:col + len(scored)] = scored


@dataclasses.dataclass(frozen=True)
class TokenScores:
    """A sequence's tokens after the first: each one's log-prob, and the k most likely (id, log-prob) before it."""
    logprobs: list[float]
    alternatives: list[list[tuple[int, float]]]


def score_sequences(scorer: Scorer, sequences: Sequence[Sequence[int]], top_k: int = 0,
                    adapter: int = -1) -> list[TokenScores]:
    """Per-token scores of whole sequences (an echoed prompt and its completion), packed like any units, through a
    served LoRA adapter's slot where `adapter` is one."""
    units = [Unit(tuple(s[:1]), (tuple(s[1:]),)) for s in sequences]
    width = scorer.width(max((u.length for u in units), default=1))
    rows, placed = pack(units, width)
    scores = scorer.run(rows, top_k=top_k, adapter=adapter)
    out = []
    for (p,) in placed:
        span = slice(p.start, p.start + p.length)
        top = [list(zip(ids.tolist(), lps.tolist())) for ids, lps in
               zip(scores.top_ids[p.row, span], scores.top_logprobs[p.row, span])]
        out.append(TokenScores(scores.logprob[p.row, span].tolist(), top))
    return out
