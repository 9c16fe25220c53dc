"""Gradient accumulation: G micro-batches' gradients summed in f32, then one optimizer update; a wrapper around the
step, for either split (model/split.py) on either kind of Layout.

With remat on, each micro-batch adds its layer gradients into the running sum inside its own backward (`into`): a
custom VJP of the layer scan whose reverse scan adds each layer's gradient into the sum in place, so accumulation
holds one set of layer gradients, not the sum and this micro-batch's (GPT-J-6B, 16 micro-steps, by the CPU compile:
14.62 GiB per device on fsdp 8, 14.09 on mp 8).
"""
from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax import lax

from mesh_transformer.model.gptj import LayerLoop
from mesh_transformer.model.split import Split
from mesh_transformer.parallel.layout import GradFlow


def into(split: Split) -> Callable:
    """Layout.loss_and_grad_fn's `into` hook: (loss, trainable, frozen, tokens, grad_sum) -> (loss value, grad_sum +
    the gradients w.r.t. the trainable tree). The stacked layers' part is added inside their backward, the rest
    (embedding, head) here."""
    def value_and_grad_into(loss: Callable, trainable, frozen, tokens_BxT1, grad_sum):
        loop = _accumulating_loop(split.trained_layers(grad_sum), split.trained_in_layer)
        value, grads = jax.value_and_grad(partial(loss, loop=loop))(trainable, frozen, tokens_BxT1)
        summed = jax.tree.map(jnp.add, grad_sum, grads)
        return value, split.with_trained_layers(summed, split.trained_layers(grads))

    return value_and_grad_into


def _accumulating_loop(layer_grad_sum: Any, trained: int) -> LayerLoop:
    """The layer loop (`gptj.run`'s `loop`) whose backward adds the trained layers' gradient into `layer_grad_sum`."""
    def loop(step, h_BxTxD, layers_, states):
        return _layers_into(lambda h, layer: step(h, layer, None)[0], trained, h_BxTxD, layers_,
                            layer_grad_sum), states

    return loop


@partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _layers_into(step: Callable, trained: int, h_BxTxD: jax.Array, layers_: tuple, grad_sum: Any) -> jax.Array:
    """The layer scan (remat: each layer's input is saved, the rest recomputed in the backward) whose backward adds
    each layer's gradient into `grad_sum` (stacked like the trained layers, f32) as the reverse scan makes it, in
    place. `layers_` is (params, adapters), of which `trained` is trained. The trained layers' cotangent it returns
    is grad_sum + this batch's gradient, the frozen ones and grad_sum get none. That is not linear in the output's
    cotangent: it is for one value_and_grad of the loss (`into`), not for jvp or higher derivatives."""
    return lax.scan(lambda h, layer: (step(h, layer), None), h_BxTxD, layers_)[0]


def _layers_into_fwd(step, trained, h_BxTxD, layers_, grad_sum):
    out_BxTxD, inputs_LxBxTxD = lax.scan(lambda h, layer: (step(h, layer), h), h_BxTxD, layers_)
    return out_BxTxD, (layers_, grad_sum, inputs_LxBxTxD)


def _with(pair: tuple, index: int, value: Any) -> tuple:
    return (value, pair[1]) if index == 0 else (pair[0], value)


def _layers_into_bwd(step, trained, residuals, d_out_BxTxD):
    layers_, grad_sum, inputs_LxBxTxD = residuals

    def back(carry, xs):
        d_h_BxTxD, acc = carry
        index, layer, h_BxTxD = xs
        _, vjp = jax.vjp(lambda t, h: step(h, _with(layer, trained, t)), layer[trained], h_BxTxD)
        d_trained, d_h_BxTxD = vjp(d_h_BxTxD)
        acc = jax.tree.map(lambda a, g: lax.dynamic_update_index_in_dim(
            a, lax.dynamic_index_in_dim(a, index, keepdims=False) + g.astype(a.dtype), index, 0), acc, d_trained)
        return (d_h_BxTxD, acc), None

    n_layers = inputs_LxBxTxD.shape[0]
    (d_h_BxTxD, acc), _ = lax.scan(back, (d_out_BxTxD, grad_sum), (jnp.arange(n_layers), layers_, inputs_LxBxTxD),
                                   reverse=True)
    frozen = jax.tree.map(lambda _: None, layers_[1 - trained])
    return d_h_BxTxD, _with((frozen, frozen), trained, acc), None


_layers_into.defvjp(_layers_into_fwd, _layers_into_bwd)


def accumulated_train_step(grads: GradFlow, optimizer: optax.GradientTransformation, schedule: Callable) -> Callable:
    """(state, tokens [G, B, T+1], frozen) -> (state, metrics): gradients of G micro-batches summed in f32, one
    update of the state's trainable tree. `grads` (`Layout.grad_flow`) gives each micro-batch's gradient sum (added
    into the running sum by `loss_and_grad_into` where it has one) and reduces the sum to the optimizer's
    gradients."""
    def step(state, tokens_GxBxT1, frozen):
        def micro(carry, tokens_BxT1):
            loss_sum, grad_sum = carry
            if grads.loss_and_grad_into is not None:
                loss, grad_sum = grads.loss_and_grad_into(state["params"], frozen, tokens_BxT1, grad_sum)
                return (loss_sum + loss, grad_sum), None
            loss, micro_grads = grads.loss_and_grad(state["params"], frozen, tokens_BxT1)
            return (loss_sum + loss, jax.tree.map(jnp.add, grad_sum, micro_grads)), None

        n_micro = tokens_GxBxT1.shape[0]
        if n_micro == 1:  # no accumulator: the gradients go straight into the update
            loss_sum, grad_sum = grads.loss_and_grad(state["params"], frozen, tokens_GxBxT1[0])
        else:
            zeros = grads.zeros(state["params"])
            (loss_sum, grad_sum), _ = lax.scan(micro, (jnp.zeros((), jnp.float32), zeros), tokens_GxBxT1)
        mean_grads = jax.tree.map(lambda g: g / n_micro, grads.reduce(grad_sum))
        updates, opt_state = optimizer.update(mean_grads, state["opt_state"], state["params"])
        params = optax.apply_updates(state["params"], updates)
        metrics = {"loss": loss_sum / n_micro, "grad_norm": optax.global_norm(mean_grads),
                   "lr": schedule(state["step"])}
        return {"step": state["step"] + 1, "params": params, "opt_state": opt_state}, metrics

    return step
