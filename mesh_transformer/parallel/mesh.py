"""Device meshes, one builder for both axis vocabularies (('dp', 'mp') and ('data', 'fsdp', 'tensor')), and the
multi-process start-up through jax.distributed."""
from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import jax
from jax.sharding import AxisType, Mesh

from mesh_transformer.config import ConfigError

DP, MP = "dp", "mp"  # the shard_map (Megatron) kind
DATA, FSDP, TENSOR = "data", "fsdp", "tensor"  # the GSPMD kind


def make_mesh(shape: Mapping[str, int], devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A mesh of Auto axes {name: size} over the first prod(sizes) devices, in jax.make_mesh's topology-aware order
    (the last axes on the fastest links)."""
    devices = list(jax.devices() if devices is None else devices)
    needed = math.prod(shape.values())
    if min(shape.values()) < 1 or needed > len(devices):
        sizes = ", ".join(f"{name}={size}" for name, size in shape.items())
        raise ConfigError(f"mesh {sizes} needs {needed} devices; {len(devices)} are available")
    # Auto axes: shardings are ours to place and XLA propagates them; jax.make_mesh would default to Explicit.
    return jax.make_mesh(tuple(shape.values()), tuple(shape), axis_types=(AxisType.Auto,) * len(shape),
                         devices=devices[:needed])


def make_dp_mp(dp: int, mp: int, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """The ('dp', 'mp') mesh of the shard_map kind."""
    return make_mesh({DP: dp, MP: mp}, devices)


def init_distributed(coordinator: str | None = None, num_processes: int | None = None,
                     process_id: int | None = None) -> None:
    """Join a multi-process run through JAX's own runtime (no Ray).

    With no arguments JAX auto-detects the cluster where it can (TPU VMs, SLURM, Open MPI); a single process
    with nothing to detect just goes on alone. On CPU the cross-process collectives go through gloo.
    """
    explicit = coordinator is not None or num_processes is not None or process_id is not None
    if explicit and (coordinator is None or num_processes is None or process_id is None):
        raise ValueError("--coordinator, --num-processes and --process-id go together")
    jax.config.update("jax_cpu_collectives_implementation", "gloo")  # affects the CPU backend only
    if explicit:
        jax.distributed.initialize(coordinator, num_processes=num_processes, process_id=process_id)
        return
    try:
        jax.distributed.initialize()
    except (ValueError, RuntimeError) as e:  # nothing to auto-detect: a single-process run
        if "coordinator_address" not in str(e) and "detect" not in str(e).lower():
            raise
