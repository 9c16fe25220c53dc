"""What bench/device_suite.py's sections are made of: the sizes each runs at (fixed on the CPU, fitted to an
accelerator's memory by `device_sizes`), random models made leaf by leaf in their final form, the decode sections, the
measured peaks and the compile-time log (the serving sections: bench/suite_serving.py)."""
from __future__ import annotations

import dataclasses
import functools
import math
import tempfile
import time
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from bench.common import device_op_times, figure
from mesh_transformer import config
from mesh_transformer.aot import shard_bytes
from mesh_transformer.infer import decode_kernel
from mesh_transformer.infer.choose import fill_sampling
from mesh_transformer.infer.decode import Steps, block_sizes, default_block
from mesh_transformer.infer.params import abstract_params, make_inference_layout
from mesh_transformer.infer.programs import Programs
from mesh_transformer.model import gptj, lora, quant, quant_kernel, table
from mesh_transformer.parallel.layout import Layout
from mesh_transformer.parallel.mesh import make_dp_mp
from mesh_transformer.platforms import for_devices

BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"  # jax._src.dispatch's name for XLA compiles
SERVING_GOAL_SPEEDUP = 20
REQUEST_TIMEOUT_S = 600

GPTJ_6B = {"layers": 28, "d_model": 4096, "n_heads": 16, "n_vocab": 50400, "pe_rotary_dims": 64}
GPTJ_TRAIN = {"d_model": 2048, "n_heads": 16, "n_vocab": 50400, "pe_rotary_dims": 64, "seq": 2048}  # layers: fitted
BENCH_MODEL = {"layers": 6, "d_model": 512, "n_heads": 8, "n_vocab": 50400, "pe_rotary_dims": 32, "seq": 256}
# The Llama shapes JetStream and MaxText publish figures on (random weights: no rope scaling, untied heads).
LLAMA2_7B = {"family": "llama", "layers": 32, "d_model": 4096, "n_heads": 32, "n_kv_heads": 32,
             "intermediate_size": 11008, "n_vocab": 32000, "pe_rotary_dims": 128, "rotary_base": 10000.0}
LLAMA3_8B = {**LLAMA2_7B, "n_kv_heads": 8, "intermediate_size": 14336, "n_vocab": 128256, "rotary_base": 500000.0}
MODELS = {"gptj_6b": GPTJ_6B, "llama2_7b": LLAMA2_7B, "llama3_8b": LLAMA3_8B}  # device_suite.py --model
TINY_MODEL = {"layers": 2, "d_model": 64, "n_heads": 4, "n_vocab": 256, "pe_rotary_dims": 8, "seq": 64}
INT8 = {"weight_dtype": "int8"}

# An accelerator's sections plan to fill this share of its memory limit; an inference program's temporaries beside
# its arguments (a layer's products, the logits, a 16-row prefill's activations) are given WORKSPACE_BYTES of it.
HEADROOM = 0.9
WORKSPACE_BYTES = 1 << 30
# The batches decode picks from: 1 and the two largest that fit (each is a program to compile: 20-29 s for GPT-J-6B
# on one TPU v5e's host).
DECODE_BATCHES = (1, 8, 16, 32, 64, 128, 256)
SERVING_SEQ = 2048  # the serving sections' context: GPT-J's whole one, as device_serve.py serves the 6B config
WEIGHT_STD = 0.02  # random float weights' spread; int8 ones span [-127, 127] with scales that give about the same


@dataclasses.dataclass(frozen=True)
class Sizes:
    """How big each section runs on one device."""
    matmul_n: int
    copy_bytes: int  # the array the bandwidth copy reads, and writes again
    train_model: dict
    train_batch: int  # sequences per micro-batch
    train_micro_batches: int  # micro-batches accumulated into each step
    lora_model: dict
    decode_model: dict  # its seq is the cache length
    decode_batches: tuple[int, ...]
    decode_int8_batches: tuple[int, ...]
    decode_context: int  # positions already in the cache when the timed decode steps start
    serving_model: dict  # its seq is each slot's context
    serving_slots: int
    serving_clients: int  # requests submitted together
    serving_one_at_a_time: int  # requests timed one after another
    serving_prompt_len: int
    serving_new_tokens: int
    repeats: int  # timed train steps, and decode steps per batch x 4
    paged_levels: tuple[int, ...] = (64, 1, 8, 32, 128)  # concurrent requests serving_paged times (those up to twice
    # its slots), the goal's 64 first


