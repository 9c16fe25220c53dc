"""The serving engine on the chip with concurrent requests, in process (its HTTP routes: test_routes.py)."""
import dataclasses
import threading

import numpy as np
import pytest

from mesh_transformer.infer.params import make_inference_layout
from mesh_transformer.infer.sampler import Sampler
from mesh_transformer.parallel.mesh import make_dp_mp
from mesh_transformer.serve.completion import Event, GenerationRequest
from mesh_transformer.serve.engine import Engine
from mesh_transformer.tokenizer import load_tokenizer
from tests.device.model import CFG, trained_scale_params

F32 = dataclasses.replace(CFG, compute_dtype="float32")
RTOL_F32 = 1e-4


@pytest.fixture(scope="module")
def params():
    return trained_scale_params(CFG)


def prompts_with_shared_prefixes(n: int, seed: int = 0) -> list[list[int]]:
    """n prompts of 1 to 40 tokens (room for 24 new ones); every third starts with the same 24 tokens, so the prefix
    cache is used."""
    rng = np.random.default_rng(seed)
    shared = rng.integers(0, CFG.n_vocab, 24).tolist()
    prompts = []
    for i in range(n):
        tail = rng.integers(0, CFG.n_vocab, int(rng.integers(1, 17))).tolist()
        prompts.append(shared + tail if i % 3 == 0 else rng.integers(0, CFG.n_vocab, 1 + 7 * i % 40).tolist())
    return prompts


def serve_together(engine: Engine, prompts: list[list[int]], max_tokens: list[int]) -> list[list[Event]]:
    """Each request's events, all submitted at once (greedy, streamed, with log-probs)."""
    events: list[list[Event]] = [[] for _ in prompts]
    done = threading.Semaphore(0)

    def receiver(i: int):
        def on_event(event: Event) -> None:
            events[i].append(event)
            if event.finish_reason or event.error:
                done.release()
        return on_event

    engine.submit([GenerationRequest(p, n, receiver(i), temperature=0.0, stream=True)
                   for i, (p, n) in enumerate(zip(prompts, max_tokens))])
    for _ in prompts:
        assert done.acquire(timeout=600)
    return events


def test_concurrent_requests_on_the_chip_get_the_cpus_greedy_tokens(params, chip, host, highest_precision):
    """12 requests at once into 4 slots, some sharing a cached prefix: in f32, each gets the tokens the CPU's offline
    sampler makes, and their log-probs within 1e-4."""
    prompts = prompts_with_shared_prefixes(12)
    max_tokens = [4 + i % 13 for i in range(len(prompts))]
    engine = Engine(make_inference_layout(F32, mesh=make_dp_mp(1, 1, [chip])), params, load_tokenizer(),
                    max_batch=4, max_queue=len(prompts), stop_token_ids=())
    try:
        events = serve_together(engine, prompts, max_tokens)
        hit_tokens = engine.stats()["prefix_cache"]["hit_tokens"]
    finally:
        engine.close()
    expected = Sampler(make_inference_layout(F32, mesh=make_dp_mp(1, 1, [host])), params).generate(
        prompts, max(max_tokens), temperature=0.0, stop_token_ids=[], return_logprobs=True)
    assert hit_tokens > 0
    for request, result, n in zip(events, expected, max_tokens, strict=True):
        assert not [e.error for e in request if e.error] and request[-1].finish_reason == "length"
        assert [t for e in request for t in e.tokens] == result.tokens[:n]
        got, want = np.array([lp for e in request for lp in e.logprobs]), np.array(result.logprobs[:n])
        assert np.abs(got - want).max() <= RTOL_F32 * np.abs(want).max()


def test_the_chips_paged_engine_preempts_and_resumes_with_the_cpus_greedy_tokens(params, chip, host, highest_precision):
    """12 requests at once into 8 slots over a paged cache of 6 pages of 16 tokens (a request fills up to 4): the
    latest admitted are preempted as the others grow, and resumed; in f32 each gets the tokens the CPU's offline
    sampler makes, and their log-probs within 1e-4."""
    prompts = prompts_with_shared_prefixes(12, seed=2)
    max_tokens = [4 + i % 13 for i in range(len(prompts))]
    engine = Engine(make_inference_layout(F32, mesh=make_dp_mp(1, 1, [chip])), params, load_tokenizer(),
                    max_batch=8, max_queue=len(prompts), stop_token_ids=(), n_pages=6, page_size=16)
    try:
        events = serve_together(engine, prompts, max_tokens)
        stats = engine.stats()
    finally:
        engine.close()
    expected = Sampler(make_inference_layout(F32, mesh=make_dp_mp(1, 1, [host])), params).generate(
        prompts, max(max_tokens), temperature=0.0, stop_token_ids=[], return_logprobs=True)
    assert stats["requests"]["preempted"] > 0 and stats["pages"]["available"] == 6
    for request, result, n in zip(events, expected, max_tokens, strict=True):
        assert not [e.error for e in request if e.error] and request[-1].finish_reason == "length"
        assert [t for e in request for t in e.tokens] == result.tokens[:n]
        got, want = np.array([lp for e in request for lp in e.logprobs]), np.array(result.logprobs[:n])
        assert np.abs(got - want).max() <= RTOL_F32 * np.abs(want).max()


def test_the_chip_serves_concurrent_requests_in_its_own_dtype(params, chip):
    """In the chip's compute dtype ("auto": bf16), 16 requests at once into 8 slots all run to their lengths."""
    layout = make_inference_layout(CFG, mesh=make_dp_mp(1, 1, [chip]))
    prompts = prompts_with_shared_prefixes(16, seed=1)
    max_tokens = [8 + i % 17 for i in range(len(prompts))]
    engine = Engine(layout, params, load_tokenizer(), max_batch=8, max_queue=len(prompts), stop_token_ids=())
    try:
        events = serve_together(engine, prompts, max_tokens)
        completed = engine.counts["completed"]
    finally:
        engine.close()
    assert completed == len(prompts)
    for request, n in zip(events, max_tokens, strict=True):
        assert not [e.error for e in request if e.error] and request[-1].finish_reason == "length"
        tokens = [t for e in request for t in e.tokens]
        assert len(tokens) == n and all(0 <= t < CFG.n_vocab for t in tokens)
