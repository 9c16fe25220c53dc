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
