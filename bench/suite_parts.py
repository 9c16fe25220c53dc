"""The decode and serving sections of bench/device_suite.py, and what they share with it: the measured peaks and
the compile-time log."""
from __future__ import annotations

import threading
import time
from typing import NamedTuple

import jax
import numpy as np

from bench.common import figure
from mesh_transformer.model import table
from mesh_transformer.config import Config
from mesh_transformer.infer.choose import fill_sampling
from mesh_transformer.infer.decode import Steps, block_sizes, default_block
from mesh_transformer.infer.programs import Programs
from mesh_transformer.infer.params import make_inference_layout, place_params
from mesh_transformer.model import gptj
from mesh_transformer.parallel.layout import Layout
from mesh_transformer.parallel.mesh import make_dp_mp
from mesh_transformer.serve.completion import Event, GenerationRequest
from mesh_transformer.serve.engine import Engine

BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"  # jax._src.dispatch's name for XLA compiles
SERVING_GOAL_SPEEDUP = 20
REQUEST_TIMEOUT_S = 600


class Peaks(NamedTuple):
    """The device's measured matmul rate and read bandwidth, and its datasheet ones (None when not known)."""
    flop_per_s: float
    bytes_per_s: float
    datasheet_flop_per_s: float | None
    datasheet_bytes_per_s: float | None


class CompileLog:
    """Seconds XLA spent compiling each program since `start`, from JAX's monitoring events."""

    def __init__(self):
        self._times: list[tuple[str, float]] = []
        jax.monitoring.register_event_duration_secs_listener(self._on_event)

    def _on_event(self, event: str, duration_s: float, **kwargs) -> None:
        if event == BACKEND_COMPILE_EVENT:
            self._times.append((str(kwargs.get("fun_name", "?")), duration_s))

    def start(self) -> None:
        self._times = []

    def summary(self) -> dict:
        """{"compiles", "compile_s_total", "compile_s": {program: seconds}} of what was compiled since `start`."""
        by_program: dict[str, float] = {}
        for name, seconds in self._times:
            by_program[name] = by_program.get(name, 0.0) + seconds
        if not by_program:
            return {}
        return {"compiles": len(self._times), "compile_s_total": figure(sum(by_program.values())),
                "compile_s": {name: figure(s) for name, s in sorted(by_program.items(), key=lambda kv: -kv[1])}}


def random_decode_params(layout: Layout) -> dict:
    """Random weights in the compute dtype, made on the devices and put in the decode programs' form."""
    cfg = layout.cfg
    shapes = table.param_shapes(cfg, gptj.precision(cfg).compute)

    def make(key):
        leaves, treedef = jax.tree.flatten(shapes)
        keys = jax.random.split(key, len(leaves))
        return jax.tree.unflatten(treedef, [0.02 * jax.random.normal(k, s.shape, s.dtype)
                                            for k, s in zip(keys, leaves)])

    return place_params(jax.jit(make, out_shardings=layout.param_shardings())(jax.random.PRNGKey(0)), layout)


def one_device_layout(cfg: Config, device: jax.Device) -> Layout:
    return make_inference_layout(cfg, mesh=make_dp_mp(1, 1, [device]))


