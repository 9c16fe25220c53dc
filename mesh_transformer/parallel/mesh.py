"""Device meshes, one builder for both axis vocabularies (('dp', 'mp') and ('data', 'fsdp', 'tensor')), and the
multi-process start-up through jax.distributed."""
from __future__ import annotations

import math
import os
import urllib.request
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


# Where the environment says how many processes a run has (the launchers' own variables), without asking JAX.
_PROCESS_COUNT_VARS = ("OMPI_COMM_WORLD_SIZE", "SLURM_NTASKS", "PMI_SIZE")
_TPU_WORKER_VARS = ("TPU_PROCESS_ADDRESSES", "TPU_WORKER_HOSTNAMES")  # comma-separated hosts (GKE)
TPU_METADATA_URL = "http://metadata.google.internal/computeMetadata/v1/instance/attributes/worker-network-endpoints"


def cluster_hint() -> tuple[int, str] | None:
    """(process count, where it was read) where the environment describes a run of several processes; None where
    nothing does. A TPU VM's hosts come from its metadata server (one quick query: a host that cannot reach it, or a
    VM of one host, is a single process)."""
    from mesh_transformer import platforms

    for var in _PROCESS_COUNT_VARS:
        if os.environ.get(var, "").strip().isdigit():
            return int(os.environ[var]), var
    for var in _TPU_WORKER_VARS:
        if os.environ.get(var, "").strip():
            return len(os.environ[var].split(",")), var
    if platforms.expected_platform() != platforms.TPU or os.environ.get("TPU_SKIP_MDS_QUERY") is not None:
        return None
    request = urllib.request.Request(TPU_METADATA_URL, headers={"Metadata-Flavor": "Google"})
    try:
        with urllib.request.urlopen(request, timeout=2) as response:
            endpoints = response.read().decode().strip()
    except (OSError, ValueError):  # no metadata server here: nothing to join
        return None
    return (len(endpoints.split(",")), "the TPU VM's metadata") if endpoints else None


def init_distributed(coordinator: str | None = None, num_processes: int | None = None,
                     process_id: int | None = None) -> None:
    """Join a multi-process run through JAX's own runtime (no Ray).

    With no arguments, a process the environment describes as one of several (`cluster_hint`: MPI, SLURM, a TPU
    VM's hosts) joins through JAX's auto-detection, and a ConfigError naming the flags says when that fails; a
    single process never calls jax.distributed at all. On CPU the cross-process collectives go through gloo.
    """
    explicit = coordinator is not None or num_processes is not None or process_id is not None
    if explicit and (coordinator is None or num_processes is None or process_id is None):
        raise ValueError("--coordinator, --num-processes and --process-id go together")
    jax.config.update("jax_cpu_collectives_implementation", "gloo")  # affects the CPU backend only
    if explicit:
        jax.distributed.initialize(coordinator, num_processes=num_processes, process_id=process_id)
        return
    hint = cluster_hint()
    if hint is None or hint[0] <= 1:
        return
    try:
        jax.distributed.initialize()
    except Exception as e:  # the launcher's variables say several processes, JAX could not tell how to join them
        first = (str(e).splitlines() or [type(e).__name__])[0][:200]
        raise ConfigError(f"{hint[1]} says this run has {hint[0]} processes, but joining them failed ({first}); "
                          f"give --coordinator HOST:PORT, --num-processes and --process-id") from None
