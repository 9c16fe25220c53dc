"""Shared benchmark helpers: timing, the measured matmul peak, model FLOPs, JSON-line output."""
from __future__ import annotations

import json
import re
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


def device_op_times(trace_dir: str, steps: int, top: int = 24) -> dict:
    """What a `jax.profiler.trace` into `trace_dir` of `steps` runs of one program shows the device doing: its ops'
    time a step (the `top` longest, each with its HLO category and, where the trace has them, bytes accessed and
    the rate they were moved at), the time by category, the modules' own time a step and the device's idle time
    between them, and the host's events that took longest (their total a step, by thread and name: nested events
    both count). Device figures come from accelerator planes only: a CPU trace gives none."""
    import glob

    from jax.profiler import ProfileData

    ops: dict[str, dict] = {}
    host: dict[tuple[str, str], int] = {}
    module_ns, spans = 0, []
    for path in glob.glob(f"{trace_dir}/**/*.xplane.pb", recursive=True):
        for plane in ProfileData.from_file(path).planes:
            if plane.name.startswith("/host:CPU"):
                for line in plane.lines:
                    for e in line.events:  # but the profiler's own
                        if "profiler.py" not in e.name and "contextlib.py" not in e.name:
                            host[line.name, e.name] = host.get((line.name, e.name), 0) + e.duration_ns
            if not plane.name.startswith("/device:") or "CUSTOM" in plane.name:
                continue
            for line in plane.lines:
                if line.name == "XLA Modules":
                    module_ns += sum(e.duration_ns for e in line.events)
                    spans += [(e.start_ns, e.end_ns) for e in line.events]
                if line.name != "XLA Ops":
                    continue
                for e in line.events:
                    op = ops.setdefault(e.name, {"ns": 0, "n": 0})
                    op["ns"] += e.duration_ns
                    op["n"] += 1
                    if "stats" not in op:
                        op["stats"] = {k: v for k, v in e.stats}
    by_category: dict[str, float] = {}
    rows = []
    for name, op in ops.items():
        stats = op.get("stats", {})
        us = op["ns"] / 1e3 / steps
        category = str(stats.get("hlo_category", "?"))
        by_category[category] = by_category.get(category, 0.0) + us
        row = {"op": name, "category": category, "us_per_step": figure(us), "runs_per_step": op["n"] / steps}
        accessed = stats.get("bytes_accessed")
        if accessed:
            row.update(bytes_accessed=int(accessed), gb_per_s=figure(int(accessed) * op["n"] / op["ns"]))
        if "long_name" in stats:
            row["long_name"] = str(stats["long_name"])[:200]
        rows.append(row)
    rows.sort(key=lambda r: -r["us_per_step"])
    kinds: dict[str, list] = {}  # ops alike: the name less its number, the result's type, a custom call's target
    for row in rows:
        head, _, text = row["op"].partition(" = ")
        result = text.split("{")[0].split(" ")[0]
        target = re.search(r"custom_call_target=\"?([\w.-]+)", text)
        name = re.sub(r"[.]\d+$", "", head.lstrip("%"))
        kind = f"{name} {result}" + (f" {target.group(1)}" if target else "")
        entry = kinds.setdefault(kind, [0.0, 0])
        entry[0] += row["us_per_step"]
        entry[1] += row["runs_per_step"]
    stat_keys = sorted({k for op in ops.values() for k in op.get("stats", {})})
    spans.sort()
    gaps_us = [(b[0] - a[1]) / 1e3 for a, b in zip(spans, spans[1:])]
    host_top = sorted(host.items(), key=lambda kv: -kv[1])[:top]
    return {"module_gaps_us": [figure(g) for g in gaps_us],
            "host_top": [{"thread": t, "event": n[:160], "us_per_step": figure(ns / 1e3 / steps)}
                         for (t, n), ns in host_top],
            "device_ops_us_per_step": figure(sum(r["us_per_step"] for r in rows)) if rows else 0.0,
            "modules_us_per_step": figure(module_ns / 1e3 / steps), "ops": len(rows),
            "by_category_us": {k: figure(v) for k, v in sorted(by_category.items(), key=lambda kv: -kv[1])},
            "by_kind": [{"kind": k[:200], "us_per_step": figure(us), "runs_per_step": n}
                        for k, (us, n) in sorted(kinds.items(), key=lambda kv: -kv[1][0])[:top]],
            "top_ops": rows[:top], "stat_keys": stat_keys}


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
