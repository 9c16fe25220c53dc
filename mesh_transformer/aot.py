"""Ahead-of-time fit check: compile the train step and the serving decode step for faked CPU devices, report
per-device memory.

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
from mesh_transformer.infer.decode import KVCache, Programs, Sampling, Steps, block_sizes, default_block
from mesh_transformer.infer.params import decode_specs, make_inference_layout
from mesh_transformer.model import gptj, layers
from mesh_transformer.parallel.layout import SHARD_MAP, Layout, make_layout
from mesh_transformer.parallel.mesh import DP, MP, TENSOR
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


def _compile(fn, *args, **static) -> tuple[object, float]:
    start = time.perf_counter()
    # Only XLA's buffer assignment matters here, which comes before code generation: skip LLVM's optimizations.
    compiled = fn.lower(*args, **static).compile(compiler_options={"xla_backend_optimization_level": 0})
    return compiled, time.perf_counter() - start


def _memory(compiled) -> dict[str, float]:
    mem = compiled.memory_analysis()
    total = (mem.argument_size_in_bytes + mem.output_size_in_bytes + mem.temp_size_in_bytes
             - mem.alias_size_in_bytes)
    return {"argument_bytes": mem.argument_size_in_bytes, "output_bytes": mem.output_size_in_bytes,
            "alias_bytes": mem.alias_size_in_bytes, "temp_bytes": mem.temp_size_in_bytes, "total_bytes": total}


def _decode_program(train_layout: Layout, n_slots: int) -> tuple:
    """The serving decode step, every slot busy and the whole context read, on the shard_map Layout that the same
    devices run inference on (mp = the training tensor width): the program and its abstract arguments."""
    cfg = train_layout.cfg
    mp = train_layout.mesh.shape.get(MP, train_layout.mesh.shape.get(TENSOR, 1))
    layout = make_inference_layout(dataclasses.replace(cfg, cores_per_replica=mp), train_layout.mesh.devices.flat)
    programs = Programs(layout)
    n_slots = -(-n_slots // layout.mesh.shape[DP]) * layout.mesh.shape[DP]
    dtype = gptj.DTYPES[cfg.compute_dtype]

    def placed(tree, shardings):
        return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), tree, shardings)

    shapes = gptj.param_shapes(cfg, dtype)
    layer = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape[1:], s.dtype), shapes["layers"])
    fused = jax.eval_shape(partial(layers.fuse_layer, tp_size=mp), layer)
    tree = {**shapes, "layers": [fused] * cfg.layers}
    params = placed(tree, jax.tree.map(partial(NamedSharding, layout.mesh), decode_specs(cfg),
                                       is_leaf=lambda x: isinstance(x, P)))
    sizes = block_sizes(cfg.seq, default_block(cfg.seq))
    block = [jax.ShapeDtypeStruct((n_slots, cfg.n_heads, cfg.head_dim, size), dtype, sharding=programs.cache_sharding)
             for size in sizes]
    cache = KVCache([block] * cfg.layers, [block] * cfg.layers)
    row = programs.row_sharding
    ints = jax.ShapeDtypeStruct((n_slots,), jnp.int32, sharding=row)
    floats = jax.ShapeDtypeStruct((n_slots,), jnp.float32, sharding=row)
    sampling = Sampling(floats, ints, floats, jax.ShapeDtypeStruct((n_slots,), jnp.uint32, sharding=row),
                        jax.ShapeDtypeStruct((n_slots,), jnp.bool_, sharding=row))
    static = {"rows": n_slots // layout.mesh.shape[DP], "n_blocks": len(sizes)}
    return programs.decode, (params, cache, ints, Steps(ints, ints, sampling)), static, dict(layout.mesh.shape)


def programs(cfg: Config, mode: str, devices: list, sizes: dict) -> dict:
    """The Layout of `mode` on the devices, the abstract train state and batch, and the train and decode steps."""
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
    decode, decode_args, decode_static, decode_mesh = _decode_program(layout, layout.global_batch)
    return {"mesh": dict(layout.mesh.shape), "state": state.abstract_train_state(layout, optimizer),
            "tokens": tokens, "train": state.make_train_step(layout, optimizer, optim.lr_schedule(cfg)),
            "decode": decode, "decode_args": decode_args, "decode_static": decode_static,
            "decode_mesh": decode_mesh}


def measure(cfg: Config, mode: str, devices: list, sizes: dict) -> list[dict]:
    """Compile the train and decode steps of `mode` and measure their per-device memory: two JSON records."""
    compiled = programs(cfg, mode, devices, sizes)
    train_state = compiled["state"]
    common = {"mode": mode, "mesh": compiled["mesh"], "devices": len(devices)}
    train, train_s = _compile(compiled["train"], train_state, compiled["tokens"])
    decode, decode_s = _compile(compiled["decode"], *compiled["decode_args"], **compiled["decode_static"])
    return [
        {"check": "train_step", **common, "params": sum(x.size for x in jax.tree.leaves(train_state["params"])),
         "tokens": list(compiled["tokens"].shape), "compile_s": round(train_s, 1),
         "params_bytes": shard_bytes(train_state["params"]), "opt_state_bytes": shard_bytes(train_state["opt_state"]),
         **_memory(train)},
        {"check": "decode_step", **common, "decode_mesh": compiled["decode_mesh"],
         "batch": compiled["decode_args"][2].shape[0], "cache_length": cfg.seq,
         "compile_s": round(decode_s, 1), "params_bytes": shard_bytes(compiled["decode_args"][0]),
         "kv_cache_bytes": shard_bytes(compiled["decode_args"][1]), **_memory(decode)},
    ]


def verdict(records: list[dict], device_memory: int) -> dict:
    """The fit record: the larger per-device need of the two steps against one device's memory."""
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
    train, decode, fit = records
    mesh = " x ".join(f"{k}{v}" for k, v in fit["mesh"].items())
    return (f"{fit['mode']} on {mesh}: train step {_size(train['total_bytes'])} per device (params "
            f"{_size(train['params_bytes'])}, optimizer {_size(train['opt_state_bytes'])}, temporaries "
            f"{_size(train['temp_bytes'])}; compiled in {train['compile_s']:.0f} s), decode step "
            f"{_size(decode['total_bytes'])}: {'fits' if fit['fits'] else 'does NOT fit'} in "
            f"{_size(fit['device_memory_bytes'])}")


def run(cfg: Config, mode: str | None, mesh_text: str, n_devices: int, device_memory_text: str) -> list[dict]:
    """The JSON records of a fit check (train step, decode step, verdict); the last says whether it fits."""
    mode = mode or cfg.parallelism
    if mode == "shard_map" and mesh_text:
        raise ConfigError("--mesh is for the GSPMD modes; the shard_map path takes mp from cores_per_replica")
    device_memory, sizes = parse_bytes(device_memory_text), parse_mesh(mesh_text)
    records = measure(cfg, mode, start_devices(n_devices), sizes)
    return [*records, verdict(records, device_memory)]
