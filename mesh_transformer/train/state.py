"""The train state {"step", "params", "opt_state"} on a Layout, and the one jitted train step and eval step.

Every function takes a Layout and a Split (model/split.py) and works the same for each parallelism mode and each
split: the Layout places the leaves and supplies loss and gradients; this file adds the optimizer and the jit
boundaries (accumulation: train/accumulate.py). The state's "params" are the split's trainable tree (the params, or
LoRA's adapters); the steps take its frozen tree (nothing, or LoRA's base) as one more argument: read, never
donated, never differentiated.
"""
from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import optax

from mesh_transformer.model.split import Split, split_of
from mesh_transformer.parallel.layout import Layout
from mesh_transformer.train import accumulate


def shardings_of(abstract):
    """The sharding of every leaf of a tree of sharded ShapeDtypeStructs."""
    return jax.tree.map(lambda s: s.sharding, abstract)


def abstract_train_state(layout: Layout, optimizer: optax.GradientTransformation, split: Split | None = None) -> dict:
    """Shapes, dtypes and shardings of {"step", "params", "opt_state"}, allocating nothing (restore, AOT)."""
    split = split or split_of(layout.cfg)
    params = layout.abstract(split.trainable_axes(layout.cfg))
    opt_state = jax.eval_shape(optimizer.init, params)
    opt_state = jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), opt_state,
                             layout.follow_params(opt_state, params))
    step = jax.ShapeDtypeStruct((), jnp.int32, sharding=layout.replicated)
    return {"step": step, "params": params, "opt_state": opt_state}


def init_opt_state(layout: Layout, params: dict, optimizer: optax.GradientTransformation,
                   split: Split | None = None):
    """Fresh optimizer state for the trainable tree `params`, made in place on the mesh."""
    shardings = shardings_of(abstract_train_state(layout, optimizer, split)["opt_state"])
    return jax.jit(optimizer.init, out_shardings=shardings)(params)


def init_train_state(layout: Layout, optimizer: optax.GradientTransformation, key: jax.Array,
                     split: Split | None = None) -> dict:
    """{"step": 0, "params", "opt_state"} with a fresh trainable tree, every leaf made in its shards."""
    split = split or split_of(layout.cfg)
    params = layout.init(split.init, split.trainable_axes(layout.cfg), key)
    step = jax.device_put(jnp.zeros((), jnp.int32), layout.replicated)
    return {"step": step, "params": params, "opt_state": init_opt_state(layout, params, optimizer, split)}


def frozen_shardings(layout: Layout, split: Split | None = None):
    """Where the frozen tree the steps take lives."""
    split = split or split_of(layout.cfg)
    return layout.shardings(split.frozen_axes(layout.cfg))


def make_train_step(layout: Layout, optimizer: optax.GradientTransformation, schedule: Callable,
                    split: Split | None = None) -> Callable:
    """Jitted (state, tokens [G, B, T+1], frozen) -> (state, metrics): the state's shardings in and out, the state
    donated, metrics replicated. The split is the config's (`split_of`) unless given."""
    split = split or split_of(layout.cfg)
    shardings = shardings_of(abstract_train_state(layout, optimizer, split))
    # Micro-batches add their layer gradients into the sum inside the backward (`accumulate.into`). That backward
    # recomputes each layer, as remat does, so it is used where remat is on.
    into = layout.loss_and_grad_fn(split, accumulate.into(split)) if layout.cfg.remat else None
    step = accumulate.accumulated_train_step(layout.loss_and_grad_fn(split), optimizer, schedule, into)
    return jax.jit(step, in_shardings=(shardings, layout.batch_sharding(), frozen_shardings(layout, split)),
                   out_shardings=(shardings, layout.replicated), donate_argnums=0)


def make_eval_step(layout: Layout, split: Split | None = None) -> Callable:
    """Jitted (trainable, tokens [B, T+1], frozen) -> mean loss."""
    split = split or split_of(layout.cfg)
    loss = layout.loss_fn(split)
    trainable = layout.shardings(split.trainable_axes(layout.cfg))
    return jax.jit(lambda params, tokens_BxT1, frozen: loss(params, frozen, tokens_BxT1),
                   in_shardings=(trainable, layout.batch_sharding(False), frozen_shardings(layout, split)),
                   out_shardings=layout.replicated)
