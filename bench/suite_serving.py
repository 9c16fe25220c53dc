"""The device suite's serving sections (`bench/device_suite.py`): the engine over the slot cache against one request
at a time, the engine over a paged cache at several levels of concurrent requests, and what a traced pass of it shows.
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import sys
import tempfile
import threading
import time

import jax
import numpy as np

from bench.common import device_op_times, figure
from bench.suite_parts import (HEADROOM, REQUEST_TIMEOUT_S, SERVING_GOAL_SPEEDUP, Sizes, decode_bytes,
                               random_decode_params, slots_that_fit)
from mesh_transformer.aot import shard_bytes
from mesh_transformer.flags import AUTO, MEMORY_FRACTION
from mesh_transformer.infer.pages import pages_for
from mesh_transformer.infer.programs import Programs
from mesh_transformer.model import gptj
from mesh_transformer.parallel.layout import Layout
from mesh_transformer.serve import sizing
from mesh_transformer.serve.completion import Event, GenerationRequest
from mesh_transformer.serve.engine import Engine


class _CharPerToken:
    """A stand-in tokenizer, one character per token: every token streams at once and no BPE runs on the host, so
    the figures are the engine's and the device's."""

    def decode(self, tokens) -> str:
        return "x" * len(tokens)


def _run_together(engine: Engine, prompts: list[list[int]], new_tokens: int, adapters: list[int] | None = None,
                  observe=None) -> tuple[float, list[float], int]:
    """Submit all prompts at once (greedy, streamed; prompt i through served adapter slot adapters[i] where given)
    and wait for them: (wall seconds, time to first token of each, tokens made). `observe`: called with each event
    too (on the engine's thread)."""
    n = len(prompts)
    first_s: list[float | None] = [None] * n
    made, done, errors = [0] * n, [threading.Event() for _ in range(n)], []

    def receiver(i: int):
        def on_event(event: Event) -> None:
            if event.tokens and first_s[i] is None:
                first_s[i] = time.perf_counter() - start_s
            made[i] += len(event.tokens)
            if observe is not None:
                observe(event)
            if event.error:
                errors.append(event.error)
            if event.error or event.finish_reason:
                done[i].set()
        return on_event

    slots = adapters or [-1] * n
    requests = [GenerationRequest(prompt, new_tokens, receiver(i), temperature=0.0, stream=True, logprobs=False,
                                  adapter=slots[i], adapter_key=slots[i] + 1)
                for i, prompt in enumerate(prompts)]
    start_s = time.perf_counter()
    engine.submit(requests)
    for event in done:
        if not event.wait(REQUEST_TIMEOUT_S):
            raise TimeoutError(f"a request took over {REQUEST_TIMEOUT_S} s")
    if errors:
        raise RuntimeError(errors[0])
    return time.perf_counter() - start_s, first_s, sum(made)


def _serving_record(mode: str, runs: list[tuple[float, list[float], int]], new_tokens: int) -> dict:
    wall_s = sum(run[0] for run in runs)
    ttft_s = [t for run in runs for t in run[1]]
    tokens = sum(run[2] for run in runs)
    return {"bench": "serving", "mode": mode, "requests": len(ttft_s), "new_tokens": new_tokens, "tokens": tokens,
            "wall_s": figure(wall_s), "tokens_per_s": figure(tokens / wall_s),
            "ttft_p50_s": figure(float(np.percentile(ttft_s, 50))),
            "ttft_p95_s": figure(float(np.percentile(ttft_s, 95)))}


def serving_records(layout: Layout, sizes: Sizes) -> list[dict]:
    """The engine (sizes.serving_slots slots, random weights, no prefix cache: every prompt is new) with
    sizes.serving_clients requests submitted together (those beyond the slots wait in its queue), against requests
    one at a time. A warm pass of each kind first compiles the programs the timed ones use, and only those (one
    cache block: one decode program per row count; the engine's own warm-up would compile every one)."""
    cfg = layout.cfg
    engine = Engine(layout, random_decode_params(layout), _CharPerToken(), max_batch=sizes.serving_slots,
                    max_queue=2 * sizes.serving_clients, stop_token_ids=(), min_span=cfg.seq, prefix_cache=False)
    rng = np.random.default_rng(0)
    prompts = rng.integers(0, cfg.n_vocab, (sizes.serving_clients, sizes.serving_prompt_len)).tolist()
    new_tokens = sizes.serving_new_tokens
    try:
        _run_together(engine, prompts, 2)
        _run_together(engine, prompts[:1], 2)
        together = _serving_record("concurrent", [_run_together(engine, prompts, new_tokens)], new_tokens)
        alone = _serving_record("one_at_a_time", [_run_together(engine, [p], new_tokens)
                                                  for p in prompts[:sizes.serving_one_at_a_time]], new_tokens)
    finally:
        engine.close()
    precision = gptj.precision(cfg)
    for record in (together, alone):
        record.update(clients=sizes.serving_clients, slots=engine.n_slots, prompt_len=sizes.serving_prompt_len,
                      seq=cfg.seq, layers=cfg.layers, d_model=cfg.d_model, dtype=precision.compute.name,
                      weight_dtype=precision.weights.name, int8_dot=layout.policy.int8_dot)
    speedup = together["tokens_per_s"] / alone["tokens_per_s"]
    return [together, alone, {"bench": "serving_speedup", "concurrent_over_one_at_a_time": figure(speedup),
                              "goal": SERVING_GOAL_SPEEDUP, "met": speedup >= SERVING_GOAL_SPEEDUP}]


PAGE = 16  # tokens per page of the paged serving section
PAGED_GOAL_RATIO = 6  # requests that fit at once over the slot cache's slots of a whole context, in the same memory
FULL_CONTEXT = 2048  # GPT-J's context: what a slot of the slot cache holds whatever a request uses


def paged_capacity(layout: Layout, sizes: Sizes, page: int, bytes_limit: int) -> dict:
    """How many requests of the section's prompt + new tokens the paged cache holds in HEADROOM of `bytes_limit`
    beside the params and WORKSPACE_BYTES (`decode_bytes`' plan), against the slots of FULL_CONTEXT positions the
    slot cache holds there (in the compute dtype): from the arrays' bytes. A TPU pads the kernel layout's scales
    besides (`aot_check.py --inference-only` counts what its compiler allocates)."""
    plan = HEADROOM * bytes_limit
    per_request = -(-(sizes.serving_prompt_len + sizes.serving_new_tokens) // page)
    page_bytes = shard_bytes(Programs(layout).abstract_pages(1, page))
    requests = max(0, int((plan - decode_bytes(layout, 0)["total"]) // (page_bytes * per_request)))
    whole = dataclasses.replace(layout, cfg=dataclasses.replace(layout.cfg, seq=FULL_CONTEXT, kv_cache_dtype="compute"))
    slots = slots_that_fit(whole, plan)
    ratio = requests / max(1, slots)
    return {"bench": "serving_paged_capacity", "bytes_limit": bytes_limit, "page_bytes": page_bytes,
            "pages_per_request": per_request, "requests_that_fit": requests, "slots_of_full_context": slots,
            "full_context": FULL_CONTEXT, "ratio": figure(ratio), "goal": PAGED_GOAL_RATIO,
            "met": ratio >= PAGED_GOAL_RATIO}


PAGE_POLICIES = ("grow", "reserve")  # serving_paged's engines: pages taken as tokens are made, the latest admitted
# preempted where they run out (the default); or all of a request's pages from its admission (--kv-reserve)


def serving_paged_records(layout: Layout, sizes: Sizes, page: int = PAGE, bytes_limit: int = 16 * 2 ** 30,
                          memory_fraction: float = MEMORY_FRACTION, profile_steps: int = 0,
                          policies: tuple[str, ...] = PAGE_POLICIES) -> list[dict]:
    """The engine over a paged cache (the layout's kv_cache_dtype) with serving_clients slots and the pages
    device_serve.py would take with `memory_fraction` (serve/sizing.py: what fits the device, a context per slot
    where it reports no memory), its prefix cache on as device_serve.py's (new prompts each pass: nothing shared but
    what a preempted request left), under each of the page `policies` in turn (PAGE_POLICIES; one set of programs):
    requests submitted together at each of sizes.paged_levels (those beyond the slots or the pages wait for them), a
    warm pass first at each; with `profile_steps`, a pass more of the first policy at the last
    level traced for about that many decode steps once under way (`_profiled_pass`); and how many requests fit the
    device against the slot cache's slots (`paged_capacity`)."""
    cfg, programs = layout.cfg, Programs(layout)
    # The pages device_serve.py takes with --kv-pages auto and this --memory-fraction, with its programs.
    n_pages = sizing.for_server(programs, max_batch=sizes.serving_clients, n_pages=AUTO, page_size=page,
                                prefix_cache=True, memory_fraction=memory_fraction).n_pages
    params = random_decode_params(layout)
    precision = gptj.precision(cfg)
    described = dict(pages=n_pages, memory_fraction=memory_fraction, page_size=page, prefix_cache=True,
                     prompt_len=sizes.serving_prompt_len,
                     seq=cfg.seq, family=cfg.family, kv_heads=cfg.kv_heads, layers=cfg.layers, d_model=cfg.d_model,
                     dtype=precision.compute.name,
                     weight_dtype=precision.weights.name, kv_cache_dtype=cfg.kv_cache_dtype,
                     paged_attention=layout.policy.paged_attention, int8_dot=layout.policy.int8_dot)
    rng = np.random.default_rng(0)
    levels = [n for n in sizes.paged_levels if n <= 2 * sizes.serving_clients]
    new_tokens, records = sizes.serving_new_tokens, []

    def prompts(n: int) -> list[list[int]]:
        return rng.integers(0, cfg.n_vocab, (n, sizes.serving_prompt_len)).tolist()

    for policy in policies:
        engine = Engine(layout, params, _CharPerToken(), max_batch=sizes.serving_clients,
                        max_queue=4 * sizes.serving_clients, stop_token_ids=(), prefix_cache=True, n_pages=n_pages,
                        page_size=page, programs=programs, reserve_pages=policy == "reserve")
        kind = {**described, "slots": engine.n_slots, "page_policy": policy}
        try:
            for n in levels:
                _run_together(engine, prompts(n), new_tokens)  # compiles every page count the timed pass reads
                before = engine.stats()["requests"]["preempted"], programs.traces
                record = _serving_record("paged", [_run_together(engine, prompts(n), new_tokens)], new_tokens)
                records.append({**record, "bench": "serving_paged", "concurrent": n, **kind,
                                "preempted": engine.stats()["requests"]["preempted"] - before[0],
                                "compiled_in_pass": programs.traces - before[1]})
                # as it comes, on stderr beside the logs: a section cut short keeps the levels it timed
                print(json.dumps({**records[-1], "partial": True}), file=sys.stderr, flush=True)
            if profile_steps and policy == policies[0]:
                at_once = min(levels[-1], n_pages // pages_for(sizes.serving_prompt_len + new_tokens, page))
                records.append({"bench": "serving_profile", "concurrent": levels[-1], "at_once": at_once, **kind,
                                **_profiled_pass(engine, prompts(levels[-1]), new_tokens, at_once, profile_steps)})
                print(json.dumps({**records[-1], "partial": True}), file=sys.stderr, flush=True)
        finally:
            engine.close()
    return records + [paged_capacity(layout, sizes, page, bytes_limit)]


def _profiled_pass(engine: Engine, prompts: list[list[int]], new_tokens: int, at_once: int, steps: int) -> dict:
    """The prompts submitted together, the profiler on from when `at_once` requests have made a quarter of their
    tokens until about `steps` decode steps of them later (tokens counted as they stream): what the device did a
    decode step (`common.device_op_times`, per run of the paged decode programs; prefills in the window count too)."""
    start = at_once * new_tokens // 4
    made, marks = [0], [(start, threading.Event()),
                        (min(start + steps * at_once, len(prompts) * new_tokens), threading.Event())]

    def counted(event: Event) -> None:
        made[0] += len(event.tokens)
        for threshold, reached in marks:
            if made[0] >= threshold:
                reached.set()

    def reach(mark: threading.Event, future: concurrent.futures.Future) -> None:
        while not mark.wait(1.0):
            if future.done():  # the pass ended (or failed) before the window
                future.result()
                raise RuntimeError("the profiled pass ended before its window")

    with tempfile.TemporaryDirectory() as trace_dir, concurrent.futures.ThreadPoolExecutor(1) as pool:
        passing = pool.submit(_run_together, engine, prompts, new_tokens, observe=counted)
        reach(marks[0][1], passing)
        jax.profiler.start_trace(trace_dir)
        try:
            reach(marks[1][1], passing)
        finally:
            jax.profiler.stop_trace()
        passing.result()
        return device_op_times(trace_dir, None, module="paged_decode")
