"""Compile-only devices of real accelerators, for ahead-of-time checks on a machine that has none.

A target is what users type: a Cloud TPU accelerator type (`v3-8`, `v4-8`, `v5litepod-1`, `v5litepod-8`, `v5p-8`,
`v6e-8`, `v3-32`, ...) compiled by libtpu, or a GPU set (`h100-8`, `h200-1`, `a100-80-8`, `rtx4090-1`, ...)
compiled by the CUDA plugin from a target description of that GPU (`gpu_specs`). Either gives JAX devices that can
be compiled for and never run; the process itself stays a CPU one (`jax_platforms=cpu`).

Each target carries its device's datasheet figures (memory, dense bf16 peak, memory bandwidth) for fit checks and
time estimates: the compile-only devices report none of them.
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
import re

from mesh_transformer import platforms
from mesh_transformer.config import ConfigError

GIB = 2 ** 30


@dataclasses.dataclass(frozen=True)
class Chip:
    """One device of a target as JAX sees it (a TPU core on v2/v3, a chip from v4 on, a GPU): datasheet figures, and
    the fractions of them the device attains where measured on one."""
    name: str
    memory_bytes: int
    peak_flops: float  # dense bf16 (fp16 where the device has no bf16 units), per device
    bandwidth: float  # memory bytes/s, per device
    attained: tuple = (1.0, 1.0)  # (FLOP/s, bytes/s) fractions of the above that the step estimate takes
    # Bytes/s a device sends into a ring collective: one way over its two ring links, shared by a chip's devices;
    # 0 where unknown (its collectives are then not counted).
    ici_bandwidth: float = 0.0


# Per JAX device. v2/v3 expose each of a chip's two cores as a device; v4 and v5p join a chip's two as one device
# (megacore: libtpu's compile-only v4 is asked for it, `_CHIP_CONFIG`); v5e and v6e have one core per chip.
# ICI (`ici_bandwidth`): v2 and v3 chips have 4 links of 496 and 656 Gbit/s (Jouppi et al. 2021), taken as both
# directions' total (the lower reading), the ring's share per core half a chip's; v4 6 links of 400 Gbit/s each way;
# v5e 400 GB/s both ways over 4 ports, v5p 1,200 GB/s over 6 (the Cloud TPU datasheets); v6e's is not used here.
TPU_CHIPS = {
    "v2": Chip("TPU v2 core", 8 * GIB, 22.5e12, 350e9, ici_bandwidth=31e9),
    "v3": Chip("TPU v3 core", 16 * GIB, 61.5e12, 450e9, ici_bandwidth=41e9),
    "v4": Chip("TPU v4 chip", 32 * GIB, 275e12, 1200e9, ici_bandwidth=100e9),
    # Measured on a v5e chip (2026-12-06): of its 16 GiB a program gets 15.75 (`memory_stats()["bytes_limit"]`, what
    # the chip refuses beyond); a bf16 8192^3 product runs at 169.7 TFLOP/s (`bench/device_suite.py`), and a chain
    # of bf16 weight products streams its weights at 739 GB/s (`bench/weight_stream_ab.py`, 8 layers of GPT-J-6B's
    # two joined matrices, steps back to back). A copy, which writes as much as it reads, reaches 644 GB/s (0.79):
    # a step's bytes are mostly read.
    "v5e": Chip("TPU v5e chip", 16_909_336_064, 197e12, 819e9, attained=(0.86, 0.90), ici_bandwidth=100e9),
    "v5p": Chip("TPU v5p chip", 95 * GIB, 459e12, 2765e9, ici_bandwidth=200e9),
    "v6e": Chip("TPU v6e chip", 32 * GIB, 918e12, 1640e9),
}
# The device_kind JAX reports for each generation's device (v5e's and v6e's say "lite", v5p's "TPU v5").
_TPU_KINDS = {"TPU v2": "v2", "TPU v3": "v3", "TPU v4": "v4", "TPU v5 lite": "v5e", "TPU v5e": "v5e", "TPU v5": "v5p",
              "TPU v5p": "v5p", "TPU v6 lite": "v6e", "TPU v6e": "v6e"}
# Cloud names count TensorCores up to v5p and chips from v5e on.
_CORES_PER_CHIP_IN_NAME = {"v2": 2, "v3": 2, "v4": 2, "v5p": 2, "v5e": 1, "v6e": 1}
_CLOUD_PREFIX = {"v5litepod": "v5e", "v5lite": "v5e", "v6e": "v6e", "v5p": "v5p", "v4": "v4", "v3": "v3",
                 "v2": "v2"}
# Chips per host of each generation's VMs (a slice of up to that many chips is one host), and JAX devices per chip.
_CHIPS_PER_HOST = {"v2": 4, "v3": 4, "v4": 4, "v5p": 4, "v5e": 8, "v6e": 8}
_DEVICES_PER_CHIP = {"v2": 2, "v3": 2, "v4": 1, "v5p": 1, "v5e": 1, "v6e": 1}
# libtpu's chip configuration where its compile-only default is not the Cloud VM's: v4's default is a device per
# core, which JAX's mesh builder refuses for a v4 ("requires one device per chip").
_CHIP_CONFIG = {"v4": "megacore"}


@dataclasses.dataclass(frozen=True)
class Target:
    """A named set of compile-only devices: how to make them, and what one of them is."""
    name: str
    platform: str  # "tpu" or "gpu"
    compiler: str  # which compiler makes its programs, for the records
    chip: Chip
    n_devices: int
    topology: str  # libtpu's topology name, or the CUDA plugin's "slices x hosts x devices"
    options: tuple = ()  # more get_topology_desc keywords, as (key, value) pairs

    def devices(self) -> list:
        return compile_devices(self)


# Chip grids of libtpu's topology names by chip count: 2D for v2, v3, v5e and v6e, 3D for v4 and v5p.
_GRID_2D = {1: "1x1", 2: "1x2", 4: "2x2", 8: "2x4", 16: "4x4", 32: "4x8", 64: "8x8", 128: "8x16", 256: "16x16",
            512: "16x32", 1024: "32x32"}
_GRID_3D = {1: "1x1x1", 2: "1x2x1", 4: "2x2x1", 8: "2x2x2", 16: "2x2x4", 32: "2x4x4", 64: "4x4x4", 128: "4x4x8",
            256: "4x8x8", 512: "8x8x8", 1024: "8x8x16", 2048: "8x16x16", 4096: "16x16x16"}
# Per-host chip bounds where a slice is not libtpu's default host of 4 chips: smaller, or one 8-chip v5e / v6e host.
_HOST_BOUNDS = {1: (1, 1, 1), 2: (1, 2, 1), 8: (2, 4, 1)}


def tpu_target(name: str) -> Target:
    """A Cloud TPU accelerator type (`v3-8`, `v5litepod-1`, ...) as a target."""
    match = re.fullmatch(r"(v2|v3|v4|v5p|v5litepod|v5lite|v6e)-(\d+)", name)
    if not match:
        raise ConfigError(f"unknown target {name!r}: a Cloud TPU type such as v3-8, v4-8, v5litepod-8, v5p-8, "
                          f"v6e-8, or a GPU set such as h100-8 ({', '.join(gpu_names())})")
    generation, count = _CLOUD_PREFIX[match.group(1)], int(match.group(2))
    per_chip = _CORES_PER_CHIP_IN_NAME[generation]
    if count % per_chip or count < per_chip:
        raise ConfigError(f"{name}: a {generation} slice counts {per_chip} cores per chip")
    chips = count // per_chip
    grid = (_GRID_3D if generation in ("v4", "v5p") else _GRID_2D).get(chips)
    if grid is None:
        raise ConfigError(f"{name}: no known {generation} topology of {chips} chips")
    host = chips if chips <= _CHIPS_PER_HOST[generation] else 4  # larger slices: hosts of 4 chips
    options = (("chips_per_host_bounds", _HOST_BOUNDS[host]),) if host != 4 else ()
    if generation in _CHIP_CONFIG:
        options += (("chip_config_name", _CHIP_CONFIG[generation]),)
    return Target(name, "tpu", f"XLA:TPU (libtpu), {generation}", TPU_CHIPS[generation],
                  chips * _DEVICES_PER_CHIP[generation], f"{generation}:{grid}", options)


def gpu_names() -> list[str]:
    from mesh_transformer import gpu_specs

    return sorted(gpu_specs.SPECS)


def gpu_target(name: str) -> Target:
    """A GPU set `KIND-N` (`h100-8`, `a100-80-1`, ...) as a target: N GPUs of one kind in one host."""
    from mesh_transformer import gpu_specs

    kind, _, count = name.rpartition("-")
    spec = gpu_specs.SPECS[kind]
    return Target(name, "gpu", f"XLA:GPU (CUDA plugin), {spec.name}", _gpu_chip(spec), int(count), f"1x1x{count}")


def _gpu_chip(spec) -> Chip:
    return Chip(spec.name, spec.memory_bytes, spec.peak_flops, spec.bandwidth)


def chip_of(device_kind: str) -> Chip | None:
    """The datasheet figures of a device JAX reports as `device_kind` (a TPU generation's, or a GPU of `gpu_specs`
    by the name CUDA gives it), for benchmarks to measure against; None for a kind not known here (the CPU)."""
    if device_kind in _TPU_KINDS:
        return TPU_CHIPS[_TPU_KINDS[device_kind]]
    from mesh_transformer import gpu_specs

    return next((_gpu_chip(spec) for spec in gpu_specs.SPECS.values() if spec.name == device_kind), None)


def target(name: str) -> Target:
    """The target of a name users type: a Cloud TPU type, or a GPU set."""
    name = name.strip().lower()
    kind, _, count = name.rpartition("-")
    return gpu_target(name) if count.isdigit() and kind in gpu_names() else tpu_target(name)


def compile_devices(t: Target) -> list:
    """The target's compile-only devices. JAX must run on the CPU in this process (set before it starts)."""
    import jax
    from jax.experimental import topologies

    plugin = "libtpu" if t.platform == "tpu" else "jax_plugins.xla_cuda12"
    if not platforms.installed(plugin):
        raise ConfigError(f"{t.name}: {t.compiler} needs {plugin.replace('jax_plugins.xla_', 'the CUDA plugin of ')}, "
                          f"which is not installed (pip install -r requirements-dev.txt)")
    os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")  # no metadata server to ask: this is not a TPU VM
    # libtpu takes a lock file so that one process owns a host's TPU; compile-only devices own nothing, and two
    # processes compiling at once (pytest's workers, a script beside them) would find it taken.
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    with contextlib.suppress(RuntimeError):  # already started: fine if it started on the CPU
        jax.config.update("jax_platforms", "cpu")
    with platforms.quiet_stderr():
        if t.platform == "tpu":
            topology = topologies.get_topology_desc(topology_name=t.topology, platform="tpu",
                                                    **{k: list(v) if isinstance(v, tuple) else v for k, v in t.options})
        else:
            from mesh_transformer import gpu_specs

            topology = topologies.get_topology_desc(topology_name="", platform="cuda", topology=t.topology,
                                                    target_config=gpu_specs.target_config(t.name.rpartition("-")[0]))
    devices = list(topology.devices)
    if len(devices) != t.n_devices:
        raise ConfigError(f"{t.name}: the compiler gave {len(devices)} devices, expected {t.n_devices}")
    return devices
