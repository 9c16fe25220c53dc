"""One command that measures the device JAX finds (cpu, gpu, tpu) for the whole stack, in JSON lines on stdout.

- device: the measured matmul peak (bf16 on accelerators, f32 on CPU) and memory read bandwidth, next to the
  datasheet figures where the device is known (DATASHEET);
- train: tokens/s and MFU (against both peaks) of the train step of a GPT-J-style ~1.3B model (24 layers, d_model
  2048, 16 heads, seq 2048, the compute dtype, f32 master params and Adam, remat);
- train_lora: the GPT-J-6B LoRA step (rank 16, base bf16);
- decode: GPT-J-6B (random weights, compute dtype) tokens/s at batch 1, 16, 64 and 256 against the bandwidth
  roofline (weight bytes + KV-cache bytes read per step / measured bandwidth); decode_int8: the same with the
  layers' weights in int8 (model/quant.py);
- serving: the continuous-batching engine at 64 concurrent requests against one at a time: tokens/s and time to
  first token;
- compile: the compile seconds of every program each section ran.

Sizes are chosen by backend (SIZES); `--tiny` makes every model tiny and compiles without XLA's costly passes
(CPU, the test suite: its figures only show that everything runs). A section that fails
(out of device memory, say) emits an "error" record and the suite goes on; the whole suite is sized to take at
most 6 minutes on one H200. One device is used.

    python bench/device_suite.py [--only device,train,train_lora,decode,decode_int8,serving] [--tiny]
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax
import jax.numpy as jnp
import numpy as np

from bench.common import emit, figure, matmul_peak_flop_per_s, read_bandwidth_bytes_per_s, train_flops_per_token
from bench.suite_parts import (CompileLog, Peaks, decode_records, one_device_layout, random_decode_params,
                               serving_records)
from mesh_transformer.model import table
from mesh_transformer import config
from mesh_transformer.platforms import platform_setup
from mesh_transformer.model import gptj
from mesh_transformer.parallel.layout import make_layout
from mesh_transformer.parallel.mesh import make_dp_mp
from mesh_transformer.train import optim
from mesh_transformer.train import state as state_lib

# (device_kind contains, dense bf16 TFLOP/s, memory TB/s), first match wins: the vendors' datasheets.
DATASHEET = [("H200", 989, 4.8), ("H100 PCIe", 756, 2.0), ("H100", 989, 3.35), ("B200", 2250, 8.0),
             ("A100", 312, 2.0), ("L40S", 362, 0.86), ("TPU v4", 275, 1.2), ("TPU v5 lite", 197, 0.82),
             ("TPU v5e", 197, 0.82), ("TPU v5p", 459, 2.76), ("TPU v5", 459, 2.76), ("TPU v6 lite", 918, 1.64)]

GPTJ_6B = {"layers": 28, "d_model": 4096, "n_heads": 16, "n_vocab": 50400, "pe_rotary_dims": 64}
GPTJ_1P3B = {"layers": 24, "d_model": 2048, "n_heads": 16, "n_vocab": 50400, "pe_rotary_dims": 64, "seq": 2048}
BENCH_MODEL = {"layers": 6, "d_model": 512, "n_heads": 8, "n_vocab": 50400, "pe_rotary_dims": 32, "seq": 256}
TINY_MODEL = {"layers": 2, "d_model": 64, "n_heads": 4, "n_vocab": 256, "pe_rotary_dims": 8, "seq": 64}


@dataclasses.dataclass(frozen=True)
class Sizes:
    """How big each section runs on one backend."""
    matmul_n: int
    bandwidth_bytes: int
    train_model: dict
    train_batch: int
    lora_model: dict
    decode_model: dict  # its seq is the cache length
    decode_batches: tuple[int, ...]
    decode_context: int  # positions already in the cache when the timed decode steps start
    serving_clients: int
    serving_one_at_a_time: int  # requests timed one after another
    serving_prompt_len: int
    serving_new_tokens: int
    repeats: int  # timed train steps, and decode steps per batch x 4


ACCELERATOR = Sizes(8192, 2 ** 30, GPTJ_1P3B, 8, {**GPTJ_6B, "seq": 2048}, {**GPTJ_6B, "seq": 256},
                    (1, 16, 64, 256), 128, 64, 8, 32, 64, 5)
SIZES = {
    "gpu": ACCELERATOR,
    "tpu": ACCELERATOR,
    "cpu": Sizes(2048, 2 ** 29, BENCH_MODEL, 4, BENCH_MODEL, BENCH_MODEL, (1, 16, 64, 256), 128, 64, 4, 32, 16, 3),
    "tiny": Sizes(256, 2 ** 24, TINY_MODEL, 2, TINY_MODEL, TINY_MODEL, (1, 4), 16, 8, 2, 8, 4, 2),
}
# --tiny only shows that everything runs, so it compiles without XLA's costly backend passes (half the time).
TINY_XLA_FLAGS = ("--xla_backend_optimization_level=0", "--xla_llvm_disable_expensive_passes=true")
SECTIONS = ("device", "train", "train_lora", "decode", "decode_int8", "serving")


def datasheet(device: jax.Device) -> tuple[float | None, float | None]:
    """(bf16 FLOP/s, bytes/s) of the device's datasheet, or (None, None) for one not in DATASHEET."""
    kind = getattr(device, "device_kind", "")
    for name, tflop_per_s, tb_per_s in DATASHEET:
        if name.lower() in kind.lower():
            return tflop_per_s * 1e12, tb_per_s * 1e12
    return None, None


