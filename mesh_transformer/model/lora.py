"""Low-rank adapters (LoRA): their params, how a layer applies them, and the merged weights.

An adapter on a weight W [in, out] is A [in, r] and B [r, out], stacked over the layers like W; the adapted
projection is y = x @ W + ((x @ A) @ B) * scale with scale = lora_alpha / lora_rank. A starts normal with std
1/sqrt(in) and B at zero, so step 0 equals the base model. The adapters tree is {target: {"a", "b"}}, a tree of its
own beside the params: the model's layer scan runs over both and hands each block its slices of each (`gptj.run`).

Under the Megatron rules the logical axes place them so that no collective is added: for a column-split W (q, k, v,
fc_in) A is replicated and B split like W's columns; for a row-split W (out, fc_out) A is split like W's rows and B
replicated, so each device's (x_local @ A_local) @ B is a partial sum that joins the block's one psum.
"""
from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from mesh_transformer.config import Config
from mesh_transformer.model import families, quant, table


class Adapted(NamedTuple):
    """A frozen weight with its adapter, as a layer sees it: calling it on x gives x @ W + ((x @ A) @ B) * scale."""
    w: jax.Array
    a: jax.Array
    b: jax.Array
    scale: float

    def __call__(self, x: jax.Array) -> jax.Array:
        base = self.w(x) if callable(self.w) else x @ self.w
        return base + ((x @ self.a) @ self.b) * jnp.asarray(self.scale, x.dtype)


class Dequantized(NamedTuple):
    """An int8 base's matrix [K, N] and its scales [N], as a layer sees it: calling it on x gives x @ (w * scale),
    computed as (x @ w) * scale, the int8 values converted to x's dtype inside the product (no float copy of the
    matrix is written, nor a scaled one)."""
    w: jax.Array
    scale: jax.Array

    def __call__(self, x: jax.Array) -> jax.Array:
        y = x @ self.w.astype(x.dtype)
        return y * self.scale.astype(x.dtype).reshape((1,) * (y.ndim - 1) + self.scale.shape)


def alpha(rank: int, alpha_: float | None) -> float:
    """LoRA's alpha; unset, the rank (a scale of 1)."""
    return alpha_ if alpha_ is not None else rank


def scale(cfg: Config) -> float:
    """lora_alpha / lora_rank; 0 without adapters."""
    return alpha(cfg.lora_rank, cfg.lora_alpha) / cfg.lora_rank if cfg.lora_rank else 0.0


def lora_axes(cfg: Config) -> dict:
    """The adapters' logical axes, {target: {"a": (layers, in, lora), "b": (layers, lora, out)}}."""
    rows, paths = table.params_table(cfg), table.lora_targets(cfg)
    # the weight's (in, out), of the targets the family has (the default names every family's: "gate" is a gated MLP's)
    axes = {t: rows[paths[t]].axes[1:] for t in cfg.lora_targets if t in paths}
    return {t: {"a": ("layers", ins, "lora"), "b": ("layers", "lora", outs)} for t, (ins, outs) in axes.items()}


def lora_shapes(cfg: Config, dtype=jnp.float32) -> dict:
    """The adapters as ShapeDtypeStructs (global shapes)."""
    return table.shapes_of(lora_axes(cfg), table.axis_sizes(cfg), dtype)


def init_lora(cfg: Config, key: jax.Array) -> dict:
    """Fresh adapters: A normal with std 1/sqrt(in), B zeros (jit it with out_shardings to make them sharded)."""
    shapes = lora_shapes(cfg)
    keys = jax.random.split(key, len(shapes))
    adapters = {}
    for k, (target, s) in zip(keys, shapes.items()):
        fan_in = s["a"].shape[1]
        adapters[target] = {"a": jax.random.normal(k, s["a"].shape, s["a"].dtype) / math.sqrt(fan_in),
                            "b": jnp.zeros(s["b"].shape, s["b"].dtype)}
    return adapters


# ------------------------------------------------------------------------------------------------ an int8 base
SCALES = "int8_scales"  # an int8 base's layer: {target: [L, out]}, one f32 scale per output column of each matrix


