"""Ahead-of-time fit check: compile the train step (full, or LoRA when cfg.lora_rank > 0) and the serving decode step
for faked CPU devices, report per-device memory.

Nothing is allocated: params, optimizer state, batch and KV cache are ShapeDtypeStructs with shardings. Reports
params and optimizer bytes from the arrays' shard sizes; arguments, outputs and temporaries from XLA's memory
analysis; compile times. aot_check.py is its command line.
"""
from __future__ import annotations

import dataclasses
import math
import re
import time
from functools import partial

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from mesh_transformer.config import Config, ConfigError
from mesh_transformer.infer.choose import Sampling
from mesh_transformer.infer.decode import KVCache, Programs, Steps, block_sizes, cache_dtype, default_block
from mesh_transformer.infer.params import decode_specs, make_inference_layout
from mesh_transformer.model import gptj, layers
from mesh_transformer.parallel.layout import SHARD_MAP, Layout, make_layout
from mesh_transformer.parallel.mesh import DP, MP
from mesh_transformer.train import optim, state

_UNITS = {"": 1, "b": 1, "kb": 10 ** 3, "mb": 10 ** 6, "gb": 10 ** 9, "tb": 10 ** 12, "kib": 2 ** 10,
          "mib": 2 ** 20, "gib": 2 ** 30, "tib": 2 ** 40}


def parse_bytes(text: str) -> int:
    """'16GiB', '80GB', '512MiB' or a plain byte count -> bytes."""
    match = re.fullmatch(r"\s*([0-9.]+)\s*([a-zA-Z]*)\s*", text)
    if not match or match.group(2).lower() not in _UNITS:
        raise ConfigError(f"--device-memory must look like 16GiB, 80GB or 512MiB, got {text!r}")
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


def parse_mesh(text: str) -> dict[str, int]:
    """'data=1,fsdp=8,tensor=1' -> sizes; fsdp and tensor default to 1, data to None (the devices left)."""
    sizes: dict[str, int | None] = {"data": None, "fsdp": 1, "tensor": 1}
    for item in filter(None, text.split(",")):
        name, _, value = item.partition("=")
        if name not in sizes or not value.isdigit():
            raise ConfigError(f"--mesh must look like data=1,fsdp=8,tensor=1, got {text!r}")
        sizes[name] = int(value)
    return sizes


def start_devices(n: int) -> list[jax.Device]:
    """n CPU devices: faked when jax has not started yet, else the first n of those it already has."""
    try:
        jax.config.update("jax_platforms", "cpu")
        jax.config.update("jax_num_cpu_devices", n)
    except RuntimeError:
        pass  # jax already started (a test process): use its devices
    devices = jax.devices()
    if len(devices) < n:
        raise ConfigError(f"--devices {n}: jax already started with {len(devices)} devices")
    return devices[:n]


def shard_bytes(tree) -> int:
    """Bytes one device holds of a tree of sharded ShapeDtypeStructs (the largest shard of each leaf)."""
    def leaf_bytes(s):
        return jnp.dtype(s.dtype).itemsize * math.prod(s.sharding.shard_shape(s.shape))

    return sum(leaf_bytes(s) for s in jax.tree.leaves(tree))


def _abstract(shape, dtype, sharding: NamedSharding) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)


# XLA's CPU backend multiplies bf16 by upcasting both operands to f32, and its loop-invariant code motion then
# hoists the f32 copy of the whole stacked [L, ...] weights out of the layer loop: a bf16 base gets an f32 twice its
# size in temporaries that a GPU or TPU (native bf16 matmuls) never holds. `no_loop_hoisting` measures without it.
NO_LOOP_HOISTING = {"xla_disable_hlo_passes": "while-loop-invariant-code-motion"}


def _compile(fn, *args, options: dict | None = None, **static) -> tuple[object, float]:
    start = time.perf_counter()
    # Only XLA's buffer assignment matters here, which comes before code generation: skip LLVM's optimizations.
    compiled = fn.lower(*args, **static).compile(compiler_options={"xla_backend_optimization_level": 0,
                                                                   **(options or {})})
    return compiled, time.perf_counter() - start


def _memory(compiled) -> dict[str, float]:
    mem = compiled.memory_analysis()
    total = (mem.argument_size_in_bytes + mem.output_size_in_bytes + mem.temp_size_in_bytes
             - mem.alias_size_in_bytes)
    return {"argument_bytes": mem.argument_size_in_bytes, "output_bytes": mem.output_size_in_bytes,
            "alias_bytes": mem.alias_size_in_bytes, "temp_bytes": mem.temp_size_in_bytes, "total_bytes": total}


def _inference_layout(train_layout: Layout) -> Layout:
    """The shard_map Layout the sampling and serving tools run on these devices by default, whatever the training
    mode: mp = cores_per_replica where it fits, else the widest that does (`infer.params.choose_mp`)."""
    return make_inference_layout(train_layout.cfg, list(train_layout.mesh.devices.flat))


