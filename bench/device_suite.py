"""One command that measures the device JAX finds (cpu, gpu, tpu) for the whole stack, in JSON lines on stdout (and
appended to `--out` too).

- meta (first): the git commit, the date (UTC), platform, device kind, JAX version, device memory and the sizes
  the sections run at;
- device: the measured matmul peak (bf16 on accelerators, f32 on CPU) and memory bandwidth (a copy: bytes read and
  written), next to the datasheet figures where the device is known (`targets.chip_of`);
- train: tokens/s and MFU (against both peaks) of the train step of a GPT-J-style model (d_model 2048, 16 heads,
  seq 2048, the compute dtype, f32 master params and Adam, remat) with as many layers as fit the device;
- train_lora: the GPT-J-6B LoRA step (rank 16, base bf16);
- decode: GPT-J-6B (random weights, compute dtype) tokens/s of the steady step at 1, 16, 32 and the largest batches
  whose KV cache fits, against the bandwidth roofline (weight bytes + KV-cache bytes read per step over the
  datasheet's bandwidth, and over the measured one); decode_int8: the same with the layers' weights in int8
  (model/quant.py); with `--profile-steps N`, also what the device did in N traced steps (decode_profile);
- serving: the continuous-batching engine over GPT-J-6B's int8 weights at its whole context (2048), with as many
  slots as fit, at 64 concurrent requests against one at a time: tokens/s and time to first token;
- serving_paged: the engine over a paged int8 KV cache (int8 weights), a slot per client and the pages
  device_serve.py takes by default (serve/sizing.py): tokens/s and time to first token at 1, 8, 32, 64 and 128
  concurrent requests, under each page policy (`--page-policies`: pages taken as tokens are made, preempting where
  they run out; or all a request's pages from its start, --kv-reserve), and how many it holds in flight beside the
  slot engine's slots;
- serving_adapters: that engine with 8 random rank-16 LoRA adapters in its slots (every projection), the concurrent
  requests spread over them against all on the base (medians of 3 alternating rounds), and one more adapter loaded
  from a PEFT directory while it serves (bench/suite_adapters.py);
- compile and memory, after each section: the compile seconds of every program it ran; the arrays still alive
  after it (none should be) and the device's memory in use.

On an accelerator the sizes are fitted to the device's memory (`suite_parts.device_sizes`); the CPU has fixed
ones (`suite_parts.SIZES`); `--tiny` makes every model tiny and compiles without XLA's costly passes (CPU, the test
suite: its figures only show that everything runs). A section that fails (out of device memory, say) emits an
"error" record and the suite goes on; the whole suite is sized to take about 6 minutes on one TPU v5e chip. One
device is used. bench/results/ holds runs on real devices.

    python bench/device_suite.py [--only device,train,...] [--tiny] [--out bench/results/KIND-DATE.jsonl]

For an A/B, a flag replaces one of the platform policy's choices (`--attention`, `--paged-attention`, `--int8-dot`,
`--cache-order`, `--splash-block`) or of the sizes and configs (`--page-size`, `--train-seq`, `--train-layers`,
`--train-set KEY=VALUE`); the records carry what ran.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import gc
import json
import os
import platform
import subprocess
import sys
import time
import traceback
from typing import NamedTuple

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax
import jax.numpy as jnp
import jaxlib
import numpy as np

from bench.common import (copy_bandwidth_bytes_per_s, datasheet, emit, figure, matmul_peak_flop_per_s,
                          train_flops_per_token)
from bench.suite_adapters import serving_adapters_records
from bench.suite_parts import (MODELS, SIZES, CompileLog, Peaks, Sizes, decode_records, device_sizes, error_text,
                               model_config, one_device_layout, param_count, random_arrays, train_bytes)
from bench.suite_serving import PAGE, PAGE_POLICIES, serving_paged_records, serving_records
from mesh_transformer import config
from mesh_transformer.estimate import layer_matrix_params
from mesh_transformer.flags import MEMORY_FRACTION
from mesh_transformer.model import gptj
from mesh_transformer.model import attention as attention_kernels
from mesh_transformer.parallel.layout import make_layout
from mesh_transformer.platforms import platform_setup
from mesh_transformer.train import optim
from mesh_transformer.train import state as state_lib

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_BYTES_LIMIT = 16 * 2 ** 30  # an accelerator that does not say how much memory it has is planned as 16 GiB
# --tiny only shows that everything runs, so it compiles without XLA's costly backend passes (half the time).
TINY_XLA_FLAGS = ("--xla_backend_optimization_level=0", "--xla_llvm_disable_expensive_passes=true")
SECTIONS = ("device", "train", "train_lora", "decode", "decode_int8", "serving", "serving_paged", "serving_adapters")


def memory_stats(device: jax.Device) -> dict:
    """The device's allocator figures (bytes_limit, bytes_in_use, peak_bytes_in_use...), {} where it has none."""
    try:
        return device.memory_stats() or {}
    except Exception:  # backends without them raise rather than return None
        return {}


