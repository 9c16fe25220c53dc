"""Ahead-of-time fit check: compile the train step (full, or LoRA when cfg.lora_rank > 0), the programs that place its
params before the first step, and the inference programs
(serving decode, prefill and prefix-cache extend, the sampler's decode, the scorer) for faked CPU devices or for a
real accelerator's compile-only devices (`targets`: a TPU slice through libtpu, NVIDIA GPUs through the CUDA
plugin), report per-device memory and, on an accelerator, the train step's estimated time (`estimate`).

Nothing is allocated: params, optimizer state, batch and KV cache are ShapeDtypeStructs with shardings. Reports
params and optimizer bytes from the arrays' shard sizes; arguments, outputs and temporaries from the compiler's
memory analysis; compile times; which compiler made each record. aot_check.py is its command line.

This module holds the training records (train step, param placement) and the run; one program's compile and memory
is aot_compile.py's, the inference records aot_inference.py's, the verdict and the human summary aot_report.py's.
"""
from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from mesh_transformer import estimate, targets
from mesh_transformer.aot_compile import Refused, _compile, memory_record, shard_bytes
from mesh_transformer.aot_inference import measure_inference, measure_server
from mesh_transformer.aot_report import verdict
from mesh_transformer.config import Config, ConfigError, parse_size
from mesh_transformer.parallel.layout import MODES, SHARD_MAP, make_layout
from mesh_transformer.store import placing
from mesh_transformer.train import finetune, optim, state

# Reached through this module by aot_check.py, the tests and the benches.
from mesh_transformer.aot_inference import _abstract_sampling, _abstract_slots, _inference_layout  # noqa: F401
from mesh_transformer.aot_report import human_line  # noqa: F401


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


def default_mesh(mode: str, n_devices: int) -> dict:
    """A GSPMD mode's mesh sizes when none is given: dp and fsdp over every device, tp over up to 8 (the rest
    data), fsdp_tp fsdp over all but a tensor width of 2."""
    tensor = {"tp": math.gcd(n_devices, 8), "fsdp_tp": 2 if n_devices % 2 == 0 else 1}.get(mode, 1)
    fsdp = n_devices // tensor if mode in ("fsdp", "fsdp_tp") else 1
    return {"data": None, "fsdp": fsdp, "tensor": tensor}


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
    train_state, tokens, frozen = state.abstract_step_args(layout, optimizer)
    # The frozen base in the layouts the compiler chooses, as the trainer places it (`state.compile_train_step`).
    train = state.make_train_step(layout, optimizer, optim.lr_schedule(layout.cfg),
                                  frozen_formats=state.auto_frozen_formats(layout))
    return {"layout": layout, "state": train_state, "tokens": tokens, "frozen": frozen, "train": train}


def _train_record(compiled: dict, common: dict, no_loop_hoisting: bool = False,
                  chip: targets.Chip | None = None) -> dict:
    """The train step's record: the full step's, or the LoRA step's (params = the frozen base, plus adapters);
    with the target's chip, the step's estimated time."""
    train_state, frozen, layout = compiled["state"], compiled["frozen"], compiled["layout"]
    policy = dataclasses.replace(layout.policy, loop_hoisting=not no_loop_hoisting)
    train, train_s = _compile(compiled["train"], train_state, compiled["tokens"], frozen, policy=policy)
    params = frozen or train_state["params"]
    cfg = layout.cfg
    record = {"check": "lora_train_step" if frozen else "train_step", **common, "mode": cfg.parallelism,
              "mesh": dict(layout.mesh.shape), "params": sum(x.size for x in jax.tree.leaves(params)),
              "tokens": list(compiled["tokens"].shape), "compute_dtype": cfg.compute_dtype, "remat": cfg.remat,
              "remat_policy": cfg.remat_policy,
              "attention": layout.policy.attention,
              "compile_s": round(train_s, 1), "params_bytes": shard_bytes(params),
              "opt_state_bytes": shard_bytes(train_state["opt_state"]), "no_loop_hoisting": no_loop_hoisting,
              "optimizer_split_over": layout.zero_axis}
    if frozen:
        record.update(adapter_params=sum(x.size for x in jax.tree.leaves(train_state["params"])),
                      adapters_bytes=shard_bytes(train_state["params"]), lora_rank=cfg.lora_rank,
                      lora_targets=list(cfg.lora_targets), base_dtype=cfg.base_dtype)
    if chip is not None and not isinstance(train, Refused):
        n_tokens = math.prod(compiled["tokens"].shape[:2]) * cfg.seq
        n_devices = layout.mesh.devices.size
        model_flops = n_tokens * estimate.model_flops_per_token(cfg, lora=bool(frozen)) / n_devices
        record.update(estimate.step_estimate(train, chip, n_tokens, model_flops))
    return {**record, **memory_record(train)}