def _abstract_decode_params(layout: Layout) -> dict:
    """The decode programs' params (fused per layer, in the compute dtype) as sharded ShapeDtypeStructs."""
    cfg = layout.cfg
    shapes = gptj.param_shapes(cfg, gptj.compute_dtype(cfg))
    layer = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape[1:], s.dtype), shapes["layers"])
    fused = jax.eval_shape(partial(layers.fuse_layer, tp_size=layout.mesh.shape[MP]), layer)
    shardings = jax.tree.map(partial(NamedSharding, layout.mesh), decode_specs(cfg), is_leaf=lambda x: isinstance(x, P))
    return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                        {**shapes, "layers": [fused] * cfg.layers}, shardings)


def _abstract_slots(programs: Programs, n_slots: int, sizes: list[int]) -> tuple:
    """(cache, last tokens, Steps) of n_slots slots whose cache blocks have these lengths, abstract."""
    cfg = programs.layout.cfg
    row = programs.row_sharding
    block = [jax.ShapeDtypeStruct((n_slots, cfg.n_heads, cfg.head_dim, size), cache_dtype(cfg),
                                  sharding=programs.cache_sharding) for size in sizes]
    ints = jax.ShapeDtypeStruct((n_slots,), jnp.int32, sharding=row)
    steps = Steps(ints, ints, _abstract_sampling(row, n_slots))
    return KVCache([block] * cfg.layers, [block] * cfg.layers), ints, steps


def _abstract_sampling(sharding: NamedSharding, n: int) -> Sampling:
    def leaf(dtype):
        return jax.ShapeDtypeStruct((n,), dtype, sharding=sharding)

    return Sampling(leaf(jnp.float32), leaf(jnp.int32), leaf(jnp.float32), leaf(jnp.uint32), leaf(jnp.bool_))