def sizes_for(device: jax.Device, tiny: bool, train_seq: int | None = None, model: str = "gptj_6b",
              serving: tuple[int, int] | None = None, paged_levels: tuple[int, ...] | None = None) -> Sizes:
    """The sizes the sections run at: fixed on the CPU and with --tiny, else fitted to the device's memory for
    `model` (of MODELS); with `train_seq`, the train sections' rows that long; with `serving`, the serving sections'
    (prompt, new tokens); with `paged_levels`, the concurrent requests serving_paged times. On the CPU and with
    --tiny, another model than GPT-J-6B takes the small models' shapes with its family's keys."""
    if tiny or device.platform == "cpu":
        sizes = SIZES["tiny" if tiny else "cpu"]
        family = {k: v for k, v in MODELS[model].items() if k in ("family", "rotary_base")}
        if family:
            n_heads = sizes.decode_model["n_heads"]
            shaped = {**family, "n_kv_heads": n_heads // 2, "pe_rotary_dims": sizes.decode_model["d_model"] // n_heads}
            sizes = dataclasses.replace(sizes, **{key: {**getattr(sizes, key), **shaped} for key in (
                "lora_model", "decode_model", "serving_model")})
        if train_seq:
            sizes = dataclasses.replace(sizes, train_model={**sizes.train_model, "seq": train_seq},
                                        lora_model={**sizes.lora_model, "seq": train_seq})
        if serving:
            sizes = dataclasses.replace(sizes, serving_prompt_len=serving[0], serving_new_tokens=serving[1])
        return dataclasses.replace(sizes, paged_levels=paged_levels) if paged_levels else sizes
    return device_sizes(device, memory_stats(device).get("bytes_limit", DEFAULT_BYTES_LIMIT), train_seq=train_seq,
                        model=MODELS[model], serving=serving or (256, 128), paged_levels=paged_levels)


def git_commit() -> tuple[str, bool | None]:
    """(HEAD's commit, whether tracked files differ from it), or ("unknown", None) outside a git checkout; MTJ_COMMIT
    where it is set (a copied tree whose .git is not the commit that made it, as the device tool's is)."""
    if os.environ.get("MTJ_COMMIT"):
        return os.environ["MTJ_COMMIT"], None
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=REPO_ROOT, capture_output=True, text=True, check=True,
                              timeout=30).stdout.strip()

    try:
        return git("rev-parse", "HEAD"), bool(git("status", "--porcelain", "--untracked-files=no"))
    except (OSError, subprocess.SubprocessError):
        return "unknown", None


def meta_record(device: jax.Device, sizes: Sizes, sections: list[str]) -> dict:
    commit, dirty = git_commit()
    return {"bench": "meta", "git_commit": commit, "git_dirty": dirty,
            "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "platform": device.platform, "device_kind": device.device_kind, "devices_present": jax.device_count(),
            "bytes_limit": memory_stats(device).get("bytes_limit"), "jax": jax.__version__,
            "jaxlib": jaxlib.__version__, "python": platform.python_version(), "sections": sections,
            "sizes": dataclasses.asdict(sizes)}


def measure_device(device: jax.Device, sizes: Sizes) -> tuple[dict, Peaks]:
    """The device record, and the peaks the other sections are measured against."""
    dtype = jnp.float32 if device.platform == "cpu" else jnp.bfloat16
    flop_per_s = matmul_peak_flop_per_s(sizes.matmul_n, dtype, device)
    bytes_per_s = copy_bandwidth_bytes_per_s(sizes.copy_bytes, device)
    sheet_flop_per_s, sheet_bytes_per_s = datasheet(device)
    record = {"bench": "device", "platform": device.platform, "device_kind": device.device_kind,
              "matmul_dtype": jnp.dtype(dtype).name, "matmul_n": sizes.matmul_n,
              "measured_tflop_per_s": figure(flop_per_s / 1e12), "copy_gb": figure(sizes.copy_bytes / 1e9),
              "measured_copy_gb_per_s": figure(bytes_per_s / 1e9)}
    if sheet_flop_per_s:
        record.update(datasheet_bf16_tflop_per_s=sheet_flop_per_s / 1e12, datasheet_gb_per_s=sheet_bytes_per_s / 1e9,
                      fraction_of_datasheet_flops=figure(flop_per_s / sheet_flop_per_s),
                      fraction_of_datasheet_bandwidth=figure(bytes_per_s / sheet_bytes_per_s))
    return record, Peaks(flop_per_s, bytes_per_s, sheet_flop_per_s, sheet_bytes_per_s)