SIZES = {
    "cpu": Sizes(2048, 2 ** 29, BENCH_MODEL, 4, 1, BENCH_MODEL, BENCH_MODEL, (1, 16, 64, 256), (1, 16, 64, 256), 128,
                 {**BENCH_MODEL, **INT8}, 64, 64, 4, 32, 16, 3),
    "tiny": Sizes(256, 2 ** 24, TINY_MODEL, 2, 1, TINY_MODEL, TINY_MODEL, (1, 4), (1, 4), 16, {**TINY_MODEL, **INT8},
                  8, 8, 2, 8, 4, 2),
}


def model_config(model: dict, **overrides) -> config.Config:
    """A single-device config of a model shape (`compute_dtype` auto unless overridden)."""
    return config.from_dict({**model, "cores_per_replica": 1, "warmup_steps": 0, **overrides})


def one_device_layout(cfg: config.Config, device: jax.Device) -> Layout:
    return make_inference_layout(cfg, mesh=make_dp_mp(1, 1, [device]))


# ------------------------------------------------------------------------------------------------------ sizes
def device_sizes(device: jax.Device, bytes_limit: int, compute_dtype: str = "auto",
                 train_seq: int | None = None, model: dict = GPTJ_6B, serving: tuple[int, int] = (256, 128),
                 paged_levels: tuple[int, ...] | None = None) -> Sizes:
    """An accelerator's sizes, fitted to `bytes_limit` bytes of device memory (HEADROOM of it): `model` (GPT-J-6B,
    or another of MODELS) decoding at the batches whose KV cache fits beside its weights (bf16, then int8), as many
    int8 serving slots of SERVING_SEQ positions as fit, the requests' (prompt, new tokens) `serving`, and the
    GPT-J-style train model (`GPTJ_TRAIN`) with as many layers as fit. `compute_dtype` stands in for "auto" (to plan
    for another device from this one, bf16 from a CPU); `train_seq` the train models' sequence length (default
    GPTJ_TRAIN's 2048); `paged_levels` the concurrent requests serving_paged times."""
    plan = HEADROOM * bytes_limit
    train_model = {**GPTJ_TRAIN, "seq": train_seq or GPTJ_TRAIN["seq"]}

    def fit(model: dict) -> int:
        return slots_that_fit(one_device_layout(model_config(model, compute_dtype=compute_dtype), device), plan)

    decode_model, serving_model = {**model, "seq": 256}, {**model, "seq": SERVING_SEQ, **INT8}
    clients, slots = 64, fit(serving_model)
    slots = max(1, min(clients, slots if slots < 8 else slots // 8 * 8))
    train_batch = 1  # a micro-batch of one 2048-token row: the more layers fit
    # 16 micro-batches a step, as the original GPT-J recipe: the optimizer's pass over the f32 params and Adam's
    # moments is then a sixteenth of a step's work (on a v5e at 10 layers: MFU 0.51 with 4, 0.55 with 8, 0.57 with 16)
    micro_batches = 16
    dtype = compute_dtype if compute_dtype != "auto" else for_devices([device]).compute_dtype
    layers = train_layers_that_fit(model_config({**train_model, "layers": 1}, compute_dtype=dtype), train_batch, plan)
    return Sizes(matmul_n=8192, copy_bytes=2 ** 30, train_model={**train_model, "layers": max(1, layers)},
                 train_batch=train_batch, train_micro_batches=micro_batches,
                 lora_model={**model, "seq": train_model["seq"]},
                 decode_model=decode_model, decode_batches=_batches(fit(decode_model)),
                 decode_int8_batches=_batches(fit({**decode_model, **INT8})), decode_context=128,
                 serving_model=serving_model, serving_slots=slots, serving_clients=clients, serving_one_at_a_time=4,
                 serving_prompt_len=serving[0], serving_new_tokens=serving[1], repeats=3,
                 **({"paged_levels": paged_levels} if paged_levels else {}))


def _batches(rows_that_fit: int) -> tuple[int, ...]:
    """1, 16 and 32 where they fit (the batches the decode goals name), and the two largest of DECODE_BATCHES that
    fit (1 alone when none does: its error then says so)."""
    fitting = [b for b in DECODE_BATCHES if b <= rows_that_fit]
    return tuple(sorted({1, *[b for b in (16, 32) if b in fitting], *fitting[-2:]}))


def decode_bytes(layout: Layout, n_slots: int) -> dict[str, int]:
    """What decoding on this layout holds on a device: the params in the decode programs' form, a KV cache of n_slots
    slots of cfg.seq positions, and WORKSPACE_BYTES for the programs' temporaries."""
    params = shard_bytes(abstract_params(layout))
    cache = shard_bytes(Programs(layout).abstract_cache(n_slots, [layout.cfg.seq]))
    return {"params": params, "kv_cache": cache, "workspace": WORKSPACE_BYTES,
            "total": params + cache + WORKSPACE_BYTES}


def slots_that_fit(layout: Layout, plan_bytes: float) -> int:
    """How many slots of cfg.seq positions fit beside the params in `plan_bytes` (`decode_bytes`)."""
    empty, one = decode_bytes(layout, 0)["total"], decode_bytes(layout, 1)["kv_cache"]
    return max(0, int((plan_bytes - empty) // one))


def param_count(cfg: config.Config) -> int:
    return sum(math.prod(s.shape) for s in jax.tree.leaves(table.param_shapes(cfg)))


def train_bytes(cfg: config.Config, batch: int) -> dict[str, int]:
    """Estimated device bytes of the full train step (remat, one micro-batch of `batch` rows at a time): 16 a param
    (f32 master, Adam's two moments, the gradient sum), 4 more a param outside the layers (a micro-batch's own
    embedding and head gradients before they are added), and the activations: each layer's input, kept for the
    backward, and one layer recomputed (its attention scores and probabilities and their gradient in f32, the MLP's
    four [T, F] arrays, a dozen [T, D] ones) and the head's f32 logits, their softmax less the targets and the
    gradient's operand, all per row. On one TPU v5e (10 layers, 1 row, 4 micro-batches): 14.55 GB, where the
    compiler said 14.77."""
    L, T, D, F, H, V = cfg.layers, cfg.seq, cfg.d_model, cfg.d_ff, cfg.n_heads, cfg.n_vocab
    c = gptj.precision(cfg).compute.itemsize
    params = param_count(cfg)
    outside = params - L * sum(math.prod(s.shape[1:]) for s in jax.tree.leaves(table.param_shapes(cfg)["layers"]))
    activations = batch * T * (L * D * c + 3 * H * T * 4 + 4 * F * c + 12 * D * c + 3 * V * 4)
    return {"params": params, "state": 16 * params + 4 * outside, "activations": activations,
            "total": 16 * params + 4 * outside + activations}


def train_layers_that_fit(cfg: config.Config, batch: int, plan_bytes: float, most: int = 256) -> int:
    """The most layers of cfg's shape whose train step (`train_bytes`) fits in `plan_bytes` (0 when none does)."""
    fitting = [n for n in range(1, most + 1)
               if train_bytes(dataclasses.replace(cfg, layers=n), batch)["total"] <= plan_bytes]
    return max(fitting, default=0)


# ----------------------------------------------------------------------------------------------- random models
def random_arrays(abstract: Any, seed: int = 0) -> Any:
    """Random arrays for a tree of sharded ShapeDtypeStructs, each leaf made by its own small program straight into
    its sharding and dtype: no device ever holds a stacked copy beside the tree, nor a leaf in another dtype. Float
    leaves uniform with spread WEIGHT_STD; int8 ones uniform in [-127, 127]; int8 weights' scales (model/quant.py)
    small positive floats that give them about the same spread. The numbers are a hash of each element's index
    (`_hashed_bits`), not jax.random's: XLA:TPU took 1-4 s to compile each leaf's threefry (GPT-J-6B's int8 decode
    params: 42 s), and a few integer operations compile at once."""
    flat, treedef = jax.tree_util.tree_flatten_with_path(abstract)
    leaves = [_leaf_program(_leaf_kind(path, s.dtype), s.shape, np.dtype(s.dtype), s.sharding)(np.uint32(seed + i))
              for i, (path, s) in enumerate(flat)]
    return jax.tree.unflatten(treedef, leaves)


def _leaf_kind(path: tuple, dtype: Any) -> str:
    """"int8", "scale" (an int8 weight's scale: model/quant.py's SCALE_AXES, the head's HEAD_SCALE_AXES, an int8
    LoRA base's `lora.SCALES`) or "float"."""
    if np.dtype(dtype) == np.int8:
        return "int8"
    names = [getattr(key, "key", None) for key in path]
    return "scale" if quant.is_scale(path) or lora.SCALES in names else "float"


def _hashed_bits(seed: jax.Array, shape: tuple) -> jax.Array:
    """32 well-mixed bits [shape] of each element's flat index and the seed (Wellons' lowbias32 hash), computed
    element by element, so a program writes them straight into its output."""
    index = jnp.zeros(shape, jnp.uint32)
    for axis, stride in enumerate(np.cumprod((1, *shape[::-1]))[-2::-1]):  # wraps past 2^32 elements: harmless
        index = index + lax.broadcasted_iota(jnp.uint32, shape, axis) * jnp.uint32(stride % 2 ** 32)
    x = index ^ (seed.astype(jnp.uint32) * jnp.uint32(0x9E3779B9))
    for shift, multiplier in ((16, 0x7FEB352D), (15, 0x846CA68B)):
        x = (x ^ (x >> shift)) * jnp.uint32(multiplier)
    return x ^ (x >> 16)


@functools.cache  # one program per leaf shape: a 6B model's 28 layers share theirs
def _leaf_program(kind: str, shape: tuple, dtype: np.dtype, sharding: jax.sharding.Sharding):
    def make(seed):
        bits = _hashed_bits(seed, shape)
        if kind == "int8":
            return jnp.maximum((bits >> 24).astype(jnp.int32) - 128, -127).astype(dtype)
        unit = (bits >> 8).astype(jnp.float32) * 2.0 ** -24  # uniform in [0, 1)
        if kind == "scale":
            return ((0.5 + unit) * (2 * WEIGHT_STD / 127)).astype(dtype)
        return ((2 * unit - 1) * (WEIGHT_STD * 3 ** 0.5)).astype(dtype)

    return jax.jit(make, out_shardings=sharding)


def random_decode_params(layout: Layout) -> dict:
    """Random params in the decode programs' form (`infer.params.abstract_params`: layers joined, in the compute
    dtype or int8 with scales), made leaf by leaf on the devices."""
    return random_arrays(abstract_params(layout))


# --------------------------------------------------------------------------------------------- peaks, compiles
class Peaks(NamedTuple):
    """The device's measured matmul rate and copy bandwidth, and its datasheet ones (None when not known)."""
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


# ------------------------------------------------------------------------------------------------------ decode
def decode_blocks(seq: int, positions: int) -> tuple[list[int], int]:
    """The serving cache's blocks for a context of `seq`, and how many of them a decode step reads to hold
    `positions` cached positions (and two more)."""
    blocks = block_sizes(seq, default_block(seq))
    return blocks, min(len(blocks), -(-(positions + 2) // blocks[0]))


def int8_products(policy, rows: int) -> str:
    """The int8 products a decode step of `rows` runs under this policy: its `int8_dot`, but XLA's ("compute") where
    the kernel's choice meets more rows than the kernel takes (`quant_kernel.MAX_ROWS`)."""
    return "compute" if policy.int8_dot == "kernel" and rows > quant_kernel.MAX_ROWS else policy.int8_dot


def decode_attention(policy, rows: int) -> str:
    """The attention a decode step of `rows` runs under this policy over the slot cache: "kernel" where
    `decode_kernel.runs`, else XLA's."""
    return "kernel" if decode_kernel.runs(policy, rows) else "xla"


def decode_records(layout: Layout, batches: tuple[int, ...], sizes: Sizes, peaks: Peaks,
                   profile_steps: int = 0) -> list[dict]:
    """Decode tokens/s of random weights (`random_decode_params`) at each batch against the bandwidth roofline: the
    bytes a step reads over the datasheet's bandwidth where it is known (else the measured copy's), and over the
    measured copy's too. A step almost only reads, where the copy reads and writes alike, so it can beat the copy
    (one TPU v5e: 695 GB/s against 645, fraction_of_measured_roofline 1.07): the datasheet's is the primary figure.
    One program per batch, compiled ahead (one after another: compiled at once on one TPU v5e's host they took as
    long in all), run from sizes.decode_context cached positions (`steady_step_s`). A batch that fails (out of
    memory, say) gives an "error" record and ends the section: the larger ones would too. With `profile_steps`, each
    batch's timed steps are followed by that many under the profiler, and a `decode_profile` record says what the
    device did in them (`common.device_op_times`)."""
    cfg = layout.cfg
    params = random_decode_params(layout)
    programs = Programs(layout)
    n_steps = 4 * sizes.repeats
    blocks, n_blocks = decode_blocks(cfg.seq, sizes.decode_context + 3 * n_steps + profile_steps)
    span = sum(blocks[:n_blocks])
    n_slots = max(batches)
    cache, last_N = programs.new_cache(n_slots, blocks), programs.new_slots(n_slots)
    zeros = np.zeros(n_slots, np.int32)
    precision = gptj.precision(cfg)
    # Every weight is read once a step, but of the embedding only a row per token; each row reads its keys and
    # values of the span in every layer.
    weight_bytes = sum(x.nbytes for x in jax.tree.leaves(params)) - params["embed"]["wte"].nbytes
    kv_bytes_per_row = cfg.layers * 2 * span * cfg.kv_heads * cfg.head_dim * precision.compute.itemsize
    sheet_bytes_per_s = peaks.datasheet_bytes_per_s or peaks.bytes_per_s
    base = {"bench": "decode", "family": cfg.family, "layers": cfg.layers, "d_model": cfg.d_model,
            "kv_heads": cfg.kv_heads, "dtype": precision.compute.name,
            "weight_dtype": precision.weights.name, "int8_dot": layout.policy.int8_dot, "cache_slots": n_slots,
            "cache_order": ",".join(map(str, layout.policy.cache_order)),
            "cached_positions_read": span}

    records = []
    for batch in batches:
        int8_dot = int8_products(layout.policy, batch)
        attention = decode_attention(layout.policy, batch)
        steps = Steps(zeros + sizes.decode_context, zeros, fill_sampling(n_slots, []))
        try:
            start = time.perf_counter()
            step = programs.lower("decode", params, cache, last_N, steps, rows=batch, n_blocks=n_blocks).compile()
            compile_s = time.perf_counter() - start
            state, _ = run_steps(step, params, (cache, last_N, steps), 1)
            state, step_s, fixed_s = steady_step_s(step, params, state, n_steps)
            if profile_steps:
                with tempfile.TemporaryDirectory() as trace_dir:
                    with jax.profiler.trace(trace_dir):
                        state, _ = run_steps(step, params, state, profile_steps)
                    profile = device_op_times(trace_dir, profile_steps)
                records.append({"bench": "decode_profile", "weight_dtype": precision.weights.name,
                                "int8_dot": int8_dot, "decode_attention": attention, "batch": batch,
                                "step_us": figure(step_s * 1e6),
                                **profile})
            cache, last_N, _ = state  # the steps donated the cache they were given: the next batch takes this one
        except Exception as e:  # the cache may be donated to the failed step: no later batch can run
            records.append({**base, "batch": batch, "error": error_text(e)})
            break
        bytes_per_step = weight_bytes + batch * kv_bytes_per_row
        roofline, measured_roofline = (batch * rate / bytes_per_step for rate in (sheet_bytes_per_s,
                                                                                  peaks.bytes_per_s))
        records.append({**base, "batch": batch, "int8_dot": int8_dot, "decode_attention": attention,
                        "compile_s": figure(compile_s),
                        "step_s": figure(step_s), **({"loop_fixed_s": figure(fixed_s)} if fixed_s > 0 else {}),
                        "tokens_per_s": figure(batch / step_s), "gb_read_per_step": figure(bytes_per_step / 1e9),
                        "read_gb_per_s": figure(bytes_per_step / step_s / 1e9),
                        "roofline_bandwidth": "datasheet" if peaks.datasheet_bytes_per_s else "measured_copy",
                        "roofline_tokens_per_s": figure(roofline),
                        "fraction_of_roofline": figure(batch / step_s / roofline),
                        "measured_roofline_tokens_per_s": figure(measured_roofline),
                        "fraction_of_measured_roofline": figure(batch / step_s / measured_roofline)})
    return records


def run_steps(step, params, state: tuple, n: int) -> tuple[tuple, float]:
    """n decode steps from state (cache, last_N, steps), dispatched back to back and waited for once: the state
    after them, and the seconds."""
    cache, last_N, steps = state
    start = time.perf_counter()
    for _ in range(n):
        _, _, last_N, steps, cache = step(params, cache, last_N, steps)
    jax.block_until_ready(last_N)
    return (cache, last_N, steps), time.perf_counter() - start


def steady_step_s(step, params, state: tuple, n: int) -> tuple[tuple, float, float]:
    """The steady decode step, the rate of a long generation: n and then 2n steps (`run_steps`), the difference over
    n, so a loop's fixed cost (its first dispatch after a wait, the final wait: 13-15 ms on one TPU v5e's host, where
    a 12-step loop's mean read int8 batch 1 at 9.66 ms a step for a steady 8.34) cancels. Returns the state after,
    the step's seconds and that fixed cost (0 where the loops show none). Where the fixed cost is not below n steps'
    time (a tiny model on a busy host) the difference is mostly noise, and the longer loop's mean is the figure."""
    state, short_s = run_steps(step, params, state, n)
    state, long_s = run_steps(step, params, state, 2 * n)
    step_s = (long_s - short_s) / n if long_s > 1.5 * short_s else long_s / (2 * n)
    return state, step_s, max(0.0, short_s - n * step_s)


def error_text(e: BaseException) -> str:
    """An exception as one line of at most 300 characters, for an "error" record."""
    return f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:300]}"