def _measure_inference(train_layout: Layout, n_slots: int, common: dict) -> list[dict]:
    """The programs inference really runs, every slot busy and the whole context used: the serving engine's decode
    step (block cache) and prefill (one full-length prompt per dp group), and the offline sampler's decode step
    (one block of seq). The engine's decode is compiled at two slot counts too, which gives the slots that fit."""
    cfg, layout = train_layout.cfg, _inference_layout(train_layout)
    programs, dp = Programs(layout), layout.mesh.shape[DP]
    params = _abstract_decode_params(layout)
    n_slots = -(-n_slots // dp) * dp
    serve_blocks = block_sizes(cfg.seq, default_block(cfg.seq))
    base = {**common, "decode_mesh": dict(layout.mesh.shape), "params_bytes": shard_bytes(params),
            "cache_length": cfg.seq}

    def decode(slots: int, sizes: list[int]) -> tuple[dict, dict]:
        cache, last, steps = _abstract_slots(programs, slots, sizes)
        compiled, seconds = _compile(programs.jitted["decode"], params, cache, last, steps, rows=slots // dp,
                                     n_blocks=len(sizes))
        return {**base, "slots": slots, "compile_s": round(seconds, 1), "kv_cache_bytes": shard_bytes(cache)}, \
            _memory(compiled)

    serve, serve_memory = decode(n_slots, serve_blocks)
    _, double_memory = decode(2 * n_slots, serve_blocks)
    per_slot = (double_memory["total_bytes"] - serve_memory["total_bytes"]) / n_slots
    fixed = serve_memory["total_bytes"] - per_slot * n_slots
    fit = {f"{gib}GiB": max(0, int((gib * 2 ** 30 - fixed) // per_slot) // dp * dp) for gib in (16, 24, 80)}
    sample, sample_memory = decode(n_slots, [cfg.seq])
    cache, last, _ = _abstract_slots(programs, n_slots, serve_blocks)
    ids = jax.ShapeDtypeStruct((dp, cfg.seq), jnp.int32, sharding=layout.sharding(("batch", "length")))
    rows = jax.ShapeDtypeStruct((dp,), jnp.int32, sharding=programs.row_sharding)
    prefill, prefill_s = _compile(programs.jitted["prefill"], params, cache, last, ids, rows, rows,
                                  _abstract_sampling(programs.row_sharding, dp))
    return [{"check": "serve_decode_step", **serve, **serve_memory, "per_slot_bytes": round(per_slot),
             "slots_that_fit": fit},
            {"check": "serve_prefill", **base, "slots": n_slots, "prompt_tokens": cfg.seq,
             "compile_s": round(prefill_s, 1), "kv_cache_bytes": shard_bytes(cache), **_memory(prefill)},
            {"check": "sample_decode_step", **sample, **sample_memory}]


def training_programs(cfg: Config, mode: str, devices: list, sizes: dict) -> dict:
    """The Layout of `mode` on the devices, the abstract train state and batch, and the train step."""
    cfg = dataclasses.replace(cfg, parallelism=mode)
    if mode != SHARD_MAP:
        cfg = dataclasses.replace(cfg, mesh_fsdp=sizes["fsdp"], mesh_tensor=sizes["tensor"])
        if sizes["data"] is not None:
            needed = sizes["data"] * sizes["fsdp"] * sizes["tensor"]
            if needed > len(devices):
                raise ConfigError(f"mesh data={sizes['data']}, fsdp={sizes['fsdp']}, tensor={sizes['tensor']} "
                                  f"needs {needed} devices; {len(devices)} are available")
            devices = devices[:needed]
    layout = make_layout(cfg, devices)
    optimizer = optim.make_optimizer(cfg)
    tokens = jax.ShapeDtypeStruct((cfg.gradient_accumulation_steps, layout.global_batch, cfg.seq + 1), jnp.int32,
                                  sharding=layout.batch_sharding())
    frozen = (layout.abstract_params(gptj.DTYPES[cfg.base_dtype]),) if cfg.lora_rank else ()
    return {"layout": layout, "state": state.abstract_train_state(layout, optimizer), "tokens": tokens,
            "frozen": frozen, "train": state.make_train_step(layout, optimizer, optim.lr_schedule(cfg))}


def _train_record(compiled: dict, common: dict, no_loop_hoisting: bool = False) -> dict:
    """The train step's record: the full step's, or the LoRA step's (params = the frozen base, plus adapters)."""
    train_state, frozen = compiled["state"], compiled["frozen"]
    options = NO_LOOP_HOISTING if no_loop_hoisting else None
    train, train_s = _compile(compiled["train"], train_state, compiled["tokens"], *frozen, options=options)
    params = frozen[0] if frozen else train_state["params"]
    record = {"check": "lora_train_step" if frozen else "train_step", **common,
              "params": sum(x.size for x in jax.tree.leaves(params)), "tokens": list(compiled["tokens"].shape),
              "compile_s": round(train_s, 1), "params_bytes": shard_bytes(params),
              "opt_state_bytes": shard_bytes(train_state["opt_state"]), "no_loop_hoisting": no_loop_hoisting}
    if frozen:
        cfg = compiled["layout"].cfg
        record.update(adapter_params=sum(x.size for x in jax.tree.leaves(train_state["params"])),
                      adapters_bytes=shard_bytes(train_state["params"]), lora_rank=cfg.lora_rank,
                      lora_targets=list(cfg.lora_targets), base_dtype=cfg.base_dtype)
    return {**record, **_memory(train)}


def measure(cfg: Config, mode: str, devices: list, sizes: dict, n_slots: int = 8,
            no_loop_hoisting: bool = False) -> list[dict]:
    """Compile the train step of `mode` and the inference programs on the same devices and measure their
    per-device memory: one JSON record each."""
    compiled = training_programs(cfg, mode, devices, sizes)
    common = {"mode": mode, "mesh": dict(compiled["layout"].mesh.shape), "devices": len(devices)}
    return [_train_record(compiled, common, no_loop_hoisting), *_measure_inference(compiled["layout"], n_slots, common)]


def verdict(records: list[dict], device_memory: int) -> dict:
    """The fit record: the largest per-device need of the programs against one device's memory."""
    need = max(r["total_bytes"] for r in records)
    common = {k: records[0][k] for k in ("mode", "mesh", "devices")}
    return {"check": "fit", **common, "per_device_need_bytes": need, "device_memory_bytes": device_memory,
            "fits": need <= device_memory}


def _size(n_bytes: int) -> str:
    for unit, scale in (("GiB", 2 ** 30), ("MiB", 2 ** 20), ("KiB", 2 ** 10)):
        if n_bytes >= scale:
            return f"{n_bytes / scale:.2f} {unit}"
    return f"{n_bytes} B"


def human_line(records: list[dict]) -> str:
    train, decode, fit = records[0], records[1], records[-1]
    mesh = " x ".join(f"{k}{v}" for k, v in fit["mesh"].items())
    kind = f"LoRA rank {train['lora_rank']} train step" if "lora_rank" in train else "train step"
    return (f"{fit['mode']} on {mesh}: {kind} {_size(train['total_bytes'])} per device (params "
            f"{_size(train['params_bytes'])}, optimizer {_size(train['opt_state_bytes'])}, temporaries "
            f"{_size(train['temp_bytes'])}; compiled in {train['compile_s']:.0f} s), serving decode step "
            f"{_size(decode['total_bytes'])} for {decode['slots']} slots (params {_size(decode['params_bytes'])}, KV "
            f"cache {_size(decode['kv_cache_bytes'])}): {'fits' if fit['fits'] else 'does NOT fit'} in "
            f"{_size(fit['device_memory_bytes'])}")


def run(cfg: Config, mode: str | None, mesh_text: str, n_devices: int, device_memory_text: str,
        n_slots: int = 8, no_loop_hoisting: bool = False) -> list[dict]:
    """The JSON records of a fit check (train step, serving decode step and prefill, sampler decode step, verdict);
    the last says whether it fits."""
    mode = mode or cfg.parallelism
    if mode == "shard_map" and mesh_text:
        raise ConfigError("--mesh is for the GSPMD modes; the shard_map path takes mp from cores_per_replica")
    device_memory, sizes = parse_bytes(device_memory_text), parse_mesh(mesh_text)
    records = measure(cfg, mode, start_devices(n_devices), sizes, n_slots, no_loop_hoisting)
    return [*records, verdict(records, device_memory)]
