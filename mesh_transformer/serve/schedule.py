"""The serving engine's scheduling policy, as a pure object: which free slot a request takes, how admitted requests
are grouped into prefill programs, and which decode program a step runs. No device, no thread, no queue: the
engine (engine.py) asks it and runs what it says, and the tests check it without compiling anything.

Slots are split over dp groups like the cache: slot i is row i % n_local of group i // n_local. A program computes
the same number of rows in every group, padded up to one of a few counts (a ladder), so that each (rows, blocks)
or (rows, prompt bucket) pair is one compiled program.
"""
from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

from mesh_transformer.config import ConfigError
from mesh_transformer.infer.decode import block_sizes, default_block
from mesh_transformer.infer.sizes import bucket, fit, ladder

MAX_PREFILL_ROWS = 16  # requests prefilled together at most, per dp group
# A prefill of more than one row is at most this many tokens (rows x prompt bucket): longer prompts are prefilled a
# few or one at a time. Past a few hundred tokens a prefill is bound by compute, not by reading the weights, so
# batching more gains little, and each (rows, bucket) pair is one more program to compile.
PREFILL_TOKENS = 1024
# A paged engine's row prefills at most this many tokens in one program: a longer prompt goes in pieces, each after the
# pages of the ones before (a prompt's rest after a cached prefix, as `chunk` says). Its temporaries grow with a row's
# tokens times the positions it attends: compiled for a v5e, GPT-J-6B int8's prefill of a 2048-token prompt after a
# prefix needed 3.36 GiB, of a 512-token piece after 1536 0.79, which the paged cache's pages get instead.
PREFILL_CHUNK = 512


@dataclasses.dataclass(frozen=True)
class Schedule:
    """The policy of an engine with `n_slots` slots over `dp` groups, a context of `seq` and cache blocks of these
    sizes."""
    n_slots: int
    dp: int
    seq: int
    block_sizes: tuple[int, ...]
    chunk: int = 0  # the most tokens a row prefills in one program (0: a whole context)

    @property
    def n_local(self) -> int:
        """Slots per dp group."""
        return self.n_slots // self.dp

    @functools.cached_property
    def decode_rows(self) -> list[int]:
        """The row counts (per group) decode programs are compiled for: 1, 4, 16, then doubling (32, 64, ...), and
        the group's slots. (The engine's schedule for 32 requests of 1,024 + 1,024 tokens on 1,627 pages of 16
        with 64 slots, run on the CPU, holds 17 to 24 requests in 832 of its 2,366 decode steps; on a v5e
        Llama-3-8B int8's decode step takes 13.0 ms at 32 rows, 15.7 at 64.)"""
        rows = ladder(min(self.n_local, 16), 4)
        while rows[-1] < self.n_local:
            rows.append(min(2 * rows[-1], self.n_local))
        return rows

    @functools.cached_property
    def block_counts(self) -> list[int]:
        """The cache block counts decode programs are compiled for."""
        return ladder(len(self.block_sizes), 2)

    @functools.cached_property
    def prefill_rows(self) -> dict[int, list[int]]:
        """Per prompt bucket, the row counts (per group) prefill programs are compiled for."""
        group_rows = ladder(min(self.n_local, MAX_PREFILL_ROWS), 4)
        longest = self.chunk or self.seq
        return {width: [r for r in group_rows if r == 1 or r * width <= PREFILL_TOKENS]
                for width in sorted({bucket(n, maximum=self.seq) for n in range(1, longest + 1)})}

    def admission_order(self, free: Sequence[int]) -> list[int]:
        """Free slots in the order requests take them: lowest row of a group first, so steps compute fewer rows."""
        return sorted(free, key=lambda i: (i % self.n_local, i // self.n_local))

    def cheap_rows(self, busy: Sequence[int]) -> int:
        """The rows per group a decode step computes for these busy slots (1 when none): a request admitted into
        one of them makes no step compute more."""
        return fit(max(i % self.n_local for i in busy) + 1, self.decode_rows) if busy else 1

    def prefill_batches(self, prompt_lengths: dict[int, int],
                        single: bool = False) -> list[tuple[int, int, list[tuple[int, int]]]]:
        """Admitted requests ({slot: prompt length}) as prefill programs: (rows per group, prompt bucket,
        [(slot, row)]), at most MAX_PREFILL_ROWS slots per group each (`single`: one), group g's requests at rows
        g x rows + j."""
        groups: list[list[int]] = [[] for _ in range(self.dp)]
        for slot in prompt_lengths:
            groups[slot // self.n_local].append(slot)
        rows_by_width = self.prefill_rows
        batches = []
        while any(groups):
            allowed = rows_by_width[self.width([prompt_lengths[s] for g in groups for s in g[:MAX_PREFILL_ROWS]])]
            allowed = allowed[:1] if single else allowed
            taken = [group[:allowed[-1]] for group in groups]
            groups = [group[allowed[-1]:] for group in groups]
            rows = fit(max(map(len, taken)), allowed)
            placed = [(slot, g * rows + j) for g, group in enumerate(taken) for j, slot in enumerate(group)]
            batches.append((rows, self.width([prompt_lengths[slot] for slot, _ in placed]), placed))
        return batches

    def width(self, prompt_lengths: Sequence[int]) -> int:
        """The prompt bucket of prompts of these lengths."""
        return bucket(max(prompt_lengths), maximum=self.seq)

    def decode(self, positions: dict[int, int]) -> tuple[int, int, dict[int, int]]:
        """The decode program for the live slots ({slot: its position}): (rows per group, cache blocks read,
        {slot: its output row})."""
        rows = fit(max(i % self.n_local for i in positions) + 1, self.decode_rows)
        n_blocks = fit(max(positions.values()) // self.block_sizes[0] + 1, self.block_counts)
        return rows, n_blocks, {i: (i // self.n_local) * rows + i % self.n_local for i in positions}


def engine_schedule(max_batch: int, dp: int, seq: int, page_size: int | None = None,
                    min_span: int | None = None) -> Schedule:
    """The schedule of an engine of `max_batch` slots (rounded up to a multiple of dp): over a paged cache's pages of
    `page_size` positions, prompts prefilled in pieces of at most PREFILL_CHUNK tokens; else over the slot cache's
    blocks of `min_span` positions (default: `decode.default_block`)."""
    block = page_size or min(min_span or default_block(seq), seq)
    return Schedule(-(-max_batch // dp) * dp, dp, seq, tuple(block_sizes(seq, block)),
                    PREFILL_CHUNK if page_size and seq > PREFILL_CHUNK else 0)


def check_pages(n_pages: int, page_size: int, dp: int) -> None:
    """A paged cache's pages (--kv-pages) are a positive multiple of the data-parallel size (a pool per group)."""
    if n_pages < dp or n_pages % dp or page_size < 1:
        raise ConfigError(f"a paged cache needs a positive multiple of the data-parallel size {dp} pages "
                          f"(--kv-pages) of at least one token, got {n_pages} of {page_size}")