def time_steps_s(step, state, batch, repeats: int, *extra) -> float:
    """Best seconds per train step over `repeats` (after one untimed)."""
    times = []
    for _ in range(repeats + 1):
        start = time.perf_counter()
        state, metrics = step(state, batch, *extra)
        jax.block_until_ready(metrics)
        times.append(time.perf_counter() - start)
    return min(times[1:])


def compiled_bytes(compiled) -> int:
    """A compiled program's device bytes by the compiler: arguments, outputs and temporaries, less what outputs
    reuse of the arguments."""
    mem = compiled.memory_analysis()
    return (mem.argument_size_in_bytes + mem.output_size_in_bytes + mem.temp_size_in_bytes
            - mem.alias_size_in_bytes)


def train_record(name: str, cfg, repeats: int, peaks: Peaks, device: jax.Device, flops_per_token: float,
                 attention: str | None = None) -> dict:
    """Tokens/s and MFU of the one train step on this config (with LoRA: over a random base in base_dtype), compiled
    ahead from the arguments' shapes, then run on random params made leaf by leaf (`random_arrays`). `attention`
    replaces the platform policy's training attention, for an A/B: both sides run the GSPMD layout on the
    device (parallelism "dp"), as without it, where the TPU policy's splash runs."""
    cfg = dataclasses.replace(cfg, parallelism="dp")
    layout = make_layout(cfg, devices=[device])
    if attention:
        layout = layout.with_attention(attention)
    cfg = layout.cfg  # "auto" resolved for the device
    opt = optim.make_optimizer(cfg)
    abstract_state, abstract_tokens, abstract_base = state_lib.abstract_step_args(layout, opt)
    start = time.perf_counter()
    if cfg.lora_rank:  # as the trainer runs LoRA: the base in the layouts the step's compiler chose
        step, formats = state_lib.compile_train_step(layout, opt, optim.lr_schedule(cfg))
    else:
        step = state_lib.make_train_step(layout, opt, optim.lr_schedule(cfg)).lower(
            abstract_state, abstract_tokens, abstract_base).compile(compiler_options=layout.policy.compiler_options())
    compile_s = time.perf_counter() - start
    params = random_arrays(abstract_state["params"], seed=1)
    state = {"step": jax.device_put(jnp.zeros((), jnp.int32), layout.replicated), "params": params,
             "opt_state": state_lib.init_opt_state(layout, params, opt)}
    del params  # the state's now, donated to the step
    base = state_lib.place_frozen(random_arrays(abstract_base, seed=1000), formats) if cfg.lora_rank else {}
    tokens = np.random.default_rng(0).integers(0, cfg.n_vocab, abstract_tokens.shape).astype(np.int32)
    tokens = jax.device_put(tokens, abstract_tokens.sharding)
    step_s = time_steps_s(step, state, tokens, repeats, base)
    batch, micro_batches = cfg.per_replica_batch, cfg.gradient_accumulation_steps
    tokens_per_s = micro_batches * batch * cfg.seq / step_s
    precision = gptj.precision(cfg)
    record = {"bench": name, "layers": cfg.layers, "d_model": cfg.d_model, "seq": cfg.seq, "batch": batch,
              "micro_batches": micro_batches, "params": param_count(cfg), "compute_dtype": precision.compute.name,
              "param_dtype": precision.params.name, "remat": cfg.remat, "remat_policy": cfg.remat_policy,
              "join_projections": cfg.join_projections,
              "attention": layout.policy.attention, "parallelism": cfg.parallelism,
              "splash_block": attention_kernels.SPLASH_BLOCK if layout.policy.attention == "splash" else None,
              "compile_s": figure(compile_s), "compiled_gb": figure(compiled_bytes(step) / 1e9),
              "step_s": figure(step_s), "tokens_per_s": figure(tokens_per_s),
              "model_tflop_per_s": figure(tokens_per_s * flops_per_token / 1e12),
              "mfu_of_measured_peak": figure(tokens_per_s * flops_per_token / peaks.flop_per_s)}
    if cfg.lora_rank:
        record.update(lora_rank=cfg.lora_rank, base_dtype=cfg.base_dtype)
    else:
        record["estimated_gb"] = figure(train_bytes(cfg, batch)["total"] / 1e9)
    if peaks.datasheet_flop_per_s:
        record["mfu_of_datasheet_peak"] = figure(tokens_per_s * flops_per_token / peaks.datasheet_flop_per_s)
    return record


