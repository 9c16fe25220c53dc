"""Admission to the serving engine: whether a request can ever run there (checked when it is submitted), which free
slot each waiting request takes between two decode steps, and the prefill rows that write it in. Host work only,
no device: the engine (engine.py) calls these under its lock and dispatches what they return.

With a slot cache a request takes the free slot the prefix cache (prefix.py) places it in, by its prompt's longest
cached prefix, else the first in the schedule's admission order (lowest local row first, so decode steps compute
fewer rows). With a paged cache (infer/pages.py) it takes a free slot of a dp group with pages for its prompt, first
come first served (until a group has them, it and the requests after it wait in the queue), and gets more pages as
it makes tokens (`make_room`): when its group has none left, the group's latest admitted request is preempted (its
pages given up, its prompt and tokens so far computed again when it is admitted again, before any new request), as
vLLM does. A request with penalties (whose token counts a prefill would restart), or any with `reserve`, holds the
pages of its prompt and max_tokens from admission and is never preempted; so is one that was preempted while alone
in its group's growing requests (it could not grow beside the reserved ones). Where requests that ended leave a
group's busy slots above the fewest rows that hold them, the highest move down to the free slots (`compaction`, as
vLLM condenses its batch), so decode steps compute no more rows than they need.
"""
from __future__ import annotations

import collections
from collections.abc import Callable, Iterator, Sequence

import numpy as np

from mesh_transformer import config
from mesh_transformer.config import Config
from mesh_transformer.infer.pages import PagedCacheBook, pages_for
from mesh_transformer.infer.sizes import fit, prompt_problem
from mesh_transformer.serve.completion import Completion, GenerationRequest
from mesh_transformer.serve.prefix import Placement, PrefixIndex
from mesh_transformer.serve.schedule import Schedule

SPARE_SHARE = 0.01  # of a group's pages, kept available when a request is admitted without all its pages (vLLM's
# watermark): one made at once would otherwise be the first preempted


def check_request(request: GenerationRequest, cfg: Config, book: PagedCacheBook | None) -> None:
    """Raise ValueError for a request that cannot run: a prompt out of the vocabulary, a prompt and max_tokens past
    the context, sampling values out of range, or (with a paged cache `book`) more pages than a dp group has."""
    seq, vocab = cfg.seq, cfg.n_vocab
    if problem := prompt_problem(request.prompt, vocab):
        raise ValueError(f"prompt {problem}")
    if request.max_tokens < 1 or len(request.prompt) + request.max_tokens > seq:
        raise ValueError(f"prompt ({len(request.prompt)} tokens) + max_tokens ({request.max_tokens}) must fit "
                         f"the context of {seq} tokens, with max_tokens at least 1")
    config.check_sampling([request.temperature], [request.top_k], [request.top_p])
    if book:
        needed, held = pages_for(len(request.prompt) + request.max_tokens, book.page), book.pools[0]
        if needed > held.n_pages:
            raise ValueError(f"prompt ({len(request.prompt)} tokens) + max_tokens ({request.max_tokens}) need "
                             f"{needed} cache pages of {book.page} tokens; the cache has {held.n_pages}"
                             f" per dp group")


def admit_to_slots(waiting: collections.deque[GenerationRequest], slots: list[Completion | None], free: list[int],
                   schedule: Schedule, prefix: PrefixIndex | None) -> dict[int, Placement]:
    """Pop waiting requests into the `free` slots (in admission order) of a slot cache, each slot given its
    request's Completion: where the prefix cache says, else the first free. Returns {slot: its placement}."""
    admitted, pinned = {}, set()
    while free and waiting:
        prompt = waiting[0].cache_key(waiting[0].prompt)
        if prefix:
            busy = [i for i, slot in enumerate(slots) if slot is not None]  # admissions so far included
            placement = prefix.place(prompt, free, pinned, schedule.cheap_rows(busy))
        else:
            placement = Placement(free[0], free[0], 0)
        if placement is None:  # the free slots left are copied from in this round
            break
        free.remove(placement.slot)
        pinned.add(placement.source)
        slots[placement.slot] = Completion(waiting.popleft())  # reserved now: the engine's stats count it busy
        admitted[placement.slot] = placement
    if prefix:  # once placed, their prompts' blocks are held (the programs writing them run first)
        for slot in admitted:
            prefix.hold(slot, slots[slot].request.cache_key(slots[slot].request.prompt))
    return admitted


