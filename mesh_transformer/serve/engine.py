"""Continuous-batching generation engine: one background thread owns the device; requests join between decode steps.

The engine holds N slots of a shared KV cache and runs the decode programs (infer/decode.py); each slot's request
progress is a Completion (completion.py), which program runs when is its Schedule's (schedule.py), which request
takes which slot is admission.py's, and the list of programs it compiles ahead is warmup.py's. New requests are
prefilled together (up to 16 per dp group in one program) into free slots between two decode steps and join the next
step; each step advances every busy slot by one token, sampled with that request's own temperature, top-k, top-p and
seed. EOS, max_tokens and stop strings (checked here on the decoded text) end a request; streamed text leaves as it
is made.

The host runs one step ahead of the device: each step's input tokens stay on the device, so the engine dispatches
step k + 1 before it reads step k's tokens, and its own work (dispatch, text, streaming) overlaps the device's. A
request that ends on a stop token or string so costs one step of its slot that is thrown away.
"""
from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import itertools
import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from mesh_transformer.infer import adapter_slots
from mesh_transformer.infer.choose import Logprobs, fill_sampling
from mesh_transformer.infer.decode import Steps, default_block
from mesh_transformer.infer.pages import PagedCacheBook, pages_for
from mesh_transformer.infer.params import place_params
from mesh_transformer.infer.programs import Programs
from mesh_transformer.infer.score import MAX_TOP
from mesh_transformer.parallel.layout import Layout
from mesh_transformer.parallel.mesh import DP
from mesh_transformer.serve import warmup
from mesh_transformer.serve.admission import (admit_to_pages, admit_to_slots, check_request, compaction, make_room,
                                              prefill_rows)
from mesh_transformer.serve.completion import Completion, Event, GenerationRequest
from mesh_transformer.serve.prefix import Placement, PrefixIndex
from mesh_transformer.serve.schedule import check_pages, engine_schedule
from mesh_transformer.serve.warmup import Program, paged_programs, slot_programs
from mesh_transformer.tokenizer import eos_ids

log = logging.getLogger(__name__)
PREEMPTIONS_LOGGED = 50  # a warning at the first preemption, and each this many after

class QueueFull(RuntimeError):
    """The waiting queue is full; the caller should retry later."""


class EngineStopped(RuntimeError):
    """The engine has stopped (shut down, or its device loop failed) and takes no more requests."""


@dataclasses.dataclass
class _Step:
    """A dispatched program whose tokens are not read yet: entries are (slot index, slot, output row)."""
    tokens: jax.Array
    logprobs: Logprobs
    entries: list[tuple[int, Completion, int]]


