"""One request's completion as pure host logic: the tokens read back for it, what has been streamed, and the rules
that end it (stop tokens, stop strings, max_tokens). No device and no threads: the engine feeds it tokens.
"""
from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Collection, Sequence
from typing import Any

from mesh_transformer.infer.sampler import cut_at_stop, tokens_within


@dataclasses.dataclass(frozen=True)
class Event:
    """A piece of one completion: new text and the tokens behind it; the last event has a finish_reason or error."""
    text: str = ""
    tokens: tuple[int, ...] = ()
    logprobs: tuple[float, ...] = ()  # one per token, if the request asked for them
    finish_reason: str | None = None  # "stop" (EOS or a stop string) or "length" (max_tokens reached)
    error: str | None = None
    # per token, the most likely (token id, log-prob) at its position, best first, if the request asked for log-probs
    alternatives: tuple[tuple[tuple[int, float], ...], ...] = ()


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
    presence_penalty: float = 0.0  # OpenAI's penalties and logit bias ({token id: value}): `choose.adjusted`
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] = dataclasses.field(default_factory=dict)
    cancelled: threading.Event = dataclasses.field(default_factory=threading.Event)
    adapter: int = -1  # the served LoRA adapter's slot (serve/adapters.py), -1: the base alone
    adapter_key: int = 0  # what its prefix cache entries are named under: 0 for the base, else the adapter's load

    def cache_key(self, tokens: Sequence[int]) -> Sequence[int]:
        """`tokens` as the prefix caches name them: as they are for the base, shifted by the adapter's key (a
        multiple of 2^32, no token's id) for an adapter, so two adapters, or an adapter and the base, never share
        cached keys."""
        return tokens if not self.adapter_key else [t + (self.adapter_key << 32) for t in tokens]


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


@dataclasses.dataclass(eq=False)
class Completion:
    """A request's progress in its slot. `dispatched` counts the tokens asked of the device so far; `tokens` holds
    those read back. `accept` takes the next token read back and says what to send and whether the request ended.

    With a paged cache (engine.py) a completion can be preempted and resumed: its slot and pages are given up, and it
    is admitted again later with its `context` (prompt and tokens so far) prefilled, its tokens and what was sent
    kept. `reserved`: it holds the pages of its whole completion (never preempted); `admitted`: its admission's
    number, the latest admitted preempted first."""
    request: GenerationRequest
    tokens: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    alternatives: list[tuple[tuple[int, float], ...]] = dataclasses.field(default_factory=list)
    sent_chars: int = 0
    sent_tokens: int = 0
    dispatched: int = 0
    finished: bool = False
    reserved: bool = False
    admitted: int = 0
    # The text decoded so far, incrementally (`text`): that of tokens[:read]; tokens[prefix:read] decode to `head`.
    _text: str = ""
    _head: str = ""
    _prefix: int = 0
    _read: int = 0

    @property
    def context(self) -> list[int]:
        """What a prefill of this completion feeds: its prompt, and the tokens made before it was preempted."""
        return self.request.prompt + self.tokens

    @property
    def position(self) -> int:
        """Where the last dispatched token's key is written in the next decode step."""
        return len(self.request.prompt) + self.dispatched - 1

    @property
    def needs_step(self) -> bool:
        """Whether the next decode step must compute a token for this slot."""
        return self.dispatched < self.request.max_tokens and not self.request.cancelled.is_set()

    def accept(self, token: int, logprob: float, tokenizer: Any, stop_token_ids: Collection[int],
               alternatives: tuple[tuple[int, float], ...] = ()) -> list[Event]:
        """Take the next token read back (with its log-prob and the most likely tokens at its position): returns
        the events to send (the last one has a finish_reason when the request ended on a stop token, a stop string
        or max_tokens; `finished` is then set and later tokens are ignored)."""
        request = self.request
        if self.finished or request.cancelled.is_set():
            return []
        if token in stop_token_ids:
            return [self._finish("stop", tokenizer)]
        self.tokens.append(token)
        if request.logprobs:
            self.logprobs.append(logprob)
            self.alternatives.append(alternatives)
        events = []
        if request.stop or request.stream:
            text = self.text(tokenizer)
            cut_text, cut = cut_at_stop(text, request.stop)
            if cut:
                return [self._finish("stop", tokenizer, cut_text)]
            sendable = streamable_length(text, request.stop) if request.stream else 0
            if sendable > self.sent_chars:
                events.append(self._event(text[self.sent_chars:sendable], self.sent_tokens, len(self.tokens)))
                self.sent_chars, self.sent_tokens = sendable, len(self.tokens)
        if len(self.tokens) >= request.max_tokens:
            events.append(self._finish("length", tokenizer))
        return events

    def text(self, tokenizer: Any) -> str:
        """The text of the tokens so far, ending in '\ufffd' while a character's bytes are incomplete. Decoded
        incrementally, as streaming detokenizers do: each call decodes only the tokens after the last complete
        character and the few before them (whose text is subtracted, so a tokenizer that drops a leading space
        decodes the same), not the whole completion at every token."""
        head, whole = self._head, tokenizer.decode(self.tokens[self._prefix:])
        new = whole[len(head):] if whole.startswith(head) else None
        if new is None:  # a tokenizer whose text of a piece is not a prefix of more: decoded whole
            return tokenizer.decode(self.tokens)
        if new and not new.endswith("\ufffd"):
            self._text += new
            self._prefix, self._read = self._read, len(self.tokens)
            self._head = tokenizer.decode(self.tokens[self._prefix:self._read])
            return self._text
        return self._text + new

    def _finish(self, reason: str, tokenizer: Any, cut_text: str | None = None) -> Event:
        """The last event: what was not sent yet; after a stop string, only the tokens wholly before it."""
        self.finished = True
        text = tokenizer.decode(self.tokens) if cut_text is None else cut_text
        kept = len(self.tokens) if cut_text is None else tokens_within(tokenizer, self.tokens, len(text))
        return self._event(text[self.sent_chars:], min(self.sent_tokens, kept), kept, reason)

    def _event(self, text: str, start: int, end: int, reason: str | None = None) -> Event:
        """An event of tokens [start, end) with their log-probs and alternatives (if the request wants them)."""
        return Event(text, tuple(self.tokens[start:end]), tuple(self.logprobs[start:end]), reason,
                     alternatives=tuple(self.alternatives[start:end]))
