"""Serving throughput over HTTP: concurrent streaming clients (continuous batching) against the same requests sent
one at a time, with aggregate tokens/s, latency and time to first token.

One real CPU device (mp 1), random weights, greedy; EOS is ignored so every request makes exactly --new-tokens
tokens. Every program is compiled before timing (the engine's warm-up), so the figures are of serving alone. The
server runs in a process of its own, as it would in use, so the clients' work does not hold its interpreter lock.

    python bench/bench_serving.py [--config configs/bench.json] [--clients 32] [--new-tokens 64] [--prompt-len 32]
                                  [--kv-pages 192 --page-size 16] [--adapters 8 --adapter-rank 16]

With --adapters N the server holds N LoRA adapter slots (random adapters of --adapter-rank on every projection,
loaded from PEFT directories at the start) and the concurrent requests run twice, side by side: all on the base, and
spread over the N adapters, alternately --rounds times (medians compared); then one more adapter is loaded at run
time, timed (`adapter_load`).
"""
from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import httpx
import jax
import numpy as np

from bench.common import emit
from mesh_transformer.model import table
from mesh_transformer.platforms import platform_setup
from mesh_transformer import config
from mesh_transformer.flags import add_paged_cache_args, paged_cache
from mesh_transformer.serve import engine as serving, server
from mesh_transformer.infer.params import make_inference_layout
from mesh_transformer.parallel.mesh import make_dp_mp
from mesh_transformer.tokenizer import load_tokenizer

GOAL_SPEEDUP = 8


def one_request(client: httpx.Client, prompt: list[int], new_tokens: int, model: str | None = None) -> dict:
    """Stream one greedy completion (of `model`, a served adapter's name, or the base); its latency, time to first
    token and completion tokens."""
    body = {"prompt": prompt, "max_tokens": new_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}, **({"model": model} if model else {})}
    start_s = time.perf_counter()
    first_s, tokens = None, 0
    with client.stream("POST", "/v1/completions", json=body) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if chunk["choices"] and first_s is None:
                first_s = time.perf_counter() - start_s
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    return {"latency_s": time.perf_counter() - start_s, "ttft_s": first_s, "tokens": tokens}


def concurrent(client: httpx.Client, prompts: list[list[int]], new_tokens: int,
               models: list[str | None] | None = None) -> tuple[list[dict], float]:
    """All requests at once, one client thread each (request i of models[i]); (per-request results, wall seconds)."""
    results: list[dict] = [{}] * len(prompts)
    gate = threading.Barrier(len(prompts) + 1)

    def run(i: int) -> None:
        gate.wait()
        results[i] = one_request(client, prompts[i], new_tokens, models[i] if models else None)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for thread in threads:
        thread.start()
    gate.wait()
    start_s = time.perf_counter()
    for thread in threads:
        thread.join()
    return results, time.perf_counter() - start_s


def one_at_a_time(client: httpx.Client, prompts: list[list[int]], new_tokens: int) -> tuple[list[dict], float]:
    start_s = time.perf_counter()
    results = [one_request(client, prompt, new_tokens) for prompt in prompts]
    return results, time.perf_counter() - start_s


def summary(mode: str, results: list[dict], wall_s: float, **extra) -> dict:
    tokens = sum(r["tokens"] for r in results)
    latency, ttft = [r["latency_s"] for r in results], [r["ttft_s"] for r in results]
    record = {"bench": "serving", "mode": mode, "requests": len(results), "tokens": tokens,
              "tokens_per_s": round(tokens / wall_s, 1), "wall_s": round(wall_s, 2),
              "latency_p50_s": round(float(np.percentile(latency, 50)), 3),
              "latency_p95_s": round(float(np.percentile(latency, 95)), 3),
              "ttft_p50_s": round(float(np.percentile(ttft, 50)), 3),
              "ttft_p95_s": round(float(np.percentile(ttft, 95)), 3), **extra}
    emit(**record)
    return record


def write_adapters(cfg, n: int, rank: int, root: str) -> list[tuple[str, str]]:
    """n random adapters of `rank` on every projection, as PEFT directories under root: (name, path) each."""
    import dataclasses

    from mesh_transformer.model import lora
    from mesh_transformer.store import peft

    shapes = lora.lora_shapes(dataclasses.replace(cfg, lora_rank=rank, lora_targets=list(config.LORA_TARGETS)))
    modules = []
    for i in range(n + 1):  # one more, loaded at run time
        rng = np.random.default_rng(100 + i)
        arrays = {t: {w: (rng.standard_normal(s.shape) * 0.02).astype(np.float32) for w, s in ab.items()}
                  for t, ab in shapes.items()}
        path = os.path.join(root, f"adapter{i}")
        peft.write_peft(path, arrays, cfg, rank, float(rank))
        modules.append((f"adapter{i}", path))
    return modules


