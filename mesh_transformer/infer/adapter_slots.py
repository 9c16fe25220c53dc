"""The served LoRA adapters' slots on the devices (model/lora_slots.py): added empty beside each placed layer, an
adapter written into a slot or a slot cleared while the params serve, by one program whatever the slot (nothing
recompiles when adapters come and go), the stacks donated so they are updated in place."""
from __future__ import annotations

import dataclasses
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from mesh_transformer.model import gptj, lora_slots
from mesh_transformer.parallel.layout import Layout


def _shardings(layout: Layout) -> dict:
    """Where one layer's stacks live."""
    return jax.tree.map(partial(NamedSharding, layout.mesh), layout.placed_specs()["layers"][0]["lora"],
                        is_leaf=lambda x: isinstance(x, P))


def with_slots(params: dict, layout: Layout) -> dict:
    """The placed params with empty adapter slots beside each layer (`max_loras` of them; as they are where they have
    them already, or the config serves none)."""
    cfg = layout.cfg
    if not cfg.max_loras or "lora" in params["layers"][0]:
        return params
    shapes, shardings = lora_slots.slot_shapes(cfg, gptj.precision(cfg).compute), _shardings(layout)
    zeros = jax.jit(lambda: jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes), out_shardings=shardings)
    return {**params, "layers": [{**layer, "lora": zeros()} for layer in params["layers"]]}


class SlotWriter:
    """Writes adapters into the slots of placed params (`with_slots`): `write(params, slot, adapters, scale)` and
    `clear(params, slot)` return the params with that slot replaced; the old stacks are donated."""

    def __init__(self, layout: Layout):
        self.layout, self.cfg = layout, layout.cfg
        self.dtype = gptj.precision(layout.cfg).compute
        stacks = _shardings(layout)
        one = jax.tree.map(lambda sh: NamedSharding(layout.mesh, P(*sh.spec[1:])), stacks)
        self._one = [one] * layout.cfg.layers
        self._write = jax.jit(_write, donate_argnums=0, out_shardings=[stacks] * layout.cfg.layers)

    def write(self, params: dict, slot: int, adapters: dict, scale: float) -> dict:
        """`adapters` ({target: {"a" [L, in, r], "b" [L, r, out]}}, f32, checked against the base) in `slot`."""
        values = lora_slots.slot_values(adapters, scale, self.cfg, np.dtype(self.dtype))
        return self._put(params, slot, values)

    def clear(self, params: dict, slot: int) -> dict:
        shapes = lora_slots.slot_shapes(dataclasses.replace(self.cfg, max_loras=1), self.dtype)
        zeros = jax.tree.map(lambda s: np.zeros(s.shape[1:], s.dtype), shapes)
        return self._put(params, slot, [zeros] * self.cfg.layers)

    def _put(self, params: dict, slot: int, values: list) -> dict:
        stacks = [layer["lora"] for layer in params["layers"]]
        written = self._write(stacks, jax.device_put(values, self._one), np.int32(slot))
        return {**params, "layers": [{**layer, "lora": s} for layer, s in zip(params["layers"], written)]}


def _write(stacks: list, values: list, slot: jax.Array) -> list:
    return jax.tree.map(lambda s, v: lax.dynamic_update_index_in_dim(s, v.astype(s.dtype), slot, 0), stacks, values)
