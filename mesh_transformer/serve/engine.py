"""Continuous-batching generation engine: one background thread owns the device; requests join between decode steps.

The engine holds N slots of a shared KV cache (slot_decoding.py). New requests are prefilled together, up to 16 in
one program (rows padded to 1, 4 or 16, prompt length bucketed, so compiles are reused), into free slots between
two decode steps and join the next step; each step advances every busy slot by one token, sampled with that
request's own temperature, top-k, top-p and seed. EOS, max_tokens and stop strings (checked here on the decoded
text) end a request; streamed text leaves as it is made.

The host runs one step ahead of the device: each step's input tokens stay on the device, so the engine dispatches
step k + 1 before it reads step k's tokens, and its own work (dispatch, text, streaming) overlaps the device's. A
request that ends on a stop token or string so costs one step of its slot that is thrown away.
"""
from __future__ import annotations

import collections
import dataclasses
import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from mesh_transformer.model import gptj
from mesh_transformer.infer import decode as slot_decoding
from mesh_transformer.config import Config
from mesh_transformer.parallel.mesh import DP
from mesh_transformer.infer.sampler import _tokens_within, place_params, bucket, check_sampling, cut_at_stop
from mesh_transformer.tokenizer import EOS_ID

log = logging.getLogger(__name__)

MIN_SPAN = 32  # the shortest stretch of the cache a decode step reads: one block of it
MAX_PREFILL_ROWS = 16  # requests prefilled together at most; fewer are padded to 1, 4 or 16 rows


def _prefill_rows(n: int) -> int:
    """The rows a prefill of n requests is padded to: a power of 4, so few programs cover every count."""
    rows = 1
    while rows < n:
        rows *= 4
    return min(rows, MAX_PREFILL_ROWS)
SPAN_BUCKETS = 4  # by default a step reads 1, 2, 4 or 8 blocks of seq/8: compiles stay few on a long context


class QueueFull(RuntimeError):
    """The waiting queue is full; the caller should retry later."""


class EngineStopped(RuntimeError):
    """The engine has stopped (shut down, or its device loop failed) and takes no more requests."""


@dataclasses.dataclass(frozen=True)
class Event:
    """A piece of one completion: new text and the tokens behind it; the last event has a finish_reason or error."""
    text: str = ""
    tokens: tuple[int, ...] = ()
    logprobs: tuple[float, ...] = ()  # one per token, if the request asked for them
    finish_reason: str | None = None  # "stop" (EOS or a stop string) or "length" (max_tokens reached)
    error: str | None = None


@dataclasses.dataclass(eq=False)
class GenerationRequest:
    """One completion to make. Events go to `on_event`, called on the engine thread, so it must not block long.

    Without `stream` there is one event, at the end; with it, text leaves as it is made, holding back what could be
    the start of a stop string or an incomplete UTF-8 character. Without `logprobs` the events carry none (a step
    in which no request wants them skips a pass over the vocabulary).
    """
    prompt: list[int]
    max_tokens: int
    on_event: Callable[[Event], None]
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    stop: tuple[str, ...] = ()
    stream: bool = False
    logprobs: bool = True
    cancelled: threading.Event = dataclasses.field(default_factory=threading.Event)


@dataclasses.dataclass(eq=False)
class _Slot:
    request: GenerationRequest
    tokens: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    sent_chars: int = 0
    sent_tokens: int = 0
    dispatched: int = 0  # tokens asked of the device so far; `tokens` holds those already read back

    @property
    def position(self) -> int:
        """Where the last dispatched token's key is written in the next decode step."""
        return len(self.request.prompt) + self.dispatched - 1

    @property
    def needs_step(self) -> bool:
        """Whether the next decode step must compute a token for this slot."""
        return self.dispatched < self.request.max_tokens and not self.request.cancelled.is_set()


@dataclasses.dataclass
class _Step:
    """A dispatched program whose tokens are not read yet: entries are (slot index, slot, output row)."""
    tokens: jax.Array
    logprobs: jax.Array
    entries: list[tuple[int, _Slot, int]]


# ------------------------------------------------------------------------------------------------------ host text
def streamable_length(text: str, stop: Sequence[str]) -> int:
    """How much of a completion's text can be sent now: all but a trailing incomplete UTF-8 character ('\ufffd')
    and any tail that could be the start of a stop string."""
    end = len(text.rstrip("\ufffd"))
    held = 0
    for s in stop:
        for k in range(min(len(s) - 1, end), held, -1):
            if text.endswith(s[:k], 0, end):
                held = k
                break
    return end - held


