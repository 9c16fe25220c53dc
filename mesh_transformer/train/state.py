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
from jax.experimental.layout import Format
from jax.experimental.layout import Layout as MemoryLayout

from mesh_transformer.model import gptj, lora
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


def abstract_step_args(layout: Layout, optimizer: optax.GradientTransformation, split: Split | None = None) -> tuple:
    """The train step's arguments as sharded ShapeDtypeStructs: (state, tokens [G, B, T+1], frozen)."""
    split = split or split_of(layout.cfg)
    cfg = layout.cfg
    tokens = jax.ShapeDtypeStruct((cfg.gradient_accumulation_steps, layout.global_batch, cfg.seq + 1), jnp.int32,
                                  sharding=layout.batch_sharding())
    frozen = lora.base_dtypes(cfg, layout.abstract(split.frozen_axes(cfg), gptj.precision(cfg).frozen))
    return abstract_train_state(layout, optimizer, split), tokens, frozen


def make_train_step(layout: Layout, optimizer: optax.GradientTransformation, schedule: Callable,
                    split: Split | None = None, frozen_formats=None) -> Callable:
    """Jitted (state, tokens [G, B, T+1], frozen) -> (state, metrics): the state's shardings in and out, the state
    donated, metrics replicated. The split is the config's (`split_of`) unless given; the frozen tree in
    `frozen_formats` where given (`compile_train_step`), else in its shardings' default layouts."""
    split = split or split_of(layout.cfg)
    shardings = shardings_of(abstract_train_state(layout, optimizer, split))
    # Micro-batches add their layer gradients into the sum inside the backward (`accumulate.into`). That backward
    # recomputes each layer whole, as remat "full" does, so it is used there; a policy that keeps more of a layer
    # (remat_policy) takes the plain sum of each micro-batch's gradients, a second set of them.
    into = accumulate.into(split) if layout.cfg.remat and layout.cfg.remat_policy == "full" else None
    step = accumulate.accumulated_train_step(layout.grad_flow(split, into), optimizer, schedule)
    frozen = frozen_shardings(layout, split) if frozen_formats is None else frozen_formats
    return jax.jit(step, in_shardings=(shardings, layout.batch_sharding(), frozen),
                   out_shardings=(shardings, layout.replicated), donate_argnums=0)


def auto_frozen_formats(layout: Layout, split: Split | None = None):
    """The frozen tree's shardings, each in whatever layout the compiler chooses (`compile_train_step`)."""
    return jax.tree.map(lambda s: Format(MemoryLayout.AUTO, s), frozen_shardings(layout, split))


def compile_train_step(layout: Layout, optimizer: optax.GradientTransformation, schedule: Callable,
                       split: Split | None = None, compiler_options: dict | None = None) -> tuple:
    """(the train step compiled ahead, the frozen tree's formats): the frozen tree (LoRA's base) taken in the
    layouts the compiler chooses, which `place_frozen` puts it in. In default layouts XLA:TPU copies GPT-J's whole
    stacked q, k and v base into the transposed layout its products want, before the layer loop: 2.63 GiB of
    temporaries in GPT-J-6B's LoRA step on one v5e chip (aot_check.py --topology v5litepod-1)."""
    split = split or split_of(layout.cfg)
    step = make_train_step(layout, optimizer, schedule, split, frozen_formats=auto_frozen_formats(layout, split))
    options = layout.policy.compiler_options() if compiler_options is None else compiler_options
    compiled = step.lower(*abstract_step_args(layout, optimizer, split)).compile(compiler_options=options)
    return compiled, compiled.input_formats[0][2]


def place_frozen(frozen, formats):
    """The frozen tree moved into `formats` leaf by leaf, each leaf's old buffer donated: one leaf's bytes extra at
    a time, not a second base. The tree given is spent."""
    leaves, treedef = jax.tree.flatten(frozen)
    placed = [jax.device_put(x, f, donate=True) for x, f in zip(leaves, treedef.flatten_up_to(formats))]
    return treedef.unflatten(placed)


def make_eval_step(layout: Layout, split: Split | None = None, frozen_formats=None) -> Callable:
    """Jitted (trainable, tokens [B, T+1], frozen) -> mean loss; the frozen tree in `frozen_formats` where given (the
    train step's, from `compile_train_step`)."""
    split = split or split_of(layout.cfg)
    loss = layout.loss_fn(split)
    trainable = layout.shardings(split.trainable_axes(layout.cfg))
    frozen = frozen_shardings(layout, split) if frozen_formats is None else frozen_formats
    return jax.jit(lambda params, tokens_BxT1, frozen: loss(params, frozen, tokens_BxT1),
                   in_shardings=(trainable, layout.batch_sharding(False), frozen),
                   out_shardings=layout.replicated)