def measure_device(device: jax.Device, sizes: Sizes) -> tuple[dict, Peaks]:
    """The device record, and the peaks the other sections are measured against."""
    dtype = jnp.float32 if device.platform == "cpu" else jnp.bfloat16
    flop_per_s = matmul_peak_flop_per_s(sizes.matmul_n, dtype, device)
    bytes_per_s = read_bandwidth_bytes_per_s(sizes.bandwidth_bytes, device)
    sheet_flop_per_s, sheet_bytes_per_s = datasheet(device)
    record = {"bench": "device", "platform": device.platform, "device_kind": device.device_kind,
              "devices_present": jax.device_count(), "matmul_dtype": jnp.dtype(dtype).name,
              "matmul_n": sizes.matmul_n, "measured_tflop_per_s": figure(flop_per_s / 1e12),
              "measured_read_gb_per_s": figure(bytes_per_s / 1e9), "jax": jax.__version__}
    if sheet_flop_per_s:
        record.update(datasheet_bf16_tflop_per_s=sheet_flop_per_s / 1e12, datasheet_tb_per_s=sheet_bytes_per_s / 1e12,
                      fraction_of_datasheet_flops=figure(flop_per_s / sheet_flop_per_s),
                      fraction_of_datasheet_bandwidth=figure(bytes_per_s / sheet_bytes_per_s))
    return record, Peaks(flop_per_s, bytes_per_s, sheet_flop_per_s, sheet_bytes_per_s)


def model_config(model: dict, **overrides) -> config.Config:
    """A single-device config of a model shape (`compute_dtype` auto unless overridden)."""
    return config.from_dict({**model, "cores_per_replica": 1, "warmup_steps": 0, **overrides})


def time_steps_s(step, state, batch, repeats: int, *extra) -> tuple[float, dict]:
    """Best seconds per train step over `repeats` (after one untimed), and the state after them."""
    times = []
    for _ in range(repeats + 1):
        start = time.perf_counter()
        state, metrics = step(state, batch, *extra)
        jax.block_until_ready(metrics)
        times.append(time.perf_counter() - start)
    return min(times[1:]), state


def train_record(name: str, cfg: config.Config, batch: int, repeats: int, peaks: Peaks, device: jax.Device,
                 flops_per_token: float) -> dict:
    """Tokens/s and MFU of the one train step on this config (with LoRA: over a random base in base_dtype),
    compiled ahead and timed."""
    layout = make_layout(cfg, mesh=make_dp_mp(1, 1, [device]))
    opt = optim.make_optimizer(cfg)
    state = state_lib.init_train_state(layout, opt, jax.random.PRNGKey(0))
    base = {}
    if cfg.lora_rank:
        dtype = gptj.precision(cfg).frozen
        base = jax.jit(lambda key: jax.tree.map(lambda x: x.astype(dtype), table.init_params(cfg, key)),
                       out_shardings=layout.param_shardings())(jax.random.PRNGKey(1))
    tokens = np.random.default_rng(0).integers(0, cfg.n_vocab, (1, batch, cfg.seq + 1)).astype(np.int32)
    tokens = jax.device_put(tokens, layout.batch_sharding())
    start = time.perf_counter()
    if base:  # as the trainer runs LoRA: the base in the layouts the step's compiler chose
        step, formats = state_lib.compile_train_step(layout, opt, optim.lr_schedule(cfg))
        base = state_lib.place_frozen(base, formats)
    else:
        step = state_lib.make_train_step(layout, opt, optim.lr_schedule(cfg)).lower(state, tokens, base).compile()
    compile_s = time.perf_counter() - start
    step_s, _ = time_steps_s(step, state, tokens, repeats, base)
    tokens_per_s = batch * cfg.seq / step_s
    record = {"bench": name, "layers": cfg.layers, "d_model": cfg.d_model, "seq": cfg.seq, "batch": batch,
              "compute_dtype": gptj.precision(cfg).compute.name, "remat": cfg.remat,
              "join_projections": cfg.join_projections, "compile_s": figure(compile_s),
              "step_s": figure(step_s), "tokens_per_s": figure(tokens_per_s),
              "model_tflop_per_s": figure(tokens_per_s * flops_per_token / 1e12),
              "mfu_of_measured_peak": figure(tokens_per_s * flops_per_token / peaks.flop_per_s)}
    if cfg.lora_rank:
        record.update(lora_rank=cfg.lora_rank, base_dtype=cfg.base_dtype)
    if peaks.datasheet_flop_per_s:
        record["mfu_of_datasheet_peak"] = figure(tokens_per_s * flops_per_token / peaks.datasheet_flop_per_s)
    return record


