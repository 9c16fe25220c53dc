"""LoRA adapters served side by side over one base (vLLM's multi-LoRA): each placed layer holds a stack of adapter
slots beside its weights, and each row of a step applies its own slot's adapter (or none) in the one program.

A slot holds, for every projection the family can adapt (`families.lora_paths`), A [in, r] and B [r, out] at the
served rank r (config key `max_lora_rank`; a smaller adapter's extra columns are zeros, a target it lacks all
zeros) with its scale folded into B: an adapted projection is x @ W + (x @ A_s) @ B_s for the row's slot s. The
stacks [S, in, r] and [S, r, out] (S = `max_loras`) are placed like the weights they adapt under the Megatron rules
(`slot_axes`): A of a column-split weight replicated and B split like its columns, A of a row-split weight split like
its rows and B replicated, so each device's part joins the block's one psum, as in training (model/lora.py).

Which slot each row runs travels with its sampling values (`choose.Sampling.adapter`, -1: the base alone), so the
programs are the engine's own with one more per-row array. A step of no more rows than slots gathers each row's
adapter; a wider one reads every slot once and keeps each row's own (the fewer bytes: a decode step is bound by
memory). A layer whose step has no adapted row skips the low-rank products.
"""
from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from mesh_transformer.config import LORA_TARGETS, Config, ConfigError
from mesh_transformer.model import lora, table

SLOT_AXIS = "lora_slots"  # no rule places it: every device holds every slot of its part


class Rows(NamedTuple):
    """The adapter slot of each row of a step [R] (i32, -1: none), as a layer's projections see it."""
    adapter: jax.Array


def slot_axes(cfg: Config) -> dict:
    """One layer's stacks' logical axes, {target: {"a": (slots, in, lora), "b": (slots, lora, out)}}."""
    every = dataclasses.replace(cfg, lora_rank=cfg.max_lora_rank, lora_targets=list(LORA_TARGETS))
    return {t: {w: (SLOT_AXIS, *axes[1:]) for w, axes in ab.items()} for t, ab in lora.lora_axes(every).items()}


def slot_shapes(cfg: Config, dtype) -> dict:
    """One layer's stacks as ShapeDtypeStructs (global shapes)."""
    sizes = {**table.axis_sizes(cfg), SLOT_AXIS: cfg.max_loras, "lora": cfg.max_lora_rank}
    return table.shapes_of(slot_axes(cfg), sizes, dtype)


def slot_values(adapters: dict, scale: float, cfg: Config, dtype) -> list[dict]:
    """A stacked adapter ({target: {"a" [L, in, r], "b" [L, r, out]}}, f32) as one slot's contents per layer: every
    target at the served rank, zeros where the adapter has none, its scale folded into B (numpy, in `dtype`)."""
    rank = next(iter(adapters.values()))["a"].shape[-1]
    if rank > cfg.max_lora_rank:
        raise ConfigError(f"adapter rank {rank} is over the served maximum {cfg.max_lora_rank} (--max-lora-rank)")
    shapes = slot_shapes(dataclasses.replace(cfg, max_loras=1), dtype)
    layers = []
    for i in range(cfg.layers):
        layer = {}
        for target, ab in shapes.items():
            a, b = np.zeros(ab["a"].shape[1:], dtype), np.zeros(ab["b"].shape[1:], dtype)
            if target in adapters:
                a[:, :rank] = adapters[target]["a"][i]
                b[:rank] = adapters[target]["b"][i] * scale
            layer[target] = {"a": a, "b": b}
        layers.append(layer)
    return layers


def _delta(x_RxTxI: jax.Array, ab: dict, adapter_R: jax.Array, gather: bool = False) -> jax.Array:
    """Each row's (x @ A_s) @ B_s for its slot s (zeros for a row of none) [R, T, out], from this device's part of
    the stacks {"a" [S, in, r], "b" [S, r, out]}: each row's own slot's A and B gathered where the rows are no more
    than the slots (or `gather`), else every slot's read once and each row's kept."""
    n_slots, rows = ab["a"].shape[0], adapter_R.shape[0]
    if gather or rows <= n_slots:  # each row's own slot's A and B
        slot_R = jnp.maximum(adapter_R, 0)
        a_RxIxQ, b_RxQxO = jnp.take(ab["a"], slot_R, 0), jnp.take(ab["b"], slot_R, 0)
        xa_RxTxQ = jnp.einsum("rti,riq->rtq", x_RxTxI, a_RxIxQ)
        xa_RxTxQ = xa_RxTxQ * (adapter_R >= 0).astype(xa_RxTxQ.dtype)[:, None, None]
        return jnp.einsum("rtq,rqo->rto", xa_RxTxQ, b_RxQxO)
    mine_RxS = (adapter_R[:, None] == jnp.arange(n_slots)[None]).astype(x_RxTxI.dtype)  # every slot, each row its own
    xa_RxTxSxQ = jnp.einsum("rti,siq->rtsq", x_RxTxI, ab["a"]) * mine_RxS[:, None, :, None]
    return jnp.einsum("rtsq,sqo->rto", xa_RxTxSxQ, ab["b"])


def adapted(proj, slots: dict, rows: Rows):
    """A layer's `layers.Projections` with each row's adapter added to every adapted product; a step without an
    adapted row runs none of them (one `lax.cond` a side)."""
    some = jnp.any(rows.adapter >= 0)

    def delta(x, target):  # "mlp": the MLP's input side, a gated MLP's [gate | fc_in]
        if target == "mlp" and "gate" in slots:
            return jnp.concatenate([_delta(x, slots[t], rows.adapter) for t in ("gate", "fc_in")], -1)
        return _delta(x, slots["fc_in" if target == "mlp" else target], rows.adapter)

    def plus(ys: tuple, xs: tuple, targets: tuple) -> tuple:
        def deltas():
            return tuple(delta(x, t).astype(y.dtype) for y, x, t in zip(ys, xs, targets))
        return tuple(y + d for y, d in zip(ys, lax.cond(some, deltas, lambda: tuple(map(jnp.zeros_like, ys)))))

    def inputs(n_attn, n_mlp):
        return plus(proj.inputs(n_attn, n_mlp), (n_attn, n_attn, n_attn, n_mlp), ("q", "k", "v", "mlp"))

    def output(attn, act):
        y = proj.output(attn, act)

        def deltas():
            adapter_R = rows.adapter
            return (_delta(attn, slots["out"], adapter_R) + _delta(act, slots["fc_out"], adapter_R)).astype(y.dtype)
        return y + lax.cond(some, deltas, lambda: jnp.zeros_like(y))

    return proj._replace(
        inputs=inputs, attn_inputs=lambda n: plus(proj.attn_inputs(n), (n, n, n), ("q", "k", "v")),
        mlp_input=lambda n: plus((proj.mlp_input(n),), (n,), ("mlp",))[0], output=output,
        attn_output=lambda attn: plus((proj.attn_output(attn),), (attn,), ("out",))[0],
        mlp_output=lambda act: plus((proj.mlp_output(act),), (act,), ("fc_out",))[0])
