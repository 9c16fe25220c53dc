"""A paged key/value cache's bookkeeping, on the host (as vLLM's block manager): which pages of the cache each
sequence holds, which are free, and which hold a cached prompt prefix another request can reuse. No device: the
engine (serve/engine.py) runs what it says and hands the device the page table (`table`); the tests check it
without compiling.

The cache holds `n_pages` pages of `page` tokens each, split over dp groups: each group has its own pool of pages,
numbered 0 .. pages_per_group - 1 within it, and a sequence lives in one group. A sequence's pages hold its tokens in
order: token t is at row t % page of its page t // page.

Prefix sharing: a full page whose tokens are written is named by `block_names` (a hash of the tokens from position 0
to the end of that page), so one name stands for the whole prefix up to there. A new request takes the pages of the
longest run of its leading names found in the pool (no copy: their reference count goes up), at most its prompt
minus one token (the last token is always computed: its logits choose the first new token). A page nobody references
any more stays cached while it is named, and is evicted least recently used when free pages run out: a sequence's
pages are cached from its last one to its first, so its tail goes before the prefix the tail depends on. A page is
never written while shared: a sequence writes only past its reused pages, and a named page is full.

Two sequences may write the same prefix into two pages (both admitted before either was named): the first one named
keeps the name, the other stays unnamed (private to its sequence, freed when it ends). No deduplication: swapping a
live sequence's page would change its table under steps already in flight, to save a page it frees anyway.
"""
from __future__ import annotations

import collections
import hashlib
import dataclasses
from collections.abc import Hashable, Sequence

import numpy as np



def block_names(tokens: Sequence[int], page: int = 16) -> list[bytes]:
    """The names of the full blocks of `page` tokens of `tokens`: block i's is a hash of its tokens and block i - 1's
    name, so a name stands for the whole prefix up to the end of its block (the slot engine's prefix cache,
    serve/prefix.py, names its blocks alike)."""
    names, name = [], b""
    ids = np.asarray(tokens, np.int64)
    for start in range(0, len(ids) - page + 1, page):
        name = hashlib.blake2b(name + ids[start:start + page].tobytes(), digest_size=16).digest()
        names.append(name)
    return names