def admit_to_pages(waiting: collections.deque[GenerationRequest], resumed: collections.deque[Completion],
                   slots: list[Completion | None], free: list[int], n_local: int, book: PagedCacheBook,
                   numbers: Iterator[int], reserve: bool = False) -> dict[int, Placement]:
    """Pop preempted completions (`resumed`, first) and then waiting requests into the `free` slots (in admission
    order) of a paged cache whose dp group (of n_local slots) has pages for their context (the module docstring;
    with `reserve`, or penalties, for their max_tokens too), first come first served: the group holding the longest
    cached prefix, else the one with the most pages free, the group's first free slot; each numbered by the next of
    `numbers` (`Completion.admitted`, increasing). Returns {slot: its placement}."""
    admitted = {}

    def first_free(group: int) -> int:
        return next(slot for slot in free if slot // n_local == group)

    while free and (resumed or waiting):
        completion = resumed[0] if resumed else Completion(waiting[0])
        request = completion.request
        context, remaining = request.cache_key(completion.context), request.max_tokens - len(completion.tokens)
        # a prefill restarts a slot's token counts: a request they penalize is never preempted
        completion.reserved = bool(completion.reserved or reserve or request.presence_penalty
                                   or request.frequency_penalty)
        spare = 0
        if not completion.reserved:
            whole = pages_for(len(context) + remaining, book.page) - pages_for(len(context), book.page)
            spare = min(whole, int(SPARE_SHARE * book.pools[0].n_pages))
        groups = sorted({slot // n_local for slot in free})
        # Without prefix reuse the engine names no page (`_paged_prefill`, `_release_pages`), so none matches.
        # pages for its context and the key its first decode step writes (all it will write, where reserved)
        more = remaining if completion.reserved else min(1, remaining - 1)
        allocation = book.place_in(groups, first_free, context, more, spare)
        if allocation is None:  # it waits for pages; so do the requests after it (first come, first served)
            break
        (resumed if resumed else waiting).popleft()
        slot = next(s for s in free if s in book.group_of)  # the free slot just given pages
        free.remove(slot)
        completion.admitted = next(numbers)
        slots[slot] = completion
        admitted[slot] = Placement(slot, slot, allocation.reused)
    return admitted


def make_room(slots: list[Completion | None], live: Sequence[int], n_local: int, book: PagedCacheBook,
              preempt: Callable[[int], None]) -> list[int]:
    """Pages for the key each live slot writes in the next decode step (at its position), the earliest admitted
    first; where its group has too few, its latest admitted live slot without all its pages is preempted
    (`preempt(slot)` gives up its pages and slot) until it has, the slot itself last (marked `reserved` for its return
    where it was alone). (A slot whose last token is in flight frees its pages as it is read.) Returns the slots
    preempted."""
    preempted = []
    for i in sorted(live, key=lambda i: slots[i].admitted):
        while slots[i] is not None and not book.grow(i, slots[i].position + 1):
            group = range(i // n_local * n_local, (i // n_local + 1) * n_local)
            growing = [j for j in group if slots[j] is not None and not slots[j].reserved
                       and (slots[j].needs_step or j == i)]
            victim = max(growing, key=lambda j: slots[j].admitted)  # i grows: it is not reserved
            slots[i].reserved = victim == i and len(growing) == 1
            preempt(victim)
            preempted.append(victim)
    return preempted


def compaction(slots: Sequence[Completion | None], n_local: int, rows: Sequence[int]) -> dict[int, int]:
    """Moves {busy slot: free slot} that put each dp group's busy slots (of n_local) below the fewest of the `rows`
    (ascending: the decode steps' row counts) that hold them: where some are at or above that count, each of those
    moves to the lowest free slot below it. A group whose busy slots are already there moves none."""
    moves = {}
    for base in range(0, len(slots), n_local):
        busy = [i for i in range(base, base + n_local) if slots[i] is not None]
        if not busy:
            continue
        end = base + fit(len(busy), list(rows))
        free = [i for i in range(base, end) if slots[i] is None]
        moves.update(zip([i for i in busy if i >= end], free))
    return moves


def penalized(request: GenerationRequest) -> bool:
    """Whether a request has penalties or a logit bias."""
    return bool(request.presence_penalty or request.frequency_penalty or request.logit_bias)


def prefill_rows(slots: Sequence[Completion | None], rows_per_group: int, width: int, batch: list[tuple[int, int]],
                 placements: dict[int, Placement], n_local: int, dp: int,
                 ends: dict[int, int] | None = None) -> tuple[np.ndarray, ...]:
    """A prefill's input rows for a batch of admitted slots, (slot, row) each: ids [R, width] (each context after
    what it reuses, up to its end in `ends` where it has one), lengths, slots, starts and source slots [R] (slots
    local to their dp group of n_local; a padding row's -1, written nowhere)."""
    n = rows_per_group * dp
    ids_RxT = np.zeros((n, width), np.int32)
    length, local_slot = np.ones(n, np.int32), np.full(n, -1, np.int32)
    start, source = np.zeros(n, np.int32), np.full(n, -1, np.int32)
    for slot, row in batch:
        placement = placements.get(slot, Placement(slot, slot, 0))
        tail = slots[slot].context[placement.reused:(ends or {}).get(slot)]
        ids_RxT[row, :len(tail)], length[row], local_slot[row] = tail, len(tail), slot % n_local
        start[row], source[row] = placement.reused, placement.source % n_local
    return ids_RxT, length, local_slot, start, source