def _loading_record(compiled: dict, common: dict) -> dict:
    """The programs that place a fine-tune's params or a LoRA base before the first step (each stacked param made
    and written a layer at a time: `store.placing`; a LoRA base's fingerprint), compiled for the target (those of
    params alike in shape, dtype and sharding once: they are one program): the largest one's memory, and any the
    compiler refused (a TPU core's 128 MiB VMEM, say)."""
    layout, policy = compiled["layout"], compiled["layout"].policy
    placed = compiled["frozen"] or compiled["state"]["params"]
    runs, distinct = 0, {}
    for like in jax.tree.leaves(placed):  # blocks of f32 layers: the largest a checkpoint gives
        for i, (fn, args) in enumerate(placing.programs(like, jnp.float32)):
            runs += 1
            key = (i, like.shape, like.dtype, like.sharding)
            if key not in distinct:
                distinct[key] = _compile(fn, *args, policy=policy)[0]
    programs = list(distinct.values())
    if compiled["frozen"]:
        programs.append(_compile(finetune.fingerprint_fn(layout.replicated), placed, policy=policy)[0])
        runs += 1
    memory = [memory_record(program) for program in programs]
    largest = max(memory, key=lambda m: m["total_bytes"])
    record = {"check": "load_params", **common, "programs": runs, "distinct_programs": len(programs), **largest}
    refused = [m["refused"] for m in memory if "refused" in m]
    if refused:
        record["refused"] = refused[0]
    return record


def measure(cfg: Config, mode: str, devices: list, sizes: dict | None, n_slots: int = 8,
            no_loop_hoisting: bool = False, target: targets.Target | None = None,
            train_only: bool = False, inference_only: bool = False, server: dict | None = None,
            device_memory: int = 16 * 2 ** 30) -> list[dict]:
    """Compile the train step of `mode` (every mode's: "all"; none with `inference_only`) and, unless `train_only`,
    the inference programs on the same devices and measure their per-device memory: one JSON record each; with
    `server` (device_serve.py's paged-cache flags, `flags.paged_cache`), the server's own verdict for n_slots slots
    in `device_memory` too."""
    common = {"devices": len(devices), "target": target.name if target else f"cpu-{len(devices)}",
              "compiler": target.compiler if target else "XLA:CPU (faked devices)"}
    if target is not None:
        common["device_memory_bytes"] = target.chip.memory_bytes
    modes = [SHARD_MAP, *MODES] if mode == "all" else [mode]
    records, first = [], None
    for name in modes:
        mesh = sizes if sizes and name == mode else default_mesh(name, len(devices))
        compiled = training_programs(cfg, name, devices, mesh)
        first = first or compiled
        if not inference_only:
            records.append(_train_record(compiled, common, no_loop_hoisting, target.chip if target else None))
            records.append(_loading_record(compiled, common))
    if train_only:
        return records
    records += measure_inference(first["layout"], n_slots, common, target.chip if target else None)
    if server is not None:
        records.append(measure_server(first["layout"], n_slots, server, common, device_memory))
    return records


def run(cfg: Config, mode: str | None, mesh_text: str, n_devices: int, device_memory_text: str | None,
        n_slots: int = 8, no_loop_hoisting: bool = False, topology: str | None = None,
        train_only: bool = False, inference_only: bool = False, server: dict | None = None) -> list[dict]:
    """The JSON records of a fit check (train step(s), serving decode step and prefill, sampler decode step, scorer,
    with `server` device_serve.py's verdict, the fit verdict) on `n_devices` faked CPU devices or the compile-only
    devices of `topology` (`targets.target`); the last says whether it fits."""
    mode = mode or cfg.parallelism
    if mode == "shard_map" and mesh_text:
        raise ConfigError("--mesh is for the GSPMD modes; the shard_map path takes mp from cores_per_replica")
    target = targets.target(topology) if topology else None
    if target is not None and no_loop_hoisting:
        raise ConfigError("--no-loop-hoisting is for the CPU's compile; a TPU or GPU program hoists no f32 copy")
    sizes = parse_mesh(mesh_text) if mesh_text else None
    if device_memory_text:
        device_memory = parse_size(device_memory_text, "--device-memory")
    else:
        device_memory = target.chip.memory_bytes if target else 16 * 2 ** 30
    devices = target.devices() if target else start_devices(n_devices)
    records = measure(cfg, mode, devices, sizes, n_slots, no_loop_hoisting, target, train_only, inference_only, server,
                      device_memory)
    return [*records, verdict(records, device_memory)]
