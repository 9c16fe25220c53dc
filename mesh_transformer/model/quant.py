"""Weight-only int8 for inference: each matrix of a layer held as symmetric int8 with one f32 scale per output
(row of the joined matrices of `layers.fuse_layer`), and dequantized inside the matrix product: the int8 values,
converted to the compute dtype, multiply the activations with f32 accumulation, and each output is scaled after.
The embedding and the LM head stay in the compute dtype.

Per output channel, the scale is the row's largest magnitude over 127 (an all-zero row gets 1), and a weight w is
held as round(w / scale) in [-127, 127]: its error is at most half a scale step. The joined "out" matrix is split
over tensor-parallel devices along its inputs; its scales are those of whole rows (all devices' slices), so the int8
values are the same whatever the split and a sharded model computes what one device does.
"""
from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

INT8 = "int8"
WEIGHT_DTYPES = (None, INT8)  # None: the weights in the compute dtype
SCALE_AXES = {"in_scale": ("shards", "joined"), "out_scale": ("shards", "embed")}  # logical axes of their scales


def quantize_rows(w_NxK: Any, xp=jnp, whole_rows_over: int | None = None) -> tuple[Any, Any]:
    """Symmetric int8 of a matrix [..., N, K] with one f32 scale per row [..., N]; `xp` is jax.numpy or numpy. With
    `whole_rows_over`, an axis of slices of the same rows: the scale is the whole row's, the same in every slice."""
    w = w_NxK.astype(xp.float32)
    amax_N = xp.max(xp.abs(w), axis=-1)
    if whole_rows_over is not None:
        amax_N = xp.broadcast_to(xp.max(amax_N, axis=whole_rows_over, keepdims=True), amax_N.shape)
    scale_N = xp.where(amax_N > 0, amax_N / 127, xp.float32(1)).astype(xp.float32)
    q = xp.clip(xp.round(w / scale_N[..., None]), -127, 127).astype(xp.int8)
    return q, scale_N


def dequantize_rows(q_NxK: Any, scale_N: Any) -> Any:
    """The matrix an int8 one stands for, in f32."""
    return q_NxK.astype(np.float32) * scale_N[..., None]


def quantize_fused(layer: dict, xp=jnp) -> dict:
    """A layer joined by `layers.fuse_layer`, its joined matrices as int8 with their scales (`SCALE_AXES`)."""
    fused = dict(layer["fused"])
    fused["in"], fused["in_scale"] = quantize_rows(fused["in"], xp)  # [tp, rows, D]: each device's own rows
    fused["out"], fused["out_scale"] = quantize_rows(fused["out"], xp, whole_rows_over=0)  # [tp, D, inputs/tp]
    return {**layer, "fused": fused}


def by_rows(x: jax.Array, w_NxK: jax.Array, scale_N: jax.Array | None = None) -> jax.Array:
    """x @ w_NxK.T, contracting the last axis of both; an int8 w is converted to x's dtype, the product accumulated
    in f32 and scaled per output (`scale_N`), then returned in x's dtype."""
    dims = (((x.ndim - 1,), (1,)), ((), ()))
    if scale_N is None:
        return lax.dot_general(x, w_NxK, dims)
    y = lax.dot_general(x, w_NxK.astype(x.dtype), dims, preferred_element_type=jnp.float32)
    return (y * scale_N.reshape((1,) * (y.ndim - 1) + scale_N.shape)).astype(x.dtype)
