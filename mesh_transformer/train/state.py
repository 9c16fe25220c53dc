"""The train state {"step", "params", "opt_state"} on a Layout, and the one jitted train step and eval step.

Every function takes a Layout and works the same for each parallelism mode: the Layout places the leaves and
supplies loss and gradients; this file adds the optimizer, gradient accumulation and the jit boundaries.
With LoRA (cfg.lora_rank > 0) the state's "params" are the adapters alone, and the steps take the frozen base
params as one more argument: read, never donated, never differentiated.
"""
from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import optax
from jax import lax

from mesh_transformer.parallel.layout import Layout


def shardings_of(abstract):
    """The sharding of every leaf of a tree of sharded ShapeDtypeStructs."""
    return jax.tree.map(lambda s: s.sharding, abstract)


def abstract_train_state(layout: Layout, optimizer: optax.GradientTransformation) -> dict:
    """Shapes, dtypes and shardings of {"step", "params", "opt_state"}, allocating nothing (restore, AOT)."""
    params = layout.abstract_lora() if layout.cfg.lora_rank else layout.abstract_params()
    opt_state = jax.eval_shape(optimizer.init, params)
    opt_state = jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), opt_state,
                             layout.follow_params(opt_state, params))
    step = jax.ShapeDtypeStruct((), jnp.int32, sharding=layout.replicated)
    return {"step": step, "params": params, "opt_state": opt_state}


def init_opt_state(layout: Layout, params: dict, optimizer: optax.GradientTransformation):
    """Fresh optimizer state for `params`, made in place on the mesh."""
    shardings = shardings_of(abstract_train_state(layout, optimizer)["opt_state"])
    return jax.jit(optimizer.init, out_shardings=shardings)(params)


def init_train_state(layout: Layout, optimizer: optax.GradientTransformation, key: jax.Array) -> dict:
    """{"step": 0, "params", "opt_state"} with random params (or fresh adapters), every leaf made in its shards."""
    params = layout.init_lora(key) if layout.cfg.lora_rank else layout.init_params(key)
    step = jax.device_put(jnp.zeros((), jnp.int32), layout.replicated)
    return {"step": step, "params": params, "opt_state": init_opt_state(layout, params, optimizer)}


def accumulated_train_step(loss_and_grad: Callable, optimizer: optax.GradientTransformation,
                           schedule: Callable, loss_and_grad_into: Callable | None = None) -> Callable:
    """(state, tokens [G, B, T+1]) -> (state, metrics): gradients of G micro-batches summed in f32, one update.
    `loss_and_grad_into` (params, tokens, grad_sum) -> (loss, grad_sum + grads), where given, does the summing."""
    def step(state, tokens_GxBxT1):
        def micro(carry, tokens_BxT1):
            loss_sum, grad_sum = carry
            if loss_and_grad_into is not None:
                loss, grad_sum = loss_and_grad_into(state["params"], tokens_BxT1, grad_sum)
                return (loss_sum + loss, grad_sum), None
            loss, grads = loss_and_grad(state["params"], tokens_BxT1)
            return (loss_sum + loss, jax.tree.map(jnp.add, grad_sum, grads)), None

        n_micro = tokens_GxBxT1.shape[0]
        if n_micro == 1:  # no accumulator: the gradients go straight into the update
            loss_sum, grad_sum = loss_and_grad(state["params"], tokens_GxBxT1[0])
        else:
            zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), state["params"])
            (loss_sum, grad_sum), _ = lax.scan(micro, (jnp.zeros((), jnp.float32), zeros), tokens_GxBxT1)
        grads = jax.tree.map(lambda g: g / n_micro, grad_sum)
        updates, opt_state = optimizer.update(grads, state["opt_state"], state["params"])
        params = optax.apply_updates(state["params"], updates)
        metrics = {"loss": loss_sum / n_micro, "grad_norm": optax.global_norm(grads), "lr": schedule(state["step"])}
        return {"step": state["step"] + 1, "params": params, "opt_state": opt_state}, metrics

    return step


def make_train_step(layout: Layout, optimizer: optax.GradientTransformation, schedule: Callable) -> Callable:
    """Jitted (state, tokens [G, B, T+1]) -> (state, metrics): the state's shardings in and out, the state donated,
    metrics replicated. With LoRA: (state, tokens, base params) -> (state, metrics)."""
    shardings = shardings_of(abstract_train_state(layout, optimizer))
    in_shardings = (shardings, layout.batch_sharding())
    # Micro-batches add their layer gradients into the sum inside the backward (Layout's accumulate). That backward
    # recomputes each layer, as remat does, so it is used where remat is on.
    into = layout.cfg.remat
    if not layout.cfg.lora_rank:
        step = accumulated_train_step(layout.loss_and_grad_fn(), optimizer, schedule,
                                      layout.loss_and_grad_fn(accumulate=True) if into else None)
    else:
        lora_loss_and_grad = layout.lora_loss_and_grad_fn()
        lora_into = layout.lora_loss_and_grad_fn(accumulate=True) if into else None
        in_shardings += (layout.param_shardings(),)

        def step(train_state, tokens_GxBxT1, base):
            def loss_and_grad(adapters, tokens_BxT1):
                return lora_loss_and_grad(adapters, base, tokens_BxT1)

            def loss_and_grad_into(adapters, tokens_BxT1, grad_sum):
                return lora_into(adapters, base, tokens_BxT1, grad_sum)

            return accumulated_train_step(loss_and_grad, optimizer, schedule,
                                          loss_and_grad_into if into else None)(train_state, tokens_GxBxT1)

    return jax.jit(step, in_shardings=in_shardings, out_shardings=(shardings, layout.replicated), donate_argnums=0)


def make_eval_step(layout: Layout) -> Callable:
    """Jitted (params, tokens [B, T+1]) -> mean loss; with LoRA (adapters, tokens, base params) -> mean loss."""
    params, batch = layout.param_shardings(), layout.batch_sharding(False)
    if not layout.cfg.lora_rank:
        return jax.jit(layout.loss_fn(), in_shardings=(params, batch), out_shardings=layout.replicated)
    lora_loss = layout.lora_loss_fn()
    return jax.jit(lambda adapters, tokens_BxT1, base: lora_loss(adapters, base, tokens_BxT1),
                   in_shardings=(shardings_of(layout.abstract_lora()), batch, params), out_shardings=layout.replicated)
