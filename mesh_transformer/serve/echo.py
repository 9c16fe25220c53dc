"""Echoed prompts and log-probs of the completion routes: an echoed prompt's scores come from one forward over it,
run on the engine thread between decode steps (a completion's come from the decode steps that made its tokens),
through the request's LoRA adapter where it names one."""
from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

from mesh_transformer.infer.score import Scorer, TokenScores, score_sequences
from mesh_transformer.serve.adapters import AdapterSlots
from mesh_transformer.serve.api import ApiError, CompletionParams
from mesh_transformer.serve.completion import Event
from mesh_transformer.serve.engine import Engine, EngineStopped


class Scoring:
    """Log-probs and top alternatives of echoed prompts, from one forward over each prompt, run on the engine thread
    between decode steps (a completion's come from the decode steps that made its tokens)."""

    def __init__(self, engine: Engine, scorer: Scorer, adapters: AdapterSlots | None = None):
        self.engine, self.scorer, self.adapters = engine, scorer, adapters

    async def __call__(self, sequences: list[list[int]], top_k: int, model: str | None = None) -> list[TokenScores]:
        slot = self.adapters.acquire(model)[0] if self.adapters else -1

        def score() -> list[TokenScores]:
            self.scorer.params = self.engine.params  # as they are now: adapters come and go
            return score_sequences(self.scorer, sequences, top_k, adapter=slot)

        try:
            future = self.engine.call(score)
            return await asyncio.wrap_future(future)
        except EngineStopped as e:
            raise ApiError(503, str(e), type="server_error") from None
        finally:
            if self.adapters:
                self.adapters.release(slot)

    def wanted(self, params: CompletionParams) -> bool:
        return params.logprobs is not None and params.echo


def scored(event: Event, prompt: list[int], prompt_scores: TokenScores | None, echo: bool,
            k: int | None) -> tuple[Event, list | None]:
    """The event with the prompt in front when echoing (with the prompt's scores, its log-probs and alternatives;
    the first token's null), and the k alternatives of each token (k > 0), the completion's from its decode steps."""
    alternatives = [list(top[:k]) for top in event.alternatives] if k else None
    if echo and prompt_scores is not None:
        event = dataclasses.replace(event, logprobs=(None, *prompt_scores.logprobs, *event.logprobs))
        if k:
            alternatives = [None, *prompt_scores.alternatives, *alternatives]
    if echo:
        event = dataclasses.replace(event, tokens=(*prompt, *event.tokens))
    return event, alternatives


async def echoed(scoring: Scoring, params: CompletionParams, tokenizer: Any,
                  events: list[Event]) -> list[tuple[Event, list | None]]:
    """Whole choices with the prompt echoed and log-probs re-scored as the request asks."""
    prompts = [list(p) for p in params.prompts for _ in range(params.n)]
    scores = [None] * len(events)
    if scoring.wanted(params):
        scores = await scoring(prompts, params.logprobs, params.model)
    out = []
    for prompt, event, score in zip(prompts, events, scores):
        text = tokenizer.decode(prompt) + event.text if params.echo else event.text
        out.append(scored(dataclasses.replace(event, text=text), prompt, score, params.echo, params.logprobs))
    return out