def train_lora_record(sizes: Sizes, peaks: Peaks, device: jax.Device, attention: str | None = None,
                      train_set: dict | None = None) -> dict:
    """The LoRA step of the sizes' model (GPT-J-6B unless --model: rank 16, all targets, base bf16, remat;
    `train_set` replaces config keys). Its FLOPs: the full step's less the base's weight gradients (a third of the
    matmul work), adapters' own work ignored."""
    cfg = model_config(sizes.lora_model, **{"remat": True, "lora_rank": 16, "base_dtype": "bfloat16",
                                            "per_replica_batch": 1, **(train_set or {})})
    full = train_flops_per_token(cfg)
    matmul_params = layer_matrix_params(cfg) + cfg.d_model * cfg.n_vocab
    record = train_record("train_lora_6b" if cfg.family == "gptj" else f"train_lora_{cfg.family}", cfg,
                          sizes.repeats, peaks, device, full - 2 * matmul_params, attention)
    return {**record, "family": cfg.family, "kv_heads": cfg.kv_heads, "d_ff": cfg.d_ff, "n_vocab": cfg.n_vocab}


class Choices(NamedTuple):
    """What an A/B replaces: the platform policy's choices (None: the policy's own), the paged cache's page size,
    the train sections' config keys, and how many decode steps a batch are traced."""
    paged_attention: str | None = None
    attention: str | None = None
    decode_attention: str | None = None
    int8_dot: str | None = None
    cache_order: tuple | None = None
    page_size: int = PAGE
    train_set: dict | None = None
    profile_steps: int = 0
    memory_fraction: float = MEMORY_FRACTION
    page_policies: tuple[str, ...] = PAGE_POLICIES


def with_choices(layout, choices: Choices):
    """The layout with the platform policy's inference choices replaced where `choices` gives them."""
    given = {key: getattr(choices, key) for key in ("paged_attention", "decode_attention", "int8_dot", "cache_order")
             if getattr(choices, key)}
    return dataclasses.replace(layout, policy=dataclasses.replace(layout.policy, **given)) if given else layout


def run_section(name: str, device: jax.Device, sizes: Sizes, peaks: Peaks | None,
                choices: Choices = Choices()) -> tuple[list[dict], Peaks]:
    """The records of one section, and the peaks the others are measured against (the device section's, else
    measured here), with an A/B's `choices`."""
    if name == "device":
        record, peaks = measure_device(device, sizes)
        return [record], peaks
    if name == "serving":
        layout = one_device_layout(model_config(sizes.serving_model), device)
        return serving_records(with_choices(layout, choices), sizes), peaks
    if name == "serving_paged":  # int8 weights and an int8 paged cache
        layout = one_device_layout(model_config(sizes.serving_model, kv_cache_dtype="int8"), device)
        return serving_paged_records(with_choices(layout, choices), sizes, choices.page_size,
                                     memory_stats(device).get("bytes_limit", DEFAULT_BYTES_LIMIT),
                                     choices.memory_fraction, choices.profile_steps, choices.page_policies), peaks
    if name == "serving_adapters":
        layout = one_device_layout(model_config(sizes.serving_model, kv_cache_dtype="int8"), device)
        return serving_adapters_records(with_choices(layout, choices), sizes, choices.page_size), peaks
    peaks = peaks or measure_device(device, sizes)[1]  # the sections below are measured against them
    if name == "train":
        cfg = model_config(sizes.train_model, **{"remat": True, "per_replica_batch": sizes.train_batch,
                                                 "gradient_accumulation_steps": sizes.train_micro_batches,
                                                 **(choices.train_set or {})})
        return [train_record("train", cfg, sizes.repeats, peaks, device, train_flops_per_token(cfg),
                             choices.attention)], peaks
    if name == "train_lora":
        return [train_lora_record(sizes, peaks, device, choices.attention, choices.train_set)], peaks
    if name in ("decode", "decode_int8"):  # decode_int8: int8 weights (model/quant.py), the bytes a step about halved
        int8 = {"weight_dtype": "int8"} if name == "decode_int8" else {}
        layout = with_choices(one_device_layout(model_config(sizes.decode_model, **int8), device), choices)
        batches = sizes.decode_int8_batches if int8 else sizes.decode_batches
        return decode_records(layout, batches, sizes, peaks, choices.profile_steps), peaks
    raise ValueError(name)


