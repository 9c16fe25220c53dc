"""Weight-only int8 for inference: each matrix of a layer (and the LM head with `quantize_head`) held as symmetric
int8 with one f32 scale per output channel, and dequantized inside the matrix product: the int8 values, converted
to the compute dtype, multiply the activations with f32 accumulation, and each output is scaled after.

Per output channel, the scale is the channel's largest magnitude over 127 (an all-zero channel gets 1), and a
weight w is held as round(w * (1 / scale)) in [-127, 127]: its error is at most half a scale step (and a rounding
of the reciprocal). attn out and fc_out,
whose outputs are summed (`fused.fuse_layer` joins them into one matrix), share their scales: one per model width
channel, the larger of the two. The scales do not depend on how the model is split over devices, so a sharded model
computes what one device does, and an int8 checkpoint (`slim_model.py --dtype int8`) holds the same numbers as a
quantization while loading.
"""
from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from mesh_transformer.model.table import get_path, set_path

INT8 = "int8"
WEIGHT_DTYPES = (None, INT8)  # None: the weights in the compute dtype
SCALE_AXES = {"in_scale": ("shards", "joined"), "out_scale": ("shards", "embed")}  # logical axes of their scales
HEAD_SCALE_AXES = {"scale": ("vocab",)}  # the LM head's, with quantize_head
# A layer's matrices (paths in a layer of the param tree) by scale group: the members of a group share one scale
# per output channel.
GROUPS = {"q": (("attn", "q"),), "k": (("attn", "k"),), "v": (("attn", "v"),), "gate": (("mlp", "gate", "kernel"),),
          "fc_in": (("mlp", "fc_in", "kernel"),), "out": (("attn", "out"), ("mlp", "fc_out", "kernel"))}
MATRICES = {path: group for group, paths in GROUPS.items() for path in paths}


CHUNK_BYTES = 64 << 20  # numpy works through a matrix in row blocks of about this many f32 bytes