def pages_for(tokens: int, page: int) -> int:
    """How many pages of `page` tokens hold `tokens` tokens (ceil division)."""
    return -(-tokens // page)


@dataclasses.dataclass(frozen=True)
class Allocation:
    """An admitted sequence's pages (all of them, in token order) and how many prompt tokens it reuses from cached
    pages (a multiple of the page size; the first reused // page pages): prefill writes the tokens after those."""
    pages: tuple[int, ...]
    reused: int


class PagePool:
    """The pages of one dp group: free list, reference counts and the prefix index of named pages.

    `free` holds unnamed unreferenced pages (taken first), `cached` the named unreferenced ones in least recently used
    order (evicted first); every other page is referenced by at least one live sequence (`refs`)."""

    def __init__(self, n_pages: int, page: int):
        if n_pages < 1 or page < 1:
            raise ValueError(f"a page pool needs at least one page of at least one token, got {n_pages} pages of "
                             f"{page} tokens")
        self.n_pages, self.page = n_pages, page
        self.free: collections.deque[int] = collections.deque(range(n_pages))
        self.cached: collections.OrderedDict[int, None] = collections.OrderedDict()  # oldest first
        self.refs = np.zeros(n_pages, np.int32)  # per page, the live sequences holding it
        self.name_of: dict[int, bytes] = {}
        self.page_of: dict[bytes, int] = {}
        self._pages: dict[Hashable, list[int]] = {}  # per live sequence, its pages in token order

    @property
    def pad_page(self) -> int:
        """The page id that pads table rows: out of range, so a device scatter with mode="drop" skips it."""
        return self.n_pages

    def available(self) -> int:
        """Pages that can be taken now: free ones and cached ones nobody references (evicted to be taken)."""
        return len(self.free) + len(self.cached)

    def pages_of(self, seq_id: Hashable) -> list[int]:
        """A live sequence's pages, in token order."""
        return list(self._seq(seq_id))

    def __contains__(self, seq_id: Hashable) -> bool:
        return seq_id in self._pages

    def match(self, tokens: Sequence[int]) -> list[int]:
        """The pages holding the longest cached run of leading full pages of a prompt, leaving its last token out."""
        return self._match(_reusable_names(tokens, self.page))

    def allocate(self, seq_id: Hashable, tokens: Sequence[int], reserve: int = 0) -> Allocation | None:
        """Admit a sequence with this prompt: share its cached prefix's pages and take new ones for the rest of the
        prompt and `reserve` more tokens. None, with nothing changed, when there are not enough pages."""
        return self._allocate(seq_id, tokens, reserve, _reusable_names(tokens, self.page))

    def grow(self, seq_id: Hashable, length: int) -> bool:
        """Make sure a sequence has pages for `length` tokens. False, with nothing changed, when not enough pages can
        be had (the caller preempts a sequence and tries again)."""
        pages = self._seq(seq_id)
        needed = pages_for(length, self.page) - len(pages)
        if needed > self.available():
            return False
        pages.extend(self._take() for _ in range(needed))
        return True

    def commit(self, seq_id: Hashable, tokens: Sequence[int]) -> None:
        """Record that a sequence's `tokens` (from position 0) are written: its full pages get their names, so later
        requests can share them. A name already held by another page stays there (see the module docstring)."""
        pages = self._seq(seq_id)
        names = block_names(tokens, self.page)
        if len(names) > len(pages):
            raise ValueError(f"sequence {seq_id!r} holds {len(pages)} pages of {self.page} tokens, too few for the "
                             f"{len(tokens)} tokens committed: grow it first")
        for page_id, name in zip(pages, names):
            named = self.name_of.get(page_id)
            if named is not None and named != name:
                raise ValueError(f"sequence {seq_id!r}'s page {page_id} holds other tokens than those committed: a "
                                 "sequence's tokens must only ever be extended")
            if named is None and name not in self.page_of:
                self.name_of[page_id], self.page_of[name] = name, page_id

    def release(self, seq_id: Hashable) -> None:
        """Drop a sequence's references (it ended or was preempted): named pages nobody references stay cached,
        unnamed ones are free again."""
        pages = self._seq(seq_id)
        del self._pages[seq_id]
        for page_id in reversed(pages):  # the tail first: older in the LRU order, so evicted before its prefix
            self.refs[page_id] -= 1
            if self.refs[page_id] == 0:
                if page_id in self.name_of:
                    self.cached[page_id] = None
                else:
                    self.free.append(page_id)

    def rename(self, seq_id: Hashable, new_id: Hashable) -> None:
        """A live sequence's pages, now under another id (a free one)."""
        if new_id in self._pages:
            raise ValueError(f"sequence {new_id!r} is live in this page pool: it cannot take {seq_id!r}'s pages")
        self._pages[new_id] = self._pages.pop(seq_id)

    def table(self, seq_ids: Sequence[Hashable], width: int) -> np.ndarray:
        """The page table of these sequences, int32 [len(seq_ids), width], padded with `pad_page`."""
        return page_table([self._seq(s) for s in seq_ids], width, self.pad_page)

    def _seq(self, seq_id: Hashable) -> list[int]:
        if seq_id not in self._pages:
            raise KeyError(f"no live sequence {seq_id!r} in this page pool")
        return self._pages[seq_id]

    def _match(self, names: list[bytes]) -> list[int]:
        matched = []
        for name in names:
            if name not in self.page_of:
                break
            matched.append(self.page_of[name])
        return matched

    def _fits(self, tokens: Sequence[int], reserve: int, matched: list[int], spare: int = 0) -> bool:
        """Whether new pages for the prompt past `matched` and `reserve` more tokens can be had, `spare` more left
        available after."""
        needed = pages_for(len(tokens) + reserve, self.page) - len(matched)
        reclaimed = sum(p in self.cached for p in matched)  # cached pages reused are not there to be evicted
        return needed + spare <= self.available() - reclaimed

    def _allocate(self, seq_id: Hashable, tokens: Sequence[int], reserve: int,
                  names: list[bytes]) -> Allocation | None:
        if seq_id in self._pages:
            raise ValueError(f"sequence {seq_id!r} is already live in this page pool: release it first")
        if not tokens or reserve < 0:
            raise ValueError(f"a sequence needs a prompt of at least one token and a reserve >= 0, got "
                             f"{len(tokens)} tokens and a reserve of {reserve}")
        matched = self._match(names)
        if not self._fits(tokens, reserve, matched):
            return None
        for page_id in matched:  # claimed before any eviction, so none of them is evicted
            self.cached.pop(page_id, None)
            self.refs[page_id] += 1
        pages = matched + [self._take() for _ in range(pages_for(len(tokens) + reserve, self.page) - len(matched))]
        self._pages[seq_id] = pages
        return Allocation(tuple(pages), len(matched) * self.page)

    def _take(self) -> int:
        """A page for a sequence to write: a free one, else the least recently used cached one (its name dropped)."""
        if self.free:
            page_id = self.free.popleft()
        else:
            page_id, _ = self.cached.popitem(last=False)
            del self.page_of[self.name_of.pop(page_id)]
        self.refs[page_id] = 1
        return page_id


class PagedCacheBook:
    """The pages of a cache of `n_pages` pages of `page` tokens over `n_groups` dp groups: one PagePool per group,
    and the group of each live sequence."""

    def __init__(self, n_pages: int, page: int, n_groups: int = 1):
        if n_groups < 1 or n_pages % n_groups:
            raise ValueError(f"{n_pages} cache pages cannot be split evenly over {n_groups} dp groups")
        self.page = page
        self.pools = [PagePool(n_pages // n_groups, page) for _ in range(n_groups)]
        self.group_of: dict[Hashable, int] = {}

    @property
    def pad_page(self) -> int:
        """The page id that pads table rows (pages_per_group: out of range in every group)."""
        return self.pools[0].pad_page

    def place(self, seq_id: Hashable, tokens: Sequence[int], reserve: int = 0) -> tuple[int, Allocation] | None:
        """Admit a sequence into a group: of those it fits in, the one holding its longest cached prefix, else the one
        with the most available pages (the lowest group on ties). None, with nothing changed, when none fits."""
        allocation = self.place_in(range(len(self.pools)), seq_id, tokens, reserve)
        return None if allocation is None else (self.group_of[seq_id], allocation)

    def place_in(self, groups: Sequence[int], seq_id: Hashable, tokens: Sequence[int], reserve: int = 0,
                 spare: int = 0) -> Allocation | None:
        """`place` among these groups only (those with a free slot, say): a callable returning the sequence's
        id in the group chosen may stand for `seq_id` (the slot is known once the group is); only in a group that
        keeps `spare` pages available after. Returns the allocation (the group is `group_of[seq_id]`), or None with
        nothing changed."""
        if not callable(seq_id) and seq_id in self.group_of:
            raise ValueError(f"sequence {seq_id!r} is already live in group {self.group_of[seq_id]}: release it first")
        names = _reusable_names(tokens, self.page)  # hashed once for every group
        fitting = [(len(pool._match(names)), pool.available(), -g) for g in groups
                   if (pool := self.pools[g])._fits(tokens, reserve, pool._match(names), spare)]
        if not fitting:
            return None
        group = -max(fitting)[2]
        seq_id = seq_id(group) if callable(seq_id) else seq_id
        allocation = self.pools[group]._allocate(seq_id, tokens, reserve, names)
        self.group_of[seq_id] = group
        return allocation

    def grow(self, seq_id: Hashable, length: int) -> bool:
        """Make sure a sequence has pages for `length` tokens (PagePool.grow)."""
        return self._pool(seq_id).grow(seq_id, length)

    def commit(self, seq_id: Hashable, tokens: Sequence[int]) -> None:
        """Name a sequence's written full pages (PagePool.commit)."""
        self._pool(seq_id).commit(seq_id, tokens)

    def release(self, seq_id: Hashable) -> None:
        """Drop a sequence's pages (PagePool.release) and forget its group."""
        self._pool(seq_id).release(seq_id)
        del self.group_of[seq_id]

    def rename(self, seq_id: Hashable, new_id: Hashable) -> None:
        """A live sequence's pages, now under another id in the same group (PagePool.rename)."""
        self._pool(seq_id).rename(seq_id, new_id)
        self.group_of[new_id] = self.group_of.pop(seq_id)

    def table(self, seq_ids: Sequence[Hashable | None], width: int) -> np.ndarray:
        """The page table of these sequences, int32 [len(seq_ids), width]: each row's ids are local to its group; a
        None row is padding (no pages)."""
        return page_table([[] if s is None else self._pool(s).pages_of(s) for s in seq_ids], width, self.pad_page)

    def available(self) -> int:
        """Pages that can be taken now, over every group."""
        return sum(pool.available() for pool in self.pools)

    def _pool(self, seq_id: Hashable) -> PagePool:
        if seq_id not in self.group_of:
            raise KeyError(f"no live sequence {seq_id!r} in this cache")
        return self.pools[self.group_of[seq_id]]


def page_table(rows: Sequence[Sequence[int]], width: int, pad_page: int) -> np.ndarray:
    """Page ids per row, int32 [len(rows), width], padded with `pad_page`."""
    table = np.full((len(rows), width), pad_page, np.int32)
    for r, pages in enumerate(rows):
        if len(pages) > width:
            raise ValueError(f"a sequence holds {len(pages)} pages, more than the table's width of {width}")
        table[r, :len(pages)] = pages
    return table


def _reusable_names(tokens: Sequence[int], page: int) -> list[bytes]:
    """The names of a prompt's full pages that may be reused: all but the last token's."""
    return block_names(tokens[:len(tokens) - 1], page)