def base_axes(cfg: Config) -> dict:
    """The frozen base's logical axes: the params', and with base_dtype int8 each layer matrix's scales (those of
    its output axis) under layers[SCALES]."""
    axes = table.param_axes(cfg)
    if cfg.base_dtype != "int8":
        return axes
    rows = table.params_table(cfg)
    scales = {t: ("layers", rows[("layers", *path)].axes[-1]) for t, path in base_matrices(cfg).items()}
    return {**axes, "layers": {**axes["layers"], SCALES: scales}}


def base_matrices(cfg: Config) -> dict[str, tuple[str, ...]]:
    """target -> its matrix's path in a layer, for every matrix the family's layers have."""
    return {t: path[1:] for t, path in table.lora_targets(cfg).items()}


def base_dtypes(cfg: Config, abstract: Any) -> Any:
    """The frozen base's abstract tree (of base_axes, in precision.frozen) with an int8 base's matrices int8 and
    their scales f32."""
    if cfg.base_dtype != "int8":
        return abstract
    int8 = {("layers", *path) for path in base_matrices(cfg).values()}

    def leaf(path, s):
        names = tuple(getattr(k, "key", None) for k in path)
        dtype = jnp.int8 if names in int8 else jnp.float32 if SCALES in names else s.dtype
        return jax.ShapeDtypeStruct(s.shape, dtype, sharding=s.sharding)

    return jax.tree_util.tree_map_with_path(leaf, abstract)


def quantize_matrix(w_KxN: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(int8 [K, N], f32 scales [N]) of one layer's matrix: per output column its largest magnitude over 127
    (model/quant.py's numbers)."""
    scale = quant.scale_of(quant.amax(w_KxN))
    return quant.quantize(w_KxN, scale), scale


def dequantized(layer: dict) -> dict:
    """One layer of an int8 base (its matrices int8, layer[SCALES] their scales) with each matrix a `Dequantized`;
    a layer of a float base as it is."""
    if SCALES not in layer:
        return layer
    scales = layer[SCALES]
    layer = {k: v for k, v in layer.items() if k != SCALES}
    for target, scale_N in scales.items():
        path = families.lora_paths()[target]
        layer = _replaced(layer, path, Dequantized(table.get_path(layer, path), scale_N))
    return layer


def _replaced(tree: dict, path: tuple[str, ...], value: Any) -> dict:
    """A copy of the nested dict `tree` with `value` at `path` (the dicts on the way copied, nothing else)."""
    if not path:
        return value
    return {**tree, path[0]: _replaced(tree[path[0]], path[1:], value)}


def adapt_layer(layer: dict, adapters: dict | None, scale_: float) -> dict:
    """One layer's params with each weight that has an adapter (this layer's slices) replaced by its `Adapted`."""
    for target, ab in (adapters or {}).items():
        path = families.lora_paths()[target]
        layer = _replaced(layer, path, Adapted(table.get_path(layer, path), ab["a"], ab["b"], scale_))
    return layer


def delta(a_xr, b_rxy, scale_: float, xp=jnp):
    """The merged weight's change A @ B * scale for one layer ([in, r] @ [r, out]) or stacked ([L, in, r]); under
    jax at the highest precision (a TPU's default takes f32 products in one bf16 pass)."""
    if xp is jnp:
        return jnp.matmul(a_xr, b_rxy, precision=jax.lax.Precision.HIGHEST) * scale_
    return xp.matmul(a_xr, b_rxy) * scale_


def merge(base: dict, adapters: dict, scale_: float) -> dict:
    """The base params with every adapted weight replaced by W + A @ B * scale (stacked, any array type)."""
    return {**base, "layers": merge_layers(base["layers"], adapters, scale_)}


def merge_layers(layers: dict, adapters: dict, scale_: float, dtype: Any = None) -> dict:
    """`merge` on params["layers"] alone: stacked, or one layer's slices with its adapters' slices. Each merged
    weight is summed in f32 and rounded once, to `dtype` (default: the weight's own), as a reader merging
    W + A @ B * scale in f32 would."""
    for target, ab in adapters.items():
        path = families.lora_paths()[target]
        w = table.get_path(layers, path)
        merged = w.astype(jnp.float32) + delta(ab["a"], ab["b"], scale_)
        layers = _replaced(layers, path, merged.astype(dtype or w.dtype))
    return layers
