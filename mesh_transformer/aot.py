"""Ahead-of-time fit check: compile the train step and a decode step for faked CPU devices, report per-device memory.

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
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from mesh_transformer.model import gptj as model
from mesh_transformer.train import optim
from mesh_transformer.parallel import layout as partitioning
from mesh_transformer.infer import sampler as sampling
from mesh_transformer.parallel import mesh as mesh_lib
from mesh_transformer.config import Config, ConfigError

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


def _abstract(shape, dtype, mesh: Mesh, spec: P) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, spec))


def _compile(fn, *args) -> tuple[object, float]:
    start = time.perf_counter()
    # Only XLA's buffer assignment matters here, which comes before code generation: skip LLVM's optimizations.
    compiled = fn.lower(*args).compile(compiler_options={"xla_backend_optimization_level": 0})
    return compiled, time.perf_counter() - start


def _memory(compiled) -> dict[str, float]:
    mem = compiled.memory_analysis()
    total = (mem.argument_size_in_bytes + mem.output_size_in_bytes + mem.temp_size_in_bytes
             - mem.alias_size_in_bytes)
    return {"argument_bytes": mem.argument_size_in_bytes, "output_bytes": mem.output_size_in_bytes,
            "alias_bytes": mem.alias_size_in_bytes, "temp_bytes": mem.temp_size_in_bytes, "total_bytes": total}


def _unstacked(abstract_params: dict) -> dict:
    """Abstract params with the layers unstacked, as the inference programs take them."""
    def split(s):
        one = NamedSharding(s.sharding.mesh, P(*s.sharding.spec[1:]))
        return [jax.ShapeDtypeStruct(s.shape[1:], s.dtype, sharding=one)] * s.shape[0]

    return model.unstack_layers(abstract_params, split)


def _decode_inputs(cfg: Config, mesh: Mesh, batch: int, batch_spec, heads_spec, params) -> tuple:
    """Abstract (params, ids, positions, key_ok, index, cache) of one decode token against a full-length cache."""
    cache_shape = (batch, cfg.n_heads, cfg.head_dim, cfg.seq)
    cache_spec = P(batch_spec, heads_spec, None, None)
    cache = tuple([_abstract(cache_shape, model.DTYPES[cfg.compute_dtype], mesh, cache_spec)] * cfg.layers
                  for _ in range(2))
    rows = P(batch_spec, None)
    return (params, _abstract((batch, 1), jnp.int32, mesh, rows), _abstract((batch, 1), jnp.int32, mesh, rows),
            _abstract((batch, cfg.seq), jnp.bool_, mesh, rows), _abstract((), jnp.int32, mesh, P()), cache)


def shard_map_programs(cfg: Config, devices: list) -> dict:
    """Mesh, abstract train state, batch and the two step functions of the shard_map ('dp', 'mp') path."""
    mesh = mesh_lib.make(cfg, devices)
    optimizer = optim.make_optimizer(cfg)
    state = model.abstract_train_state(cfg, mesh, optimizer)
    batch = cfg.per_replica_batch * mesh.shape[mesh_lib.DP]
    tokens = jax.ShapeDtypeStruct((cfg.gradient_accumulation_steps, batch, cfg.seq + 1), jnp.int32,
                                  sharding=model.batch_sharding(mesh))
    decode_params = _unstacked(model.abstract_params(cfg, mesh, model.DTYPES[cfg.compute_dtype]))
    decode_args = _decode_inputs(cfg, mesh, batch, mesh_lib.DP, mesh_lib.MP, decode_params)
    cache_spec = [decode_args[-1][0][0].sharding.spec] * cfg.layers
    decode = jax.jit(jax.shard_map(
        partial(sampling.forward_cached, cfg=cfg, tp_axis=mesh_lib.MP), mesh=mesh,
        in_specs=(model.unstacked_specs(model.param_specs(cfg), cfg.layers), P(mesh_lib.DP, None),
                  P(mesh_lib.DP, None), P(mesh_lib.DP, None), P(), (cache_spec, cache_spec)),
        out_specs=(P(mesh_lib.DP, None), (cache_spec, cache_spec)), check_vma=True), donate_argnums=5)
    return {"mesh": dict(mesh.shape), "state": state, "tokens": tokens,
            "train": model.make_train_step(cfg, mesh, optimizer, optim.lr_schedule(cfg)),
            "decode": decode, "decode_args": decode_args}


def gspmd_programs(cfg: Config, devices: list, sizes: dict) -> dict:
    """Mesh, abstract train state, batch and the two step functions of a GSPMD mode."""
    mesh = partitioning.make_mesh(sizes["data"], sizes["fsdp"], sizes["tensor"], devices)
    optimizer = optim.make_optimizer(cfg)
    state = partitioning.abstract_train_state(cfg, mesh, optimizer)
    batch = partitioning.global_batch(cfg, mesh)
    tokens = jax.ShapeDtypeStruct((cfg.gradient_accumulation_steps, batch, cfg.seq + 1), jnp.int32,
                                  sharding=partitioning.batch_sharding(mesh))
    decode_params = _unstacked(partitioning.abstract_params(cfg, mesh, model.DTYPES[cfg.compute_dtype]))
    spec = partitioning.logical_sharding(cfg, mesh, partitioning.ACTIVATION_AXES["kv_cache"]).spec
    decode_args = _decode_inputs(cfg, mesh, batch, spec[0], spec[1], decode_params)
    logits = partitioning.logical_sharding(cfg, mesh, ("batch", "vocab"))
    decode = jax.jit(partial(sampling.forward_cached, cfg=cfg), in_shardings=jax.tree.map(
        lambda s: s.sharding, decode_args), out_shardings=(logits, jax.tree.map(lambda a: a.sharding, decode_args[-1])),
        donate_argnums=5)
    return {"mesh": dict(mesh.shape), "state": state, "tokens": tokens,
            "train": partitioning.make_train_step(cfg, mesh, optimizer, optim.lr_schedule(cfg)),
            "decode": decode, "decode_args": decode_args}


def measure(cfg: Config, mode: str, devices: list, sizes: dict) -> list[dict]:
    """Compile the train and decode steps of `mode` and measure their per-device memory: two JSON records."""
    if mode == "shard_map":
        programs = shard_map_programs(dataclasses.replace(cfg, parallelism=mode), devices)
    else:
        programs = gspmd_programs(dataclasses.replace(cfg, parallelism=mode), devices, sizes)
    state = programs["state"]
    common = {"mode": mode, "mesh": programs["mesh"], "devices": len(devices)}
    train, train_s = _compile(programs["train"], state, programs["tokens"])
    decode, decode_s = _compile(programs["decode"], *programs["decode_args"])
    return [
        {"check": "train_step", **common, "params": sum(x.size for x in jax.tree.leaves(state["params"])),
         "tokens": list(programs["tokens"].shape), "compile_s": round(train_s, 1),
         "params_bytes": shard_bytes(state["params"]), "opt_state_bytes": shard_bytes(state["opt_state"]),
         **_memory(train)},
        {"check": "decode_step", **common, "batch": programs["decode_args"][1].shape[0], "cache_length": cfg.seq,
         "compile_s": round(decode_s, 1), "params_bytes": shard_bytes(programs["decode_args"][0]),
         "kv_cache_bytes": shard_bytes(programs["decode_args"][-1]), **_memory(decode)},
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