def decode_records(layout: Layout, params: dict, sizes, peaks: Peaks) -> list[dict]:
    """Decode tokens/s at each batch against the bandwidth roofline: one program per batch, compiled ahead, run
    for sizes.repeats x 4 steps from sizes.decode_context cached positions."""
    cfg = layout.cfg
    programs = Programs(layout)
    blocks = block_sizes(cfg.seq, default_block(cfg.seq))
    n_steps = 4 * sizes.repeats
    n_blocks = min(len(blocks), -(-(sizes.decode_context + n_steps + 2) // blocks[0]))
    span = sum(blocks[:n_blocks])
    n_slots = max(sizes.decode_batches)
    cache, last_N = programs.new_cache(n_slots, blocks), programs.new_slots(n_slots)
    itemsize = gptj.precision(cfg).compute.itemsize
    # Every weight is read once a step, but of the embedding only a row per token; each row reads its keys and
    # values of the span in every layer.
    weight_bytes = sum(x.nbytes for x in jax.tree.leaves(params)) - params["embed"]["wte"].nbytes
    kv_bytes_per_row = cfg.layers * 2 * span * cfg.n_heads * cfg.head_dim * itemsize
    records = []
    for batch in sizes.decode_batches:
        zeros = np.zeros(n_slots, np.int32)
        steps = Steps(zeros + sizes.decode_context, zeros, fill_sampling(n_slots, []))
        start = time.perf_counter()
        step = programs.lower("decode", params, cache, last_N, steps, rows=batch, n_blocks=n_blocks).compile()
        compile_s = time.perf_counter() - start
        _, _, last_N, steps, cache = step(params, cache, last_N, steps)
        jax.block_until_ready(last_N)
        start = time.perf_counter()
        for _ in range(n_steps):
            tokens, _, last_N, steps, cache = step(params, cache, last_N, steps)
        jax.block_until_ready(tokens)
        step_s = (time.perf_counter() - start) / n_steps
        bytes_per_step = weight_bytes + batch * kv_bytes_per_row
        roofline = batch * peaks.bytes_per_s / bytes_per_step
        records.append({"bench": "decode", "layers": cfg.layers, "d_model": cfg.d_model, "batch": batch,
                        "dtype": gptj.precision(cfg).compute.name, "weight_dtype": cfg.weight_dtype,
                        "cached_positions_read": span,
                        "compile_s": figure(compile_s), "step_s": figure(step_s),
                        "tokens_per_s": figure(batch / step_s), "gb_read_per_step": figure(bytes_per_step / 1e9),
                        "roofline_tokens_per_s": figure(roofline),
                        "fraction_of_roofline": figure(batch / step_s / roofline)})
    return records


class _CharPerToken:
    """A stand-in tokenizer, one character per token: every token streams at once and no BPE runs on the host, so
    the figures are the engine's and the device's."""

    def decode(self, tokens) -> str:
        return "x" * len(tokens)


def _run_together(engine: Engine, prompts: list[list[int]], new_tokens: int) -> tuple[float, list[float], int]:
    """Submit all prompts at once (greedy, streamed) and wait for them: (wall seconds, time to first token of
    each, tokens made)."""
    n = len(prompts)
    first_s: list[float | None] = [None] * n
    made, done, errors = [0] * n, [threading.Event() for _ in range(n)], []

    def receiver(i: int):
        def on_event(event: Event) -> None:
            if event.tokens and first_s[i] is None:
                first_s[i] = time.perf_counter() - start_s
            made[i] += len(event.tokens)
            if event.error:
                errors.append(event.error)
            if event.error or event.finish_reason:
                done[i].set()
        return on_event

    requests = [GenerationRequest(prompt, new_tokens, receiver(i), temperature=0.0, stream=True, logprobs=False)
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


def serving_records(layout: Layout, params: dict, sizes) -> list[dict]:
    """The engine with sizes.serving_clients requests submitted together, against requests one at a time. A warm
    pass of each kind first compiles the programs the timed ones use (one cache block: one decode program per
    row count)."""
    cfg = layout.cfg
    engine = Engine(layout, params, _CharPerToken(), max_batch=sizes.serving_clients,
                    max_queue=2 * sizes.serving_clients, stop_token_ids=(), min_span=cfg.seq)
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
    for record in (together, alone):
        record.update(clients=sizes.serving_clients, prompt_len=sizes.serving_prompt_len, layers=cfg.layers,
                      d_model=cfg.d_model)
    speedup = together["tokens_per_s"] / alone["tokens_per_s"]
    return [together, alone, {"bench": "serving_speedup", "concurrent_over_one_at_a_time": figure(speedup),
                              "goal": SERVING_GOAL_SPEEDUP, "met": speedup >= SERVING_GOAL_SPEEDUP}]