def _sampling_rows(n: int, placed: list[tuple[int, GenerationRequest]]) -> tuple[np.ndarray, ...]:
    """Temperature, top_k, top_p, seed and whether log-probs are wanted [n], each request's at its row; other rows
    are greedy, without log-probs."""
    temperature, top_k, top_p = np.zeros(n, np.float32), np.zeros(n, np.int32), np.ones(n, np.float32)
    seed, logprobs = np.zeros(n, np.uint32), np.zeros(n, bool)
    for row, request in placed:
        temperature[row], top_k[row], top_p[row] = request.temperature, request.top_k, request.top_p
        seed[row], logprobs[row] = request.seed % 2 ** 32, request.logprobs
    return temperature, top_k, top_p, seed, logprobs


# ---------------------------------------------------------------------------------------------------------- engine
class Engine:
    """Owns the device loop in a background thread: a bounded queue of waiting requests feeding N slots.

    N is max_batch rounded up to a multiple of the mesh's dp. `submit` fails at once with QueueFull when the queue
    holds max_queue requests. Cancelled requests leave the queue at once and free their slot at the next step.
    A decode step computes only the slots up to the highest busy one (a power of two per dp group) and reads only
    the cache blocks (of `min_span` positions) up to the furthest busy one (a power of two of them), so a lone
    request does not pay for N slots and a long context; each (rows, blocks) pair is one compiled program. With
    `warm_up`, the constructor compiles every program first, so no request waits for a compile.
    """

    def __init__(self, cfg: Config, mesh: Mesh, params: dict, tokenizer: Any, *, max_batch: int = 8,
                 max_queue: int = 64, stop_token_ids: Sequence[int] = (EOS_ID,), min_span: int | None = None,
                 warm_up: bool = False):
        if max_batch < 1 or max_queue < 1:
            raise ValueError(f"max_batch and max_queue must be at least 1, got {max_batch} and {max_queue}")
        self.cfg, self.tokenizer, self.max_queue = cfg, tokenizer, max_queue
        self.min_span = min_span or max(MIN_SPAN, cfg.seq >> (SPAN_BUCKETS - 1))
        self.stop_token_ids = frozenset(stop_token_ids)
        dp = mesh.shape[DP]
        self.n_slots = -(-max_batch // dp) * dp
        self._n_local = self.n_slots // dp
        dtype = gptj.DTYPES[cfg.compute_dtype]
        self._params = place_params(params, cfg, mesh)
        self._programs = slot_decoding.programs(cfg, mesh)
        self._block_sizes = slot_decoding.block_sizes(cfg.seq, min(self.min_span, cfg.seq))
        zeros = jax.jit(lambda: [[jnp.zeros((self.n_slots, cfg.n_heads, cfg.head_dim, size), dtype)
                                  for size in self._block_sizes] for _ in range(cfg.layers)],
                        out_shardings=NamedSharding(mesh, slot_decoding.CACHE_SPEC))
        self._k_cache, self._v_cache = zeros(), zeros()
        # Each slot's last token, the next decode step's input: made and kept on the device.
        self._last_tokens = jax.device_put(np.zeros(self.n_slots, np.int32), NamedSharding(mesh, P(DP)))
        self._slots: list[_Slot | None] = [None] * self.n_slots
        self._waiting: collections.deque[GenerationRequest] = collections.deque()
        self._cond = threading.Condition()
        self._stopping = False
        self.error: str | None = None
        self.counts = {"completed": 0, "cancelled": 0}
        if warm_up:
            self._warm_up()
        self._thread = threading.Thread(target=self._run, name="serving-engine", daemon=True)
        self._thread.start()

    # -------------------------------------------------------------------------------------------- public, any thread
    def submit(self, requests: Sequence[GenerationRequest]) -> None:
        """Queue requests, all or none: raises QueueFull when they do not fit, EngineStopped after a stop, and
        ValueError for a request that cannot run (checked here, so that no request can stop the device loop)."""
        for request in requests:
            self._check(request)
        with self._cond:
            if self._stopping or self.error:
                raise EngineStopped(self.error or "the engine is shutting down")
            if len(self._waiting) + len(requests) > self.max_queue:
                raise QueueFull(f"the queue is full ({self.max_queue} requests waiting)")
            self._waiting.extend(requests)
            self._cond.notify()

    def _check(self, request: GenerationRequest) -> None:
        seq, vocab = self.cfg.seq, self.cfg.n_vocab
        if not request.prompt or any(not 0 <= t < vocab for t in request.prompt):
            raise ValueError(f"a prompt must be 1 or more token ids in [0, {vocab})")
        if request.max_tokens < 1 or len(request.prompt) + request.max_tokens > seq:
            raise ValueError(f"prompt ({len(request.prompt)} tokens) + max_tokens ({request.max_tokens}) must fit "
                             f"the context of {seq} tokens, with max_tokens at least 1")
        check_sampling([request.temperature], [request.top_k], [request.top_p])

    def cancel(self, requests: Sequence[GenerationRequest]) -> None:
        """Stop generating for these requests (e.g. the client went away); no further events are sent."""
        with self._cond:
            for request in requests:
                if not request.cancelled.is_set():
                    request.cancelled.set()
                    if request in self._waiting:
                        self._waiting.remove(request)
                        self.counts["cancelled"] += 1

    def stats(self) -> dict:
        """Slots, queue and request counts, for health checks."""
        with self._cond:
            busy = sum(slot is not None for slot in self._slots)
            return {"slots": {"total": self.n_slots, "busy": busy, "free": self.n_slots - busy},
                    "queue": {"waiting": len(self._waiting), "max": self.max_queue}, "requests": dict(self.counts)}

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop the device loop; requests still waiting or running get an error event."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        self._thread.join(timeout_s)

    # ------------------------------------------------------------------------------------------------ engine thread
    def _run(self) -> None:
        in_flight: collections.deque[_Step] = collections.deque()
        try:
            while True:
                with self._cond:
                    while not (self._stopping or self._waiting or any(self._slots) or in_flight):
                        self._cond.wait()
                    if self._stopping:
                        break
                    admitted = self._take_admissions()
                for start in range(0, len(admitted), MAX_PREFILL_ROWS):
                    in_flight.append(self._prefill(admitted[start:start + MAX_PREFILL_ROWS]))
                self._drop_cancelled()
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

    def _take_admissions(self) -> list[tuple[int, GenerationRequest]]:
        """Pop waiting requests into free slots, lowest local row first so decode steps compute fewer rows."""
        free = sorted((i for i, slot in enumerate(self._slots) if slot is None),
                      key=lambda i: (i % self._n_local, i // self._n_local))
        admitted = []
        while free and self._waiting:
            request = self._waiting.popleft()
            slot = free.pop(0)
            self._slots[slot] = _Slot(request)  # reserved now, so stats count it busy
            admitted.append((slot, request))
        return admitted

    def _warm_up(self) -> None:
        """Run every program once (each prompt bucket x prefill rows, each rows x blocks) on the empty cache,
        compiling them all."""
        seq = self.cfg.seq
        widths = sorted({bucket(n, maximum=seq) for n in range(1, seq)})
        prefill_rows = sorted({_prefill_rows(n) for n in range(1, min(self.n_slots, MAX_PREFILL_ROWS) + 1)})
        rows = sorted({bucket(n, minimum=1, maximum=self._n_local) for n in range(1, self._n_local + 1)})
        n_blocks = len(self._block_sizes)
        block_counts = sorted({bucket(n, minimum=1, maximum=n_blocks) for n in range(1, n_blocks + 1)})
        log.info("compiling %d prefill and %d decode programs", len(widths) * len(prefill_rows),
                 len(rows) * len(block_counts))
        for width in widths:
            for n in prefill_rows:
                self._run_prefill(np.zeros((n, width), np.int32), *(np.zeros(n, dtype) for dtype in (
                    np.int32, np.int32, np.float32, np.int32, np.float32, np.uint32, bool)))
        for n in rows:
            for count in block_counts:
                self._run_decode(*(np.zeros(self.n_slots, dtype) for dtype in (np.int32, np.float32, np.int32,
                                   np.float32, np.uint32, np.int32, bool)), rows=n, n_blocks=count)
        jax.block_until_ready(self._last_tokens)

    def _run_prefill(self, ids_RxT: np.ndarray, *rows: np.ndarray) -> tuple[jax.Array, jax.Array]:
        """Dispatch a prefill of R prompts; `rows` are length, slot, temperature, top_k, top_p, seed and whether
        log-probs are wanted, one value per prompt. Returns the first tokens and log-probs [R], still on the
        device."""
        tokens, logprobs, self._last_tokens, self._k_cache, self._v_cache = self._programs.prefill(
            self._params, self._k_cache, self._v_cache, self._last_tokens, ids_RxT, *rows)
        return tokens, logprobs

    def _run_decode(self, *slots: np.ndarray, rows: int, n_blocks: int) -> tuple[jax.Array, jax.Array]:
        """Dispatch a decode step; `slots` are position, temperature, top_k, top_p, seed, token index and whether
        log-probs are wanted, per slot."""
        tokens, logprobs, self._last_tokens, self._k_cache, self._v_cache = self._programs.decode(
            self._params, self._k_cache, self._v_cache, self._last_tokens, *slots, rows=rows, n_blocks=n_blocks)
        return tokens, logprobs

    def _prefill(self, admitted: list[tuple[int, GenerationRequest]]) -> _Step:
        """Prefill up to MAX_PREFILL_ROWS admitted requests in one program, padded to a bucket of rows."""
        n = _prefill_rows(len(admitted))
        ids_RxT = np.zeros((n, bucket(max(len(r.prompt) for _, r in admitted), maximum=self.cfg.seq)), np.int32)
        length, slot = np.ones(n, np.int32), np.full(n, -1, np.int32)  # padding rows: written nowhere
        for row, (i, request) in enumerate(admitted):
            ids_RxT[row, :len(request.prompt)] = request.prompt
            length[row], slot[row] = len(request.prompt), i
            self._slots[i].dispatched = 1
        temperature, top_k, top_p, seed, logprobs = _sampling_rows(n, [(row, r) for row, (_, r) in enumerate(admitted)])
        tokens, chosen = self._run_prefill(ids_RxT, length, slot, temperature, top_k, top_p, seed, logprobs)
        return _Step(tokens, chosen, [(i, self._slots[i], row) for row, (i, _) in enumerate(admitted)])

    def _decode_step(self) -> _Step | None:
        """Dispatch one token for every slot that needs one, or None if none does."""
        live = [i for i, slot in enumerate(self._slots) if slot is not None and slot.needs_step]
        if not live:
            return None
        rows = bucket(max(i % self._n_local for i in live) + 1, minimum=1, maximum=self._n_local)
        furthest = max(self._slots[i].position for i in live)
        n_blocks = bucket(furthest // self._block_sizes[0] + 1, minimum=1, maximum=len(self._block_sizes))
        position, index = np.zeros(self.n_slots, np.int32), np.zeros(self.n_slots, np.int32)
        temperature, top_k, top_p, seed, logprobs = _sampling_rows(self.n_slots,
                                                                   [(i, self._slots[i].request) for i in live])
        for i in live:
            slot = self._slots[i]
            position[i], index[i] = slot.position, slot.dispatched
            slot.dispatched += 1
        tokens, chosen = self._run_decode(position, temperature, top_k, top_p, seed, index, logprobs, rows=rows,
                                          n_blocks=n_blocks)
        # Outputs hold `rows` entries per dp group.
        return _Step(tokens, chosen, [(i, self._slots[i], (i // self._n_local) * rows + i % self._n_local)
                                        for i in live])

    def _read_back(self, step: _Step) -> None:
        """Take a step's tokens, for the slots that still hold the requests they were made for."""
        tokens, logprobs = np.asarray(step.tokens), np.asarray(step.logprobs)
        for i, slot, row in step.entries:
            if self._slots[i] is slot:
                self._accept(i, int(tokens[row]), float(logprobs[row]))

    def _accept(self, i: int, token: int, logprob: float) -> None:
        """Take a slot's new token: end the request on EOS, a stop string or max_tokens; stream new text."""
        slot = self._slots[i]
        request = slot.request
        if request.cancelled.is_set():
            return
        if token in self.stop_token_ids:
            return self._finish(i, "stop")
        slot.tokens.append(token)
        if request.logprobs:
            slot.logprobs.append(logprob)
        if request.stop or request.stream:
            text = self.tokenizer.decode(slot.tokens)
            cut_text, cut = cut_at_stop(text, request.stop)
            if cut:
                return self._finish(i, "stop", cut_text)
            sendable = streamable_length(text, request.stop) if request.stream else 0
            if sendable > slot.sent_chars:
                self._emit(request, Event(text[slot.sent_chars:sendable], tuple(slot.tokens[slot.sent_tokens:]),
                                          tuple(slot.logprobs[slot.sent_tokens:])))
                slot.sent_chars, slot.sent_tokens = sendable, len(slot.tokens)
        if len(slot.tokens) >= request.max_tokens:
            self._finish(i, "length")

    def _finish(self, i: int, reason: str, cut_text: str | None = None) -> None:
        slot = self._slots[i]
        text = self.tokenizer.decode(slot.tokens) if cut_text is None else cut_text
        # After a stop string, keep only the tokens whose text lies wholly before it.
        kept = len(slot.tokens) if cut_text is None else _tokens_within(self.tokenizer, slot.tokens, len(text))
        sent = min(slot.sent_tokens, kept)
        event = Event(text[slot.sent_chars:], tuple(slot.tokens[sent:kept]), tuple(slot.logprobs[sent:kept]), reason)
        with self._cond:
            self._slots[i] = None
            self.counts["completed"] += 1
        self._emit(slot.request, event)

    def _drop_cancelled(self) -> None:
        with self._cond:
            for i, slot in enumerate(self._slots):
                if slot is not None and slot.request.cancelled.is_set():
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
            requests = [slot.request for slot in self._slots if slot is not None] + list(self._waiting)
            self._slots = [None] * self.n_slots
            self._waiting.clear()
        for request in requests:
            if not request.cancelled.is_set():
                self._emit(request, Event(error=message))
