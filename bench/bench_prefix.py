"""Automatic prefix caching over HTTP: requests sharing a long prompt prefix, with the server's prefix cache on and
off, and lm-eval's loglikelihood requests (echoed prompts) on a multiple-choice task, on and off.

One server process holds two engines over the same weights and compiled programs, one with the prefix cache and
one without (`--no-prefix-cache`), each behind its own port; the rounds alternate between them. Each round's
requests share a prefix of their own (a new one each round, so no round finds the last one's cached), all sent at
once, streamed, greedy, EOS ignored. The programs the rounds run are compiled before timing. Random weights: the
bench config with seq 2048, one CPU device.

    python bench/bench_prefix.py [--requests 64] [--prefix-len 1024] [--tail-len 64] [--new-tokens 16]
                                 [--kv-pages 1024 --page-size 16]
"""
from __future__ import annotations

import argparse
import concurrent.futures
import multiprocessing
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import httpx
import jax
import numpy as np

from bench.bench_serving import summary
from bench.bench_serving import concurrent as all_at_once
from bench.common import emit
from mesh_transformer import config
from mesh_transformer.infer.params import make_inference_layout
from mesh_transformer.infer.programs import Programs
from mesh_transformer.infer.sizes import bucket
from mesh_transformer.model import table
from mesh_transformer.parallel.mesh import make_dp_mp
from mesh_transformer.platforms import platform_setup
from mesh_transformer.flags import add_paged_cache_args, paged_cache
from mesh_transformer.serve import engine as serving, server
from mesh_transformer.tokenizer import load_tokenizer

GOAL_SPEEDUP = 3


def run_server(args: argparse.Namespace, ready: multiprocessing.Queue, stop: multiprocessing.Event) -> None:
    """The server process: both engines, the programs the rounds need compiled, then serving until `stop`."""
    cfg = config.load(args.config, ["cores_per_replica=1", f"seq={args.seq}", *args.overrides])
    params = jax.tree.map(np.asarray, table.init_unsharded(cfg, jax.random.PRNGKey(0)))
    tokenizer = load_tokenizer()
    layout = make_inference_layout(cfg, mesh=make_dp_mp(1, 1))
    programs = Programs(layout)
    engines = {on: serving.Engine(layout, params, tokenizer, max_batch=args.slots, max_queue=2 * args.requests,
                                  stop_token_ids=(), programs=programs, prefix_cache=on, **args.paged)
               for on in (True, False)}
    widths = {bucket(args.prefix_len + args.tail_len, maximum=cfg.seq), bucket(args.tail_len, maximum=cfg.seq)}
    needed = [p for p in engines[True].programs() if "decode" in p[0] or p[1][3].shape[1] in widths]
    start_s = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        list(pool.map(lambda program: programs.compile(*program), needed))
    setup = {"slots": engines[True].n_slots, **args.paged, "programs": len(needed),
             "compile_s": round(time.perf_counter() - start_s), "layers": cfg.layers, "d_model": cfg.d_model,
             "seq": cfg.seq, "platform": jax.devices()[0].platform}
    try:
        with server.BackgroundServer(server.create_app(engines[True], tokenizer, model_name="on")) as on, \
                server.BackgroundServer(server.create_app(engines[False], tokenizer, model_name="off")) as off:
            ready.put(({True: on.url, False: off.url}, setup))
            stop.wait()
    finally:
        for engine in engines.values():
            engine.close()


def shared_prefix_prompts(rng: np.random.Generator, args: argparse.Namespace, vocab: int) -> list[list[int]]:
    prefix = rng.integers(0, vocab, args.prefix_len).tolist()
    return [prefix + rng.integers(0, vocab, args.tail_len).tolist() for _ in range(args.requests)]


def loglikelihood(client: httpx.Client, contexts: list[list[int]], endings: list[list[list[int]]]) -> float:
    """lm-eval's loglikelihood requests as its `local-completions` model sends them (echo, no new tokens, logprobs),
    every (context, ending) pair at once; returns requests/s."""
    bodies = [{"prompt": c + e, "max_tokens": 0, "echo": True, "logprobs": 1, "temperature": 0}
              for c, ends in zip(contexts, endings) for e in ends]
    start_s = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(len(bodies)) as pool:
        for response in pool.map(lambda body: client.post("/v1/completions", json=body), bodies):
            response.raise_for_status()
    return len(bodies) / (time.perf_counter() - start_s)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/bench.json")
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--prefix-len", type=int, default=1024)
    parser.add_argument("--tail-len", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--slots", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=2)
    add_paged_cache_args(parser)
    parser.add_argument("--questions", type=int, default=16, help="multiple-choice questions (4 endings each)")
    args = parser.parse_args()
    args.overrides = []  # --kv-cache-dtype's
    args.paged = paged_cache(parser, args)
    context = multiprocessing.get_context("spawn")
    ready, stop = context.Queue(), context.Event()
    process = context.Process(target=run_server, args=(args, ready, stop), daemon=True)
    process.start()
    try:
        urls, setup = ready.get(timeout=3600)
        emit(bench="prefix_setup", **setup)
        rng, vocab = np.random.default_rng(0), len(load_tokenizer())
        shared = {"requests": args.requests, "prefix_len": args.prefix_len, "tail_len": args.tail_len,
                  "new_tokens": args.new_tokens}
        records = {True: [], False: []}
        limits = httpx.Limits(max_connections=2 * args.requests)
        clients = {on: httpx.Client(base_url=url, timeout=1800, limits=limits) for on, url in urls.items()}
        for client in clients.values():  # warms the HTTP path, and compiles nothing (not timed)
            all_at_once(client, shared_prefix_prompts(rng, args, vocab)[:2], 2)
        for round_ in range(args.rounds):
            for on in (True, False):
                results, wall_s = all_at_once(clients[on], shared_prefix_prompts(rng, args, vocab), args.new_tokens)
                record = summary("prefix_cache_on" if on else "prefix_cache_off", results, wall_s, round=round_,
                                 requests_per_s=round(len(results) / wall_s, 2), **shared)
                records[on].append(record)
        rps = {on: np.median([r["requests_per_s"] for r in rs]) for on, rs in records.items()}
        ttft = {on: np.median([r["ttft_p50_s"] for r in rs]) for on, rs in records.items()}
        emit(bench="prefix_speedup", requests_per_s_on_over_off=round(rps[True] / rps[False], 2),
             ttft_p50_on_over_off=round(ttft[True] / ttft[False], 3), goal_requests=GOAL_SPEEDUP,
             goal_ttft=round(1 / GOAL_SPEEDUP, 3),
             met=bool(rps[True] / rps[False] >= GOAL_SPEEDUP and ttft[True] / ttft[False] <= 1 / GOAL_SPEEDUP))
        contexts = [rng.integers(0, vocab, rng.integers(60, 121)).tolist() for _ in range(args.questions)]
        endings = [[rng.integers(0, vocab, rng.integers(15, 41)).tolist() for _ in range(4)] for _ in contexts]
        for on in (True, False):
            loglikelihood(clients[on], contexts[:2], endings[:2])  # compiles the scorer's shapes (not timed)
        scored = {on: loglikelihood(clients[on], contexts, endings) for on in (True, False)}
        emit(bench="prefix_loglikelihood", questions=args.questions, requests=4 * args.questions,
             requests_per_s_on=round(scored[True], 2), requests_per_s_off=round(scored[False], 2),
             on_over_off=round(scored[True] / scored[False], 3))
        for client in clients.values():
            client.close()
    finally:
        stop.set()
        process.join(60)


if __name__ == "__main__":
    platform_setup()
    main()