def memory_record(name: str, device: jax.Device) -> dict:
    """What is left on the device after a section, its programs and references dropped: the arrays still alive
    (none should be) and the allocator's bytes in use and peak so far, where the device reports them."""
    gc.collect()  # the engine's thread and closures hold params in reference cycles
    jax.clear_caches()
    attention_kernels.clear_kernels()  # splash's mask tables
    arrays = jax.live_arrays()
    stats = memory_stats(device)
    record = {"bench": "memory", "section": name, "live_arrays": len(arrays),
              "live_bytes": sum(x.nbytes for x in arrays)}
    for key in ("bytes_in_use", "peak_bytes_in_use"):
        if key in stats:
            record[key] = stats[key]
    return record


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default=",".join(SECTIONS), help=f"sections to run, of {','.join(SECTIONS)}")
    parser.add_argument("--tiny", action="store_true", help="tiny models and sizes (CPU, the test suite)")
    parser.add_argument("--out", help="also append every JSON line to this file (bench/results/, say)")
    parser.add_argument("--paged-attention", choices=("gather", "kernel"), default=None,
                        help="serving_paged's decode attention, for an A/B (default: the platform policy's)")
    parser.add_argument("--decode-attention", choices=("xla", "kernel"), default=None,
                        help="the decode sections' attention over the slot cache, for an A/B (default: the platform "
                             "policy's)")
    parser.add_argument("--page-size", type=int, default=PAGE, help=f"serving_paged's tokens per page (default {PAGE})")
    parser.add_argument("--attention", choices=("xla", "splash"), default=None,
                        help="the train sections' attention, for an A/B (default: the platform policy's)")
    parser.add_argument("--int8-dot", choices=("compute", "kernel"), default=None,
                        help="int8 weights' products in decode_int8, serving and serving_paged, for an A/B "
                             "(default: the platform policy's)")
    parser.add_argument("--train-set", action="append", default=[], metavar="KEY=VALUE",
                        help="a config key of both train sections' models, for an A/B (per_replica_batch=2, "
                             "remat=false, ...; repeatable)")
    parser.add_argument("--splash-block", type=int, default=None,
                        help=f"splash attention's query and key blocks, for an A/B (default "
                             f"{attention_kernels.SPLASH_BLOCK}; a multiple of 128)")
    parser.add_argument("--train-seq", type=int, default=None,
                        help="the train sections' sequence length (default 2048; the train model's layers refitted)")
    parser.add_argument("--train-layers", type=int, default=None,
                        help="the train model's layers, for an A/B at one size (default: as many as fit)")
    parser.add_argument("--model", choices=tuple(MODELS), default="gptj_6b",
                        help="the model shape of train_lora, decode, decode_int8 and the serving sections (default "
                             "gptj_6b; the CPU and --tiny take their small shapes with its family)")
    parser.add_argument("--serving-shape", default=None, metavar="PROMPT,NEW",
                        help="the serving sections' prompt tokens and new tokens a request (default 256,128; "
                             "JetStream's benchmark: 1024,1024)")
    parser.add_argument("--concurrent", default=None, metavar="N,...",
                        help="the concurrent requests serving_paged times (default 64,1,8,32,128; those up to twice "
                             "its 64 slots)")
    parser.add_argument("--profile-steps", type=int, default=0,
                        help="the decode sections also trace this many steps a batch and say what the device did in "
                             "them (a decode_profile record: its ops' time a step, by op and by kind); serving_paged "
                             "traces about this many decode steps of a pass more at its last level (serving_profile)")
    parser.add_argument("--memory-fraction", type=float, default=MEMORY_FRACTION,
                        help=f"serving_paged's pages: what fits this share of the device, as device_serve.py's flag "
                             f"(default {MEMORY_FRACTION})")
    parser.add_argument("--page-policies", default=",".join(PAGE_POLICIES), metavar="grow,reserve",
                        help="serving_paged's engines, in turn: grow (pages taken as tokens are made, preempting where "
                             "they run out: device_serve.py's default) and reserve (--kv-reserve) (default both)")
    parser.add_argument("--cache-order", default=None, metavar="0,1,2,3",
                        help="the decode sections' and serving's KV cache block order, a permutation of [slots, "
                             "positions, heads, head dim] with slots first, for an A/B (default: the platform "
                             "policy's; the CPU's is 0,2,3,1)")
    args = parser.parse_args()
    if args.profile_steps < 0:
        parser.error(f"--profile-steps must be 0 or more, got {args.profile_steps}")
    if not 0 < args.memory_fraction <= 1:
        parser.error(f"--memory-fraction must be in (0, 1], got {args.memory_fraction}")
    cache_order = None
    if args.cache_order:
        try:
            cache_order = tuple(int(axis) for axis in args.cache_order.split(","))
        except ValueError:
            cache_order = ()
        if sorted(cache_order) != [0, 1, 2, 3] or cache_order[0] != 0:
            parser.error(f"--cache-order must be a permutation of 0,1,2,3 starting with 0, got {args.cache_order!r}")
    if args.splash_block is not None:
        if args.splash_block < 128 or args.splash_block % 128:
            parser.error(f"--splash-block must be a positive multiple of 128, got {args.splash_block}")
        attention_kernels.SPLASH_BLOCK = args.splash_block
    try:
        train_set = config.parse_overrides(args.train_set)
        config.from_dict(train_set)  # known keys, valid values
    except config.ConfigError as e:
        parser.error(f"--train-set: {e}")
    def counts(flag: str, text: str | None, n: int | None) -> tuple[int, ...] | None:
        if text is None:
            return None
        try:
            values = tuple(int(v) for v in text.split(","))
        except ValueError:
            values = ()
        if not values or (n and len(values) != n) or min(values) < 1:
            parser.error(f"{flag} must be {n or 'some'} positive integer(s) separated by commas, got {text!r}")
        return values

    serving_shape = counts("--serving-shape", args.serving_shape, 2)
    paged_levels = counts("--concurrent", args.concurrent, None)
    page_policies = tuple(p.strip() for p in args.page_policies.split(",") if p.strip())
    if not page_policies or set(page_policies) - set(PAGE_POLICIES) or len(set(page_policies)) < len(page_policies):
        parser.error(f"--page-policies must name some of {', '.join(PAGE_POLICIES)} once each, got "
                     f"{args.page_policies!r}")
    choices = Choices(args.paged_attention, args.attention, args.decode_attention, args.int8_dot, cache_order,
                      args.page_size, train_set, args.profile_steps, args.memory_fraction, page_policies)
    sections = [s.strip() for s in args.only.split(",") if s.strip()]
    unknown = sorted(set(sections) - set(SECTIONS))
    if unknown:
        parser.error(f"unknown section(s) {', '.join(unknown)}; choose from {', '.join(SECTIONS)}")
    if args.tiny:  # before JAX starts its backend, which reads XLA_FLAGS
        os.environ["XLA_FLAGS"] = " ".join([os.environ.get("XLA_FLAGS", ""), *TINY_XLA_FLAGS]).strip()
    out = open(args.out, "a") if args.out else None

    def write(record: dict) -> None:
        emit(**record)
        if out:
            out.write(json.dumps(record) + "\n")
            out.flush()

    device = jax.devices()[0]
    sizes = sizes_for(device, args.tiny, args.train_seq, args.model, serving_shape, paged_levels)
    if args.train_layers:
        sizes = dataclasses.replace(sizes, train_model={**sizes.train_model, "layers": args.train_layers})
    write(meta_record(device, sizes, sections))
    compiles, peaks = CompileLog(), None
    for name in sections:
        start = time.perf_counter()
        compiles.start()
        try:
            records, peaks = run_section(name, device, sizes, peaks, choices)
        except Exception as e:  # one failed section (out of memory, say) must not cost the others their figures
            records = [{"bench": name, "error": error_text(e)}]
            traceback.print_exc(file=sys.stderr)
        for record in records:
            write(record)
        compiled = compiles.summary()
        if compiled:
            write({"bench": "compile", "section": name, "section_wall_s": figure(time.perf_counter() - start),
                   **compiled})
        write(memory_record(name, device))
    if out:
        out.close()


if __name__ == "__main__":
    platform_setup()
    main()
