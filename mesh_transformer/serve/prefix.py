"""Automatic prefix caching, as a pure object: which slots of the serving cache hold which prompt prefixes, so that a
new request reuses the keys and values of its longest cached prefix and prefills only the rest. No device: the
engine (engine.py) asks it where a request goes and runs what it says; the tests check it without compiling.

A prompt is cut into blocks of PAGE tokens; block i is named by a hash of its tokens and of block i - 1's name, so a
name stands for the whole prefix up to the end of its block. Each slot holds the names of the full blocks whose keys
it has written, in order; a name's holders are the slots that hold it (its reference count). A request's match in
a slot is the number of leading names the two share; at most its prompt minus one token is reused (the last token
is always computed: its logits choose the first new token).

Where a request goes: a free slot of the dp group that holds the longest match, busy or free, in the rows a decode
step computes anyway if it has one there (`cheap_rows`: a step computes every row up to the highest busy one,
padded to its program's row count): the holder itself, else the least recently used; otherwise the one the engine
prefers (the lowest row). Its blocks are reused in place when that slot holds them, else copied from the
group's slot that does (on the group's devices). The slot taken loses its other blocks: eviction is
least-recently-used among the rows that cost nothing more, and never takes a higher row for recency alone (that
would make every decode step compute that many rows). Blocks live as long as some slot holds them. A busy slot's
blocks stay held: it writes only after its prompt. Within one round of admissions a taken slot serves as a
source only up to what its new request reuses, and a slot copied from is not taken, so no program of the round
reads a block another one overwrites.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence


from mesh_transformer.infer.pages import block_names

PAGE = 16  # tokens per hashed block


@dataclasses.dataclass(frozen=True)
class Placement:
    """Where an admitted request goes: its slot, the slot whose cache holds its reused prefix (its own, or one of
    its dp group to copy from) and how many prompt tokens it reuses (a multiple of PAGE; 0: none)."""
    slot: int
    source: int
    reused: int


class PrefixIndex:
    """The prefix blocks held by each of `n_slots` slots split over dp groups of `n_local` slots."""

    def __init__(self, n_slots: int, n_local: int, page: int = PAGE):
        self.n_local, self.page = n_local, page
        self.held: list[list[bytes]] = [[] for _ in range(n_slots)]
        self.holders: dict[bytes, set[int]] = {}
        self.used = [0] * n_slots  # when each slot's blocks were last written or read (a counter)
        self._clock = 0
        self.queried_tokens = self.hit_tokens = 0

    def place(self, prompt: Sequence[int], free: Sequence[int], pinned: set[int],
              cheap_rows: int = 1) -> Placement | None:
        """Where a request with this prompt goes among the `free` slots (in the engine's order of preference),
        skipping `pinned` ones (copied from this round), and its reuse; records the slot as taken (its blocks past
        the reused ones dropped, the new prompt's added by `hold`). Among the slots of each group's first
        `cheap_rows` rows, the least recently used is preferred. None when every free slot is pinned."""
        free = [s for s in free if s not in pinned]
        if not free:
            return None
        matches = self._matches(block_names(prompt[:len(prompt) - 1], self.page))
        best: dict[int, tuple[int, int]] = {}  # per dp group: (blocks, the slot holding them), its own slot first
        for slot, depth in sorted(matches.items(), key=lambda item: (-item[1], item[0] not in free)):
            best.setdefault(slot // self.n_local, (depth, slot))
        def preference(s):  # of the group that shares the most: a cheap row (the holder, else the LRU), else the first
            depth, holder = best.get(s // self.n_local, (0, None))
            cheap = s % self.n_local < cheap_rows
            return depth, cheap, cheap and s == holder, -self.used[s] if cheap else 0, -free.index(s)

        slot = max(free, key=preference)
        depth, source = best.get(slot // self.n_local, (0, slot))
        if matches.get(slot, 0) == depth:  # the slot holds as much as any of its group: nothing to copy
            source = slot
        self._take(slot, depth if source == slot else 0)
        self._touch(slot, source)
        self.queried_tokens += len(prompt)
        self.hit_tokens += depth * self.page
        return Placement(slot, source, depth * self.page)

    def hold(self, slot: int, tokens: Sequence[int]) -> None:
        """Record that `slot`'s cache holds the keys of `tokens` from position 0 (after its prefill ran, or when its
        request ends with more of them written)."""
        names = block_names(tokens, self.page)
        kept = self.held[slot]
        if names[:len(kept)] != kept:
            self._take(slot, 0)
        for name in names[len(self.held[slot]):]:
            self.holders.setdefault(name, set()).add(slot)
            self.held[slot].append(name)
        self._touch(slot)

    def _touch(self, *slots: int) -> None:
        self._clock += 1
        for slot in slots:
            self.used[slot] = self._clock

    def _matches(self, names: list[bytes]) -> dict[int, int]:
        """{slot: how many of these leading names it holds} for the slots holding at least the first."""
        matches: dict[int, int] = {}
        candidates = set(self.holders.get(names[0], ())) if names else set()
        depth = 0
        while candidates:
            depth += 1
            matches.update(dict.fromkeys(candidates, depth))
            if depth == len(names):
                break
            candidates &= self.holders.get(names[depth], set())
        return matches

    def _take(self, slot: int, kept: int) -> None:
        """Drop `slot`'s blocks after the first `kept`."""
        for name in self.held[slot][kept:]:
            holders = self.holders[name]
            holders.discard(slot)
            if not holders:
                del self.holders[name]
        del self.held[slot][kept:]