# ---------------------------------------------------------------------------------------------------------- engine
class Engine:
    """Owns the device loop in a background thread: a bounded queue of waiting requests feeding N slots.

    N is max_batch rounded up to a multiple of the mesh's dp. `submit` fails at once with QueueFull when the queue
    holds max_queue requests. Cancelled requests leave the queue at once and free their slot at the next step.
    A decode step computes only the slots up to the highest busy one (padded to 1, 4, 16, 32, 64, ..., or all of
    a dp group's: `Schedule.decode_rows`) and reads only the cache blocks (of `min_span` positions) up to the
    furthest busy one (a power of two of them), so a lone request does not pay for N slots and a long context;
    each (rows, blocks) pair is one compiled program. With `warm_up`, the constructor compiles every program first
    (ahead of time: none is run), so no request waits for a compile (`warmed` is set once all are). With
    `prefix_cache`, a request reuses the cached keys of its longest prompt prefix held by a slot (serve/prefix.py)
    and computes only the rest.

    With `n_pages`, the cache is paged (infer/paged.py): n_pages pages of `page_size` positions, shared by the slots
    of each dp group, so a slot costs only the pages its request fills. A request is admitted when a slot is free
    and its group has pages for its prompt (infer/pages.py; it waits in the queue until then, never fails), takes
    a page more each `page_size` tokens it makes, and reuses the cached pages of its prompt's longest prefix
    (`prefix_cache`). Where a group has no page left for a step, its latest admitted request is preempted: its pages
    given back (those it wrote cached, with `prefix_cache`), its prompt and tokens so far prefilled again when it is
    admitted again, before any new request, its text streamed on where it left off (admission.py). With
    `reserve_pages`, each request holds the pages of its prompt and max_tokens from admission and none is preempted
    (as requests with penalties always are). A step reads the pages up to the furthest busy slot's position (a power
    of two of them, as blocks above); busy slots left above the fewest rows that hold them move down (`_compact`).
    """

    def __init__(self, layout: Layout, params: dict, tokenizer: Any, *, max_batch: int = 8, max_queue: int = 64,
                 stop_token_ids: Sequence[int] | None = None, min_span: int | None = None, warm_up: bool = False,
                 programs: Programs | None = None, prefix_cache: bool = True, n_pages: int | None = None,
                 page_size: int = 16, reserve_pages: bool = False):
        if max_batch < 1 or max_queue < 1:
            raise ValueError(f"max_batch and max_queue must be at least 1, got {max_batch} and {max_queue}")
        self.layout, self.cfg, self.tokenizer, self.max_queue = layout, layout.cfg, tokenizer, max_queue
        cfg = self.cfg
        self.min_span = min_span or default_block(cfg.seq)
        self.stop_token_ids = frozenset(eos_ids(tokenizer) if stop_token_ids is None else stop_token_ids)
        self._dp = layout.mesh.shape[DP]
        if n_pages is not None:
            check_pages(n_pages, page_size, self._dp)
        self.params = adapter_slots.with_slots(place_params(params, layout), layout)
        self._served = warmup.serves_adapters(self.params)  # LoRA adapters' slots beside the base (adapters.py)
        self._slot_writer = adapter_slots.SlotWriter(layout) if self._served else None
        self._programs = programs or Programs(layout)
        self._book = PagedCacheBook(n_pages, page_size, self._dp) if n_pages else None
        self._reserve = reserve_pages
        self.schedule = engine_schedule(max_batch, self._dp, cfg.seq, page_size if n_pages else None, self.min_span)
        self.n_slots = self.schedule.n_slots
        if self._book:
            self._cache = self._programs.new_pages(n_pages, page_size)
        else:
            self._cache = self._programs.new_cache(self.n_slots, list(self.schedule.block_sizes))
        # Each slot's last token (the next decode step's input), token counts and logit bias, kept on the device.
        self._slot_state = self._programs.new_slots(self.n_slots)
        self._slots: list[Completion | None] = [None] * self.n_slots
        self._prefix = PrefixIndex(self.n_slots, self.schedule.n_local) if prefix_cache and not n_pages else None
        self._reuse_pages = bool(n_pages and prefix_cache)
        self._table_width = pages_for(cfg.seq, page_size)
        self._waiting: collections.deque[GenerationRequest] = collections.deque()
        self._resumed: collections.deque[Completion] = collections.deque()  # preempted, by admission
        self._admissions = itertools.count(1)  # admissions' numbers, in order (`Completion.admitted`)
        self._calls: collections.deque[tuple[Callable[[], Any], concurrent.futures.Future]] = collections.deque()
        self._in_flight: collections.deque[_Step] = collections.deque()  # dispatched, not read back (engine thread)
        self._cond = threading.Condition()
        self._stopping = False
        self.error: str | None = None
        self.counts = {"completed": 0, "cancelled": 0, "preempted": 0}
        self._page_counts = [0, 0]  # paged: prompt tokens asked of the prefix cache, and found there
        self.warmed = warmup.start(self._programs, self.programs() if warm_up else [])  # set: all compiled
        self._thread = threading.Thread(target=self._run, name="serving-engine", daemon=True)
        self._thread.start()

    # -------------------------------------------------------------------------------------------- public, any thread
    def submit(self, requests: Sequence[GenerationRequest]) -> None:
        """Queue requests, all or none: raises QueueFull when they do not fit, EngineStopped after a stop, and
        ValueError for a request that cannot run (checked here, so that no request can stop the device loop)."""
        for request in requests:
            check_request(request, self.cfg, self._book)
        with self._cond:
            if self._stopping or self.error:
                raise EngineStopped(self.error or "the engine is shutting down")
            if len(self._waiting) + len(requests) > self.max_queue:
                raise QueueFull(f"the queue is full ({self.max_queue} requests waiting)")
            self._waiting.extend(requests)
            self._cond.notify()

    def call(self, fn: Callable[[], Any]) -> concurrent.futures.Future:
        """Run `fn` on the engine thread between two decode steps (other programs on the same devices, such as
        scoring, so that one thread dispatches to them); its result or exception comes in the future."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._cond:
            if self._stopping or self.error:
                raise EngineStopped(self.error or "the engine is shutting down")
            self._calls.append((fn, future))
            self._cond.notify()
        return future

    def write_adapter(self, slot: int, adapters: dict | None, scale: float = 0.0) -> concurrent.futures.Future:
        """Write a LoRA adapter ({target: {"a", "b"}} stacked, f32, checked against the base) into served slot `slot`,
        or clear it (`adapters` None), on the engine thread between two steps; no program recompiles. The caller
        (serve/adapters.py) gives a slot no request runs."""
        if not self._served:
            raise ValueError("this engine serves no LoRA adapters (max_loras 0)")

        def write() -> None:
            writer = self._slot_writer
            self.params = (writer.clear(self.params, slot) if adapters is None
                           else writer.write(self.params, slot, adapters, scale))
            jax.block_until_ready(self.params["layers"][-1]["lora"])
        return self.call(write)

    def cancel(self, requests: Sequence[GenerationRequest]) -> None:
        """Stop generating for these requests (e.g. the client went away); no further events are sent."""
        with self._cond:
            for request in requests:
                if not request.cancelled.is_set():
                    request.cancelled.set()
                    if request in self._waiting:
                        self._waiting.remove(request)
                        self.counts["cancelled"] += 1
                    for completion in [c for c in self._resumed if c.request is request]:
                        self._resumed.remove(completion)
                        self.counts["cancelled"] += 1

    def stats(self) -> dict:
        """Slots, queue and request counts, for health checks."""
        with self._cond:
            busy = sum(slot is not None for slot in self._slots)
            prefix = self._prefix
            stats = {"slots": {"total": self.n_slots, "busy": busy, "free": self.n_slots - busy},
                     "queue": {"waiting": len(self._waiting) + len(self._resumed), "max": self.max_queue},
                     "requests": dict(self.counts),
                     "prefix_cache": {"enabled": prefix is not None or self._reuse_pages,
                                      "queried_tokens": prefix.queried_tokens if prefix else self._page_counts[0],
                                      "hit_tokens": prefix.hit_tokens if prefix else self._page_counts[1]}}
            if self._book:
                stats["pages"] = {"total": sum(pool.n_pages for pool in self._book.pools),
                                  "available": self._book.available(), "page_size": self._book.page}
            return stats

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop the device loop; requests still waiting or running get an error event. The KV cache and the slots'
        state are given back to the devices once the loop has stopped (another engine can take their memory)."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        self._thread.join(timeout_s)
        if not self._thread.is_alive():
            self._cache = self._slot_state = None

    # ------------------------------------------------------------------------------------------------ engine thread
    def _run(self) -> None:
        in_flight = self._in_flight
        try:
            while True:
                with self._cond:
                    while not (self._stopping or self._waiting or self._resumed or any(self._slots) or in_flight
                               or self._calls):
                        self._cond.wait()
                    if self._stopping:
                        break
                    admitted = self._take_admissions()
                    calls, self._calls = list(self._calls), collections.deque()
                for fn, future in calls:
                    _run_call(fn, future)
                in_flight.extend(self._prefills(admitted))
                self._drop_cancelled()
                self._compact()
                step = self._decode_step()
                if step is not None:
                    in_flight.append(step)
                # Read back all but the step just dispatched, which the device runs meanwhile.
                while len(in_flight) > (step is not None):
                    self._read_back(in_flight.popleft())
            self._fail_all("the server is shutting down")
        except Exception as e:  # a device or program failure: answer everyone, refuse new work
            log.exception("serving engine failed")
            with self._cond:
                self.error = f"the generation engine failed: {type(e).__name__}: {e}"
            self._fail_all(self.error)

    def _take_admissions(self) -> dict[int, Placement]:
        """Pop waiting requests into free slots (admission.py): where the prefix cache says, else lowest local row
        first; with a paged cache, after pages for the next step's keys of the requests that run (preempting the
        latest admitted if need be: `make_room`), preempted ones first, in a dp group with pages for them, and none
        in a round that preempted (vLLM's rule: it would be the next preempted). Returns {slot: its placement}."""
        if self._book:
            live = [i for i, slot in enumerate(self._slots) if slot is not None and slot.needs_step]
            if make_room(self._slots, live, self.schedule.n_local, self._book, self._preempt):
                return {}
        free = self.schedule.admission_order([i for i, slot in enumerate(self._slots) if slot is None])
        if not self._book:
            return admit_to_slots(self._waiting, self._slots, free, self.schedule, self._prefix)
        admitted = admit_to_pages(self._waiting, self._resumed, self._slots, free, self.schedule.n_local, self._book,
                                  self._admissions, self._reserve)
        for slot, placement in admitted.items():
            self._page_counts[0] += len(self._slots[slot].context) if self._reuse_pages else 0
            self._page_counts[1] += placement.reused
        return admitted

    def _prefills(self, admitted: dict[int, Placement]) -> list[_Step]:
        """Dispatch the admitted requests' prefills: of whole prompts, and of the rest after a cached prefix (with
        a paged cache, after the pieces of a long prompt too, a row each: `_prefill_pieces`)."""
        if self.schedule.chunk:
            admitted = self._prefill_pieces(admitted)
        fresh = {slot: len(self._slots[slot].context) for slot, p in admitted.items() if not p.reused}
        tails = {slot: len(self._slots[slot].context) - p.reused for slot, p in admitted.items() if p.reused}
        return ([self._prefill(rows, width, batch) for rows, width, batch in self.schedule.prefill_batches(fresh)]
                + [self._prefill(rows, width, batch, admitted)
                   for rows, width, batch in self.schedule.prefill_batches(tails, single=bool(self._book))])

    def _prefill_pieces(self, admitted: dict[int, Placement]) -> dict[int, Placement]:
        """Dispatch the leading pieces of the prompts longer than the schedule's chunk (after their reused pages),
        one chunk a row in each program, their first tokens never read; returns the placements of what is left,
        which the caller prefills as the rest after a prefix."""
        chunk, starts = self.schedule.chunk, {slot: p.reused for slot, p in admitted.items()}
        while pieces := {slot: chunk for slot, start in starts.items()
                         if len(self._slots[slot].context) - start > chunk}:
            for rows, width, batch in self.schedule.prefill_batches(pieces, single=True):
                placements = {slot: Placement(slot, slot, starts[slot]) for slot, _ in batch}
                self._prefill(rows, width, batch, placements, ends={slot: starts[slot] + chunk for slot, _ in batch})
            for slot in pieces:
                starts[slot] += chunk
        return {slot: Placement(p.slot, p.source, starts[slot]) for slot, p in admitted.items()}

    def programs(self) -> list[Program]:
        """Every program the engine can run, as (name, arguments, static arguments) for `Programs.compile`
        (warmup.py): each prompt bucket x its prefill row counts (whole prompts, and after a cached prefix), each
        decode row count x block count."""
        state = (self.params, self._cache, self._slot_state)
        if self._book:
            return paged_programs(state, self.schedule, self._table_width, self._book.pad_page, self._reuse_pages)
        return slot_programs(state, self.schedule, extend=self._prefix is not None)

    def _run_decode(self, steps: Steps, rows: int, n_blocks: int, live: list[int]) -> tuple[jax.Array, Logprobs]:
        """Dispatch a decode step of the first `rows` slots of each dp group, reading `n_blocks` cache blocks, or
        pages of the `live` slots' tables (the others' padding) with a paged cache."""
        if self._book:
            stepping = set(live)
            table = self._book.table([i if i in stepping else None for i in range(self.n_slots)], self._table_width)
            out = self._programs.paged_decode(self.params, self._cache, self._slot_state, steps, table, rows=rows,
                                              n_read=n_blocks, top=MAX_TOP)
        else:
            out = self._programs.decode(self.params, self._cache, self._slot_state, steps, rows=rows,
                                        n_blocks=n_blocks, top=MAX_TOP)
        tokens, logprobs, self._slot_state, _, self._cache = out
        return tokens, logprobs

    def _prefill(self, rows_per_group: int, width: int, batch: list[tuple[int, int]],
                 placements: dict[int, Placement] | None = None, ends: dict[int, int] | None = None) -> _Step:
        """Dispatch the prefill of one batch of admitted requests, (slot, input row) each, in one program of prompts
        padded to `width`; with `placements`, of the rest of each prompt after its cached prefix (up to `ends`: a
        piece, whose first token nobody reads). The first tokens and their log-probs stay on the device."""
        ids_RxT, length, local_slot, start, source = prefill_rows(self._slots, rows_per_group, width, batch,
                                                                  placements or {}, self.schedule.n_local, self._dp,
                                                                  ends or {})
        index = np.zeros(len(length), np.int32)  # each row's token's index in its completion (its sampling key's)
        for slot, row in batch:
            completion = self._slots[slot]
            index[row] = len(completion.tokens)  # 0, but for a preempted completion's return
            completion.dispatched = index[row] + 1  # the prefill asks for its next token
        sampling = fill_sampling(len(length), [(row, self._slots[slot].request) for slot, row in batch], bias=True,
                                 adapters=self._served)
        state = (self.params, self._cache, self._slot_state)
        if self._book:
            out = self._paged_prefill(state, batch, ids_RxT, start, length, local_slot, sampling, index,
                                      named=not ends)
        elif placements is None:
            out = self._programs.prefill(*state, ids_RxT, length, local_slot, sampling, top=MAX_TOP)
        else:
            out = self._programs.extend(*state, ids_RxT, start, length, local_slot, source, sampling, top=MAX_TOP)
        tokens, chosen, self._slot_state, self._cache = out
        return _Step(tokens, chosen, [(slot, self._slots[slot], row) for slot, row in batch])

    def _paged_prefill(self, state: tuple, batch: list[tuple[int, int]], ids_RxT, start, length, local_slot,
                       sampling, index, named: bool) -> tuple:
        """`_prefill` on the paged cache: each row's tokens from its start (after its reused pages) written
        through its page table, the whole table read where some row reuses pages (masked to them: one program per
        prompt shape, however long the prefix, as the slot cache's extend); then, where `named` (its last piece),
        its prompt's full pages are named for later requests to share (the device runs programs in order, so they
        see them written)."""
        rows = [None] * len(length)
        for slot, row in batch:
            rows[row] = slot
        table = self._book.table(rows, self._table_width)
        n_read = self._table_width if start.any() else 0
        out = self._programs.paged_prefill(*state, ids_RxT, start, length, table, local_slot, sampling, index,
                                           n_read=n_read, top=MAX_TOP)
        if self._reuse_pages and named:
            for slot, _ in batch:
                completion = self._slots[slot]
                self._book.commit(slot, completion.request.cache_key(completion.context))
        return out

    def _compact(self) -> None:
        """Paged: move the busy slots above the fewest rows that hold them down to free ones (`compaction`): their
        page tables, their device rows (after what runs before, the device running programs in order) and the
        tokens of theirs in flight."""
        moves = compaction(self._slots, self.schedule.n_local, self.schedule.decode_rows) if self._book else {}
        if not moves:
            return
        n_local = self.schedule.n_local
        source = np.tile(np.arange(n_local, dtype=np.int32), self._dp)
        for src, dst in moves.items():
            source[dst] = src % n_local
            self._book.rename(src, dst)
        self._slot_state = self._programs.move_slots(self._slot_state, source)
        with self._cond:
            for src, dst in moves.items():
                self._slots[dst], self._slots[src] = self._slots[src], None
        for step in self._in_flight:
            step.entries = [(moves.get(i, i), completion, row) for i, completion, row in step.entries]

    def _decode_step(self) -> _Step | None:
        """Dispatch one token for every slot that needs one, or None if none does."""
        live = [i for i, slot in enumerate(self._slots) if slot is not None and slot.needs_step]
        if not live:
            return None
        rows, n_blocks, out_rows = self.schedule.decode({i: self._slots[i].position for i in live})
        # A row the step computes but takes no token of (a free slot, or one whose last token is in flight) writes
        # nowhere: position -1 (outside every block), a padding table row: at 0 it would overwrite the first key of
        # a prompt cached there for reuse.
        position, index = np.full(self.n_slots, -1, np.int32), np.zeros(self.n_slots, np.int32)
        sampling = fill_sampling(self.n_slots, [(i, self._slots[i].request) for i in live], adapters=self._served)
        for i in live:
            slot = self._slots[i]
            position[i], index[i] = slot.position, slot.dispatched
            slot.dispatched += 1
        tokens, chosen = self._run_decode(Steps(position, index, sampling), rows, n_blocks, live)
        return _Step(tokens, chosen, [(i, self._slots[i], out_rows[i]) for i in live])

    def _read_back(self, step: _Step) -> None:
        """Take a step's tokens, for the slots that still hold the requests they were made for."""
        tokens = np.asarray(step.tokens)
        # Log-probs are read only when a request wants them: each array read back is a wait on the device.
        wanted = any(completion.request.logprobs for _, completion, _ in step.entries)
        logprobs = jax.device_get(step.logprobs) if wanted else None
        for i, completion, row in step.entries:
            if self._slots[i] is not completion:
                continue
            chosen, top = 0.0, ()
            if logprobs is not None and completion.request.logprobs:
                chosen = float(logprobs.chosen[row])
                top = tuple(zip(logprobs.top_ids[row].tolist(), logprobs.top[row].tolist()))
            for event in completion.accept(int(tokens[row]), chosen, self.tokenizer, self.stop_token_ids, top):
                if event.finish_reason is not None:
                    written = completion.request.cache_key(completion.request.prompt + completion.tokens[:-1])
                    if self._prefix:  # its slot holds the keys of every token fed to it
                        self._prefix.hold(i, written)
                    self._release_pages(i, written)
                    with self._cond:
                        self._slots[i] = None
                        self.counts["completed"] += 1
                self._emit(completion.request, event)

    def _release_pages(self, slot: int, written: list[int] | None = None) -> None:
        """A paged slot's pages given back, its `written` tokens' full pages named first (kept cached for reuse)."""
        if self._book and slot in self._book.group_of:
            if written is not None and self._reuse_pages:
                self._book.commit(slot, written)
            self._book.release(slot)

    def _preempt(self, slot: int) -> None:
        """Give up a paged slot's pages (those its context filled named first: cached for its return) and its slot;
        its completion waits to be admitted again, in admission order. A step in flight still writes its pages
        (before any later program, the device running them in order), and its token for it is not read."""
        completion = self._slots[slot]
        self._release_pages(slot, completion.request.cache_key(completion.context))
        with self._cond:
            self._slots[slot] = None
            self._resumed.append(completion)
            self._resumed = collections.deque(sorted(self._resumed, key=lambda c: c.admitted))
            self.counts["preempted"] += 1
            total = self.counts["preempted"]
        if total % PREEMPTIONS_LOGGED == 1:  # as vLLM warns
            log.warning("a request was preempted for want of KV-cache pages (%d so far); more pages (--kv-pages, "
                        "--memory-fraction), --kv-cache-dtype int8 or a smaller --max-batch would avoid it", total)

    def _drop_cancelled(self) -> None:
        with self._cond:
            for i, slot in enumerate(self._slots):
                if slot is not None and slot.request.cancelled.is_set():
                    self._release_pages(i)
                    self._slots[i] = None
                    self.counts["cancelled"] += 1

    def _emit(self, request: GenerationRequest, event: Event) -> None:
        try:
            request.on_event(event)
        except Exception:  # a receiver that is gone (e.g. its event loop closed) must not stop the engine
            log.warning("dropping a request whose receiver failed", exc_info=True)
            request.cancelled.set()

    def _fail_all(self, message: str) -> None:
        with self._cond:
            requests = ([slot.request for slot in self._slots if slot is not None]
                        + [c.request for c in self._resumed] + list(self._waiting))
            for i, slot in enumerate(self._slots):
                if slot is not None:
                    self._release_pages(i)
            self._slots = [None] * self.n_slots
            self._waiting.clear()
            self._resumed.clear()
            calls, self._calls = list(self._calls), collections.deque()
        for _, future in calls:
            future.set_exception(EngineStopped(message))
        for request in requests:
            if not request.cancelled.is_set():
                self._emit(request, Event(error=message))


def _run_call(fn: Callable[[], Any], future: concurrent.futures.Future) -> None:
    """A `call`'s function, its result or exception delivered to the caller (it must not stop the engine)."""
    if not future.set_running_or_notify_cancel():
        return
    try:
        future.set_result(fn())
    except Exception as e:
        future.set_exception(e)
