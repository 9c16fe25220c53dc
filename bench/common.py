"""Shared benchmark helpers: timing, the measured matmul peak, model FLOPs, JSON-line output."""
from __future__ import annotations

import json
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp

from mesh_transformer.config import Config


def emit(**record) -> None:
    print(json.dumps(record), flush=True)


def figure(x: float, digits: int = 4) -> float:
    """x to `digits` significant digits, for a JSON record (a small figure keeps its digits, unlike round)."""
    return float(f"{x:.{digits}g}")


def interleaved_times_s(fns: list[Callable[[], object]], repeats: int = 5, warmup: int = 1) -> list[list[float]]:
    """Wall times of each of `fns` over `repeats` rounds, each round running every fn once in turn (after `warmup`
    runs of each): a machine whose speed drifts then slows all of them alike, so per-round ratios stay fair."""
    for fn in fns:
        for _ in range(warmup):
            fn()
    times = [[] for _ in fns]
    for _ in range(repeats):
        for fn, fn_times in zip(fns, times):
            start = time.perf_counter()
            fn()
            fn_times.append(time.perf_counter() - start)
    return times


def best_time_s(fn: Callable[[], object], repeats: int = 5, warmup: int = 1) -> float:
    """Best wall time of `fn` over `repeats` runs, after `warmup` runs (compile, caches)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def matmul_peak_flop_per_s(n: int = 2048, dtype=jnp.float32, device: jax.Device | None = None) -> float:
    """The matmul rate XLA reaches on this machine (f32 by default): the roofline MFU figures are measured against."""
    device = device or jax.devices()[0]
    a = jax.device_put(jax.random.normal(jax.random.PRNGKey(0), (n, n), dtype), device)
    b = jax.device_put(jax.random.normal(jax.random.PRNGKey(1), (n, n), dtype), device)
    dot = jax.jit(lambda x, y: x @ y)
    return 2 * n ** 3 / best_time_s(lambda: dot(a, b).block_until_ready(), repeats=10)


def read_bandwidth_bytes_per_s(n_bytes: int, device: jax.Device | None = None) -> float:
    """The rate a jitted sum streams an f32 array of n_bytes from the device's memory."""
    x = jax.device_put(jnp.ones(n_bytes // 4, jnp.float32), device or jax.devices()[0])
    total = jax.jit(jnp.sum)
    return n_bytes / best_time_s(lambda: total(x).block_until_ready(), repeats=10)


def copy_bandwidth_bytes_per_s(n_bytes: int, device: jax.Device | None = None, repeats: int = 5) -> float:
    """The rate the device's memory streams a copy: a jitted x + 1 over a bf16 array of n_bytes (XLA cannot elide
    it, and it has nothing to reduce), which reads n_bytes and writes n_bytes: 2 x n_bytes moved a call. Best of
    `repeats` rounds of 10 calls, each call's output the next one's input (donated, so one array is alive, and
    dispatch overlaps the copies)."""
    step = jax.jit(lambda x: x + 1, donate_argnums=0)
    x = step(jax.device_put(jnp.zeros(n_bytes // 2, jnp.bfloat16), device or jax.devices()[0]))

    def ten_copies():
        nonlocal x
        for _ in range(10):
            x = step(x)
        x.block_until_ready()

    return 10 * 2 * n_bytes / best_time_s(ten_copies, repeats=repeats)


def train_flops_per_token(cfg: Config) -> float:
    """Forward + backward FLOPs per token: 6 x matmul params + attention scores/values (PaLM's convention)."""
    D, L, V, T = cfg.d_model, cfg.layers, cfg.n_vocab, cfg.seq
    matmul_params = L * (4 * D * D + 2 * D * cfg.d_ff) + D * V
    return 6 * matmul_params + 12 * L * D * T