def train_lora_record(sizes: Sizes, peaks: Peaks, device: jax.Device) -> dict:
    """The GPT-J-6B LoRA step (rank 16, all targets, base bf16, remat). Its FLOPs: the full step's less the base's
    weight gradients (a third of the matmul work), adapters' own work ignored."""
    cfg = model_config(sizes.lora_model, remat=True, lora_rank=16, base_dtype="bfloat16")
    full = train_flops_per_token(cfg)
    matmul_params = cfg.layers * (4 * cfg.d_model ** 2 + 2 * cfg.d_model * cfg.d_ff) + cfg.d_model * cfg.n_vocab
    return train_record("train_lora_6b", cfg, 1, sizes.repeats, peaks, device, full - 2 * matmul_params)


def run_section(name: str, device: jax.Device, sizes: Sizes, state: dict) -> list[dict]:
    """The records of one section; `state` carries the peaks from the device section to the others."""
    if name == "device":
        record, state["peaks"] = measure_device(device, sizes)
        return [record]
    peaks = state.get("peaks") or measure_device(device, sizes)[1]
    if name == "train":
        cfg = model_config(sizes.train_model, remat=True)
        return [train_record("train_1p3b", cfg, sizes.train_batch, sizes.repeats, peaks, device,
                             train_flops_per_token(cfg))]
    if name == "train_lora":
        return [train_lora_record(sizes, peaks, device)]
    if name == "decode_int8":  # int8 weights (model/quant.py): the bytes a step reads, about halved
        layout = one_device_layout(model_config(sizes.decode_model, weight_dtype="int8"), device)
        return decode_records(layout, random_decode_params(layout), sizes, peaks)
    if name not in ("decode", "serving"):
        raise ValueError(name)
    layout = one_device_layout(model_config(sizes.decode_model), device)
    if "decode_params" not in state:  # made once for decode and serving: on a 6B model that is worth it
        state["decode_params"] = random_decode_params(layout)
    if name == "decode":
        return decode_records(layout, state["decode_params"], sizes, peaks)
    return serving_records(layout, state["decode_params"], sizes)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default=",".join(SECTIONS), help=f"sections to run, of {','.join(SECTIONS)}")
    parser.add_argument("--tiny", action="store_true", help="tiny models and sizes (CPU, the test suite)")
    args = parser.parse_args()
    sections = [s.strip() for s in args.only.split(",") if s.strip()]
    unknown = sorted(set(sections) - set(SECTIONS))
    if unknown:
        parser.error(f"unknown section(s) {', '.join(unknown)}; choose from {', '.join(SECTIONS)}")
    if args.tiny:  # before JAX starts its backend, which reads XLA_FLAGS
        os.environ["XLA_FLAGS"] = " ".join([os.environ.get("XLA_FLAGS", ""), *TINY_XLA_FLAGS]).strip()
    device = jax.devices()[0]
    sizes = SIZES["tiny" if args.tiny else device.platform]
    compiles, state = CompileLog(), {}
    for name in sections:
        start = time.perf_counter()
        compiles.start()
        try:
            records = run_section(name, device, sizes, state)
        except Exception as e:  # one failed section (out of memory, say) must not cost the others their figures
            records = [{"bench": name, "error": f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"}]
            traceback.print_exc(file=sys.stderr)
        for record in records:
            emit(**record)
        compiled = compiles.summary()
        if compiled:
            emit(bench="compile", section=name, section_wall_s=figure(time.perf_counter() - start), **compiled)


if __name__ == "__main__":
    platform_setup()
    main()
