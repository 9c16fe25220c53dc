"""Shared benchmark helpers: timing, the measured matmul peak, model FLOPs, JSON-line output."""
from __future__ import annotations

import json
import re
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp

from mesh_transformer import targets
from mesh_transformer.config import Config


def emit(**record) -> None:
    print(json.dumps(record), flush=True)


def figure(x: float, digits: int = 4) -> float:
    """x to `digits` significant digits, for a JSON record (a small figure keeps its digits, unlike round)."""
    return float(f"{x:.{digits}g}")


def _traced(trace_dir: str) -> tuple[dict, dict, list]:
    """A `jax.profiler.trace`'s events: the device's ops ({name: [ns, runs]}, accelerator planes' "XLA Ops"), the
    host's events ({(thread, name): ns}, the profiler's own left out) and the device's modules' (start, end, name)."""
    import glob

    from jax.profiler import ProfileData

    ops: dict[str, list] = {}
    host: dict[tuple[str, str], int] = {}
    modules = []
    for path in glob.glob(f"{trace_dir}/**/*.xplane.pb", recursive=True):
        for plane in ProfileData.from_file(path).planes:
            device = plane.name.startswith("/device:") and "CUSTOM" not in plane.name
            for line in plane.lines if device or plane.name.startswith("/host:CPU") else []:
                for e in line.events:
                    if not device:
                        if "profiler.py" not in e.name and "contextlib.py" not in e.name:
                            host[line.name, e.name] = host.get((line.name, e.name), 0) + e.duration_ns
                    elif line.name == "XLA Modules":
                        modules.append((e.start_ns, e.end_ns, e.name))
                    elif line.name == "XLA Ops":
                        op = ops.setdefault(e.name, [0, 0])
                        op[0] += e.duration_ns
                        op[1] += 1
    return ops, host, sorted(modules)


def _kind(op: str) -> str:
    """Ops alike: an op's name less its number, its result's type, and a custom call's target."""
    head, _, text = op.partition(" = ")
    target = re.search(r"custom_call_target=\"?([\w.-]+)", text)
    return f"{re.sub(r'[.][0-9]+$', '', head.lstrip('%'))} {text.split('{')[0].split(' ')[0]}" + (
        f" {target.group(1)}" if target else "")


def device_op_times(trace_dir: str, steps: int | None, top: int = 24, module: str = "") -> dict:
    """What a `jax.profiler.trace` into `trace_dir` of `steps` runs of one program shows: the device's modules' time
    a step and its idle time between them, its ops' time a step (the `top` longest ops, and by kind), and the host's
    events that took longest (their total a step, by thread and name: nested events both count). `steps` None: the
    runs of the modules whose names hold `module` (`module_runs`; other programs' ops count too). A CPU trace has no
    device planes: its device figures are empty."""
    ops, host, modules = _traced(trace_dir)
    runs_of = {}
    for _, _, name in modules:
        runs_of[name] = runs_of.get(name, 0) + 1
    if steps is None:
        steps = max(1, sum(n for name, n in runs_of.items() if module in name))
    per_step = {name: ns / 1e3 / steps for name, (ns, _) in ops.items()}
    kinds: dict[str, list] = {}
    for name, (_, runs) in ops.items():
        entry = kinds.setdefault(_kind(name), [0.0, 0.0])
        entry[0] += per_step[name]
        entry[1] += runs / steps
    longest = sorted(per_step, key=per_step.get, reverse=True)[:top]
    return {"steps": steps, "module_runs": runs_of,
            "modules_us_per_step": figure(sum(b - a for a, b, _ in modules) / 1e3 / steps),
            "module_gaps_us": [figure((b[0] - a[1]) / 1e3) for a, b in zip(modules, modules[1:])][:64],
            "device_ops_us_per_step": figure(sum(per_step.values())), "ops": len(ops),
            "by_kind": [{"kind": k[:200], "us_per_step": figure(us), "runs_per_step": runs}
                        for k, (us, runs) in sorted(kinds.items(), key=lambda kv: -kv[1][0])[:top]],
            "top_ops": [{"op": name[:300], "us_per_step": figure(per_step[name]), "runs_per_step": ops[name][1] / steps}
                        for name in longest],
            "host_top": [{"thread": t, "event": n[:160], "us_per_step": figure(ns / 1e3 / steps)}
                         for (t, n), ns in sorted(host.items(), key=lambda kv: -kv[1])[:top]]}


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
    from mesh_transformer.estimate import layer_matrix_params

    D, L, V, T = cfg.d_model, cfg.layers, cfg.n_vocab, cfg.seq
    return 6 * (layer_matrix_params(cfg) + D * V) + 12 * L * D * T


def datasheet(device: jax.Device) -> tuple[float | None, float | None]:
    """(bf16 FLOP/s, bytes/s) of the device's datasheet (`targets.chip_of`), or (None, None) for one not known."""
    chip = targets.chip_of(getattr(device, "device_kind", ""))
    return (chip.peak_flops, chip.bandwidth) if chip else (None, None)


def write_word_tokenizer(path: str, vocab: dict[str, int], **config) -> None:
    """A word-level tokenizer of `vocab` (its "<unk>", "<s>" and "</s>" included) that splits on whitespace and
    prepends <s>, as tokenizer.json and a tokenizer_config.json with `config`'s keys besides (a chat template, say):
    a model directory's tokenizer built here, nothing downloaded."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", vocab["<s>"])])
    tokenizer.save(f"{path}/tokenizer.json")
    with open(f"{path}/tokenizer_config.json", "w") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
                   "unk_token": "<unk>", **config}, f)