def run_server(config_path: str, slots: int, ready: multiprocessing.Queue, stop: multiprocessing.Event,
               paged: dict, overrides: list[str], adapters: int = 0, rank: int = 16) -> None:
    """The server process: random weights, every program compiled, then serving on a free port until `stop`."""
    import tempfile

    lora = [f"max_loras={adapters + 1}", f"max_lora_rank={rank}"] if adapters else []
    cfg = config.load(config_path, ["cores_per_replica=1", *overrides, *lora])
    params = jax.tree.map(np.asarray, table.init_unsharded(cfg, jax.random.PRNGKey(0)))
    tokenizer = load_tokenizer()
    start_s = time.perf_counter()
    layout = make_inference_layout(cfg, mesh=make_dp_mp(1, 1))
    engine = serving.Engine(layout, params, tokenizer, max_batch=slots, max_queue=2 * slots, stop_token_ids=(),
                            warm_up=True, **paged)
    engine.warmed.wait()  # the penalties' programs too, so no compile shares the host with the timed requests
    setup = {"slots": engine.n_slots, **paged, "warm_up_s": round(time.perf_counter() - start_s, 1),
             "layers": cfg.layers, "d_model": cfg.d_model, "seq": cfg.seq, "devices": jax.device_count(),
             "platform": jax.devices()[0].platform}
    with tempfile.TemporaryDirectory() as root:
        modules = write_adapters(cfg, adapters, rank, root) if adapters else []
        if adapters:
            slot_bytes = sum(x.nbytes for x in jax.tree.leaves(engine.params["layers"][0]["lora"])) * cfg.layers
            setup.update(adapters=adapters, adapter_rank=rank, adapter_slots=cfg.max_loras,
                         bytes_per_adapter_slot=slot_bytes // cfg.max_loras, extra_adapter=modules[-1])
        try:
            app = server.create_app(engine, tokenizer, model_name=cfg.name, lora_modules=modules[:adapters])
            with server.BackgroundServer(app) as running:
                ready.put((running.url, setup))
                stop.wait()
        finally:
            engine.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/bench.json")
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--adapters", type=int, default=0, help="LoRA adapters the requests are spread over")
    parser.add_argument("--adapter-rank", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3, help="with --adapters: base and mixed runs, alternately")
    add_paged_cache_args(parser)
    args = parser.parse_args()
    args.overrides = []  # --kv-cache-dtype's
    paged = paged_cache(parser, args)
    context = multiprocessing.get_context("spawn")  # a fresh interpreter: no threads or JAX state inherited
    ready, stop = context.Queue(), context.Event()
    process = context.Process(target=run_server, args=(args.config, args.clients, ready, stop, paged, args.overrides,
                                                       args.adapters, args.adapter_rank), daemon=True)
    process.start()
    try:
        url, setup = ready.get(timeout=1800)
        extra_adapter = setup.pop("extra_adapter", None)
        emit(bench="serving_setup", **setup)
        rng = np.random.default_rng(0)
        prompts = rng.integers(0, len(load_tokenizer()), (args.clients, args.prompt_len)).tolist()
        limits = httpx.Limits(max_connections=2 * args.clients)
        with httpx.Client(base_url=url, timeout=600, limits=limits) as client:
            concurrent(client, prompts[:4], 4)  # warms the HTTP path and the client's connections
            shared = {"clients": args.clients, "new_tokens": args.new_tokens, "prompt_len": args.prompt_len}
            if args.adapters:
                compare_adapters(client, prompts, args, shared, extra_adapter)
                return
            batched = summary("concurrent", *concurrent(client, prompts, args.new_tokens), **shared)
            alone = summary("one_at_a_time", *one_at_a_time(client, prompts, args.new_tokens), **shared)
        speedup = batched["tokens_per_s"] / alone["tokens_per_s"]
        emit(bench="serving_speedup", concurrent_over_one_at_a_time=round(speedup, 2), goal=GOAL_SPEEDUP,
             met=speedup >= GOAL_SPEEDUP)
    finally:
        stop.set()
        process.join(60)


GOAL_ADAPTERS = 0.8  # mixed-adapter throughput over base-only, 32 clients on the CPU


def compare_adapters(client: httpx.Client, prompts: list, args, shared: dict, extra_adapter: tuple[str, str]) -> None:
    """The concurrent requests all on the base and spread over the adapters, alternately --rounds times (the
    medians compared); then one adapter loaded at run time, timed."""
    models = [f"adapter{i % args.adapters}" for i in range(len(prompts))]
    base, mixed = [], []
    for _ in range(args.rounds):
        base.append(summary("concurrent", *concurrent(client, prompts, args.new_tokens), **shared))
        mixed.append(summary("concurrent_adapters", *concurrent(client, prompts, args.new_tokens, models),
                             adapters=args.adapters, adapter_rank=args.adapter_rank, **shared))
    base_s, mixed_s = (float(np.median([r["tokens_per_s"] for r in runs])) for runs in (base, mixed))
    ratio = mixed_s / base_s
    emit(bench="serving_adapters", base_tokens_per_s=base_s, mixed_tokens_per_s=mixed_s, rounds=args.rounds,
         mixed_over_base_only=round(ratio, 3), goal=GOAL_ADAPTERS, met=ratio >= GOAL_ADAPTERS)
    name, path = extra_adapter
    start_s = time.perf_counter()
    client.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": path}).raise_for_status()
    load_s = time.perf_counter() - start_s
    check = one_request(client, prompts[0], 4, name)
    emit(bench="adapter_load", load_s=round(load_s, 3), adapter_rank=args.adapter_rank, served_after=check["tokens"])


if __name__ == "__main__":
    platform_setup()
    main()