def _row_blocks(w: np.ndarray):
    """Slices of w's first axis, each about CHUNK_BYTES as f32 (numpy's temporaries stay that small)."""
    rows = max(1, CHUNK_BYTES // max(1, 4 * w[0].size))
    return [slice(start, start + rows) for start in range(0, len(w), rows)]


def amax(w_KxN: Any, xp=np) -> Any:
    """Each output channel's (last axis') largest magnitude, in f32."""
    if xp is np and w_KxN.ndim == 2:
        return np.max([np.abs(w_KxN[rows]).max(0) for rows in _row_blocks(w_KxN)], 0).astype(np.float32)
    return xp.max(xp.abs(w_KxN), axis=tuple(range(w_KxN.ndim - 1))).astype(xp.float32)


def scale_of(amax_N: Any, xp=np) -> Any:
    return xp.where(amax_N > 0, amax_N / 127, xp.float32(1)).astype(xp.float32)


def inverse(scale_N: Any, xp=np) -> Any:
    """1 / scale in f32: numpy's division is IEEE's; pass numpy's to a device program that must match the host
    bit for bit (XLA computes a division by a reciprocal and a product, rounded differently)."""
    return (xp.float32(1) / scale_N).astype(xp.float32)


def quantize(w_KxN: Any, scale_N: Any, xp=np, inverse_N: Any = None) -> Any:
    """w's int8 values for these per-output scales: round(w * (1 / scale)), a product that rounds alike on every
    platform given the same `inverse_N` (default: `inverse(scale_N, xp)`)."""
    inv = inverse(scale_N, xp) if inverse_N is None else inverse_N
    inv = inv.reshape((1,) * (w_KxN.ndim - 1) + inv.shape)
    if xp is np and w_KxN.ndim == 2:
        out = np.empty(w_KxN.shape, np.int8)
        for rows in _row_blocks(w_KxN):
            out[rows] = _rounded(w_KxN[rows], inv, np)
        return out
    return _rounded(w_KxN, inv, xp)


def _rounded(w: Any, inv: Any, xp) -> Any:
    return xp.clip(xp.round(w.astype(xp.float32) * inv), -127, 127).astype(xp.int8)


def is_scale(path: tuple) -> bool:
    """Whether the leaf at a key path of the decode programs' params is an int8 weight's f32 scale (a layer's
    `SCALE_AXES`, the head's `HEAD_SCALE_AXES`)."""
    names = [getattr(key, "key", None) for key in path]
    return names[-1] in SCALE_AXES or (names[-1] in HEAD_SCALE_AXES and "lm_head" in names)


def cast(tree: Any, dtype: Any) -> Any:
    """The tree's arrays in `dtype`, except int8 weights and their f32 scales, which their products take as they
    are (`by_rows`, `layers.head`)."""
    def leaf(path, x):
        return x if x.dtype == jnp.int8 or is_scale(path) else x.astype(dtype)

    return jax.tree_util.tree_map_with_path(leaf, tree)


def dequantize(q_KxN: Any, scale_N: Any) -> np.ndarray:
    """The matrix an int8 one stands for, in f32."""
    return np.asarray(q_KxN).astype(np.float32) * np.asarray(scale_N)


def _set(tree: dict, path: tuple, value: Any) -> dict:
    """A copy of the nested dicts along `path` with the leaf there replaced."""
    if not path:
        return value
    return {**tree, path[0]: _set(tree[path[0]], path[1:], value)}


def group_amax(layer: dict, xp=np) -> dict:
    """The largest magnitude [N] per output channel of each scale group (`GROUPS`) whose matrices one layer of the
    param tree holds (all, or one half that a loader reads on its own: `fused.fuse_inputs`' or `fuse_outputs`')."""
    peaks = {}
    for group, paths in GROUPS.items():
        if all(_holds(layer, path) for path in paths):
            each = [amax(get_path(layer, path), xp) for path in paths]
            peaks[group] = each[0] if len(each) == 1 else xp.maximum(*each)
    return peaks


def group_scales(layer: dict, xp=np) -> dict:
    """The scales [N] of each scale group whose matrices one layer holds (`group_amax`)."""
    return {group: scale_of(peak, xp) for group, peak in group_amax(layer, xp).items()}


def _holds(layer: dict, path: tuple) -> bool:
    return not path or (path[0] in layer and _holds(layer[path[0]], path[1:]))


def matrices(layer_paths) -> dict[tuple, str]:
    """`MATRICES` of the paths a family's layer has (a family without a gated MLP has no "gate")."""
    have = set(layer_paths)
    return {path: group for path, group in MATRICES.items() if path in have}


def stacked_scales(read, n_layers: int, layer_paths=tuple(MATRICES)) -> dict[str, np.ndarray]:
    """The scales [L, N] of each scale group of n_layers layers, `read(path in a layer, i)` giving a matrix, of the
    matrices among `layer_paths` (a family's)."""
    per_layer = []
    for i in range(n_layers):
        layer: dict = {}
        for path in matrices(layer_paths):
            set_path(layer, path, read(path, i))
        per_layer.append(group_scales(layer))
    return {group: np.stack([scales[group] for scales in per_layer]) for group in per_layer[0]}


def quantize_layer(layer: dict, xp=np, scales: dict | None = None,
                   inverses: dict | None = None) -> tuple[dict, dict]:
    """(the layer with its matrices as int8, the scales of its groups) for one layer of the param tree (or the half
    of one that `group_scales` takes); `xp` is numpy (on the host) or jax.numpy (under jit), `inverses` the
    groups' `inverse` scales where given."""
    scales = group_scales(layer, xp) if scales is None else scales
    for path, group in MATRICES.items():
        if group in scales and _holds(layer, path):
            inv = None if inverses is None else inverses[group]
            layer = _set(layer, path, quantize(get_path(layer, path), scales[group], xp, inv))
    return layer, scales


def quantize_head(lm_head: dict, xp=np, scale_V: Any = None, inverse_V: Any = None) -> dict:
    """The LM head with its kernel [D, V] as int8 and a scale per vocab entry ("scale", `HEAD_SCALE_AXES`); the
    scales (and their `inverse`) computed from the kernel unless given."""
    scale_V = scale_of(amax(lm_head["kernel"], xp), xp) if scale_V is None else scale_V
    return {**lm_head, "kernel": quantize(lm_head["kernel"], scale_V, xp, inverse_V), "scale": scale_V}


def by_rows(x: jax.Array, w_NxK: jax.Array, scale_N: jax.Array | None = None, dot_dtype: Any = None) -> jax.Array:
    """x @ w_NxK.T, contracting the last axis of both; an int8 w is converted to `dot_dtype` (default x's dtype; the
    platform policy's `int8_dot`), the product accumulated in f32 and scaled per output (`scale_N`), then returned in
    x's dtype."""
    dims = (((x.ndim - 1,), (1,)), ((), ()))
    if scale_N is None:
        return lax.dot_general(x, w_NxK, dims)
    dot_dtype = x.dtype if dot_dtype is None else dot_dtype
    y = lax.dot_general(x.astype(dot_dtype), w_NxK.astype(dot_dtype), dims, preferred_element_type=jnp.float32)
    return (y * scale_N.reshape((1,) * (y.ndim - 1) + scale_N.shape)).astype(x.dtype)
