"""Device meshes for the shard_map path: ('dp', 'mp') from the config and the devices."""
from __future__ import annotations

from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

from mesh_transformer.config import Config, check_devices

DP, MP = "dp", "mp"


def make(cfg: Config, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """The ('dp', 'mp') mesh: mp = cores_per_replica, dp = the rest of the devices."""
    devices = list(jax.devices() if devices is None else devices)
    check_devices(cfg, len(devices))
    return make_dp_mp(len(devices) // cfg.cores_per_replica, cfg.cores_per_replica, devices)


def make_dp_mp(dp: int, mp: int, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A ('dp', 'mp') mesh of Auto axes over the first dp * mp devices."""
    devices = list(jax.devices() if devices is None else devices)[: dp * mp]
    # Auto axes: shardings are ours to place; jax.make_mesh would default to Explicit.
    return Mesh(np.array(devices).reshape(dp, mp), (DP, MP), axis_types=(AxisType.Auto, AxisType.Auto))


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
