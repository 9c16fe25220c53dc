"""A layer's matrices joined for inference (`fuse_layer`): the decode programs' form of a layer, and its logical axes.
`layers.projections` applies a joined layer; infer/params.py builds them, on the devices or on the host."""
from __future__ import annotations

from collections.abc import Callable

import jax.numpy as jnp

# The logical axes of a layer `fuse_layer` joined: "shards" is its device axis (one slice per tensor-parallel device),
# "joined" the joined rows or columns of one device. A family with a second LayerNorm has "ln_2" like "ln_1", one with
# a bias on attn out has it as fused "attn_bias" ("embed",) (`fused_axes`).
FUSED_AXES = {"ln_1": {"scale": ("embed",), "bias": ("embed",)},
              "fused": {"in": ("shards", "joined", "embed"), "in_bias": ("shards", "joined"),
                        "out": ("shards", "embed", "joined"), "out_bias": ("embed",)}}


def fused_axes(layer_axes: dict) -> dict:
    """The logical axes of a joined layer, for a family whose param tree's layer has these axes."""
    axes = dict(FUSED_AXES)
    for norm in ("ln_1", "ln_2"):  # a LayerNorm's scale and bias, an RMSNorm's scale
        if norm in layer_axes:
            axes[norm] = {name: ("embed",) for name in layer_axes[norm]}
    if "out_bias" in layer_axes["attn"]:
        axes["fused"] = {**FUSED_AXES["fused"], "attn_bias": ("embed",)}
    return axes


def fuse_layer(layer: dict, tp_size: int, xp=jnp, scales: dict | None = None) -> dict:
    """One layer's projections joined for inference (global arrays; run it under jit): q, k, v and fc_in, which all
    read LN(h), become one matrix, and attn out and fc_out, whose outputs are summed, another. A one-token step
    then reads each layer's weights in two matrix products instead of six. (A family whose MLP reads its own
    LayerNorm, or attention's output, takes each matrix's rows or columns of one side at a time: `_fused`.)

    The joined matrices are stored one row per output ([N, K]): XLA's CPU matrix-vector products over such rows
    use both cores of a 2-core machine, over [K, N] mostly one. Under tensor parallelism each device must hold
    its own heads and MLP columns side by side, so the matrices carry a device axis: "in" [tp, 3*D/tp + F/tp, D]
    and "out" [tp, D, D/tp + F/tp], split on it. `xp` is jax.numpy, or numpy to join a layer on the host. An int8 layer
    (`quant.quantize_layer`) comes with its groups' `scales`, joined alongside as "in_scale" [tp, 3*D/tp + F/tp]
    and "out_scale" [tp, D]. Each half (`fuse_inputs`, `fuse_outputs`) reads only its own matrices, so a loader
    can hold one half's parts at a time.
    """
    norms = {name: layer[name] for name in ("ln_1", "ln_2") if name in layer}
    return {**norms, "fused": {**fuse_inputs(layer, tp_size, xp, scales), **fuse_outputs(layer, tp_size, xp, scales)}}


def fuse_inputs(layer: dict, tp_size: int, xp=jnp, scales: dict | None = None,
                concatenate: Callable | None = None) -> dict:
    """`fuse_layer`'s "in", "in_bias" (and "in_scale"), from q, k, v and fc_in alone; "in" is joined by
    `concatenate(parts, axis)` where given (a loader's own, `infer.params.join_on_host`), else xp.concatenate."""
    attn, fc_in = layer["attn"], layer["mlp"]["fc_in"]
    d = attn["q"].shape[0]

    def rows(w):  # [D, C] -> [tp, C/tp, D]: each device's output columns, as rows
        return w.reshape(d, tp_size, -1).transpose(1, 2, 0)

    concatenate = concatenate or xp.concatenate
    mlp_in = [layer["mlp"]["gate"], fc_in] if "gate" in layer["mlp"] else [fc_in]  # a gated MLP's [gate | fc_in]
    dtype = fc_in["bias"].dtype if "bias" in fc_in else _float(attn["q"].dtype, xp)

    def bias(p, name, width):
        return (p[name].astype(dtype) if name in p else xp.zeros(width, dtype)).reshape(tp_size, -1)

    matrices = [attn["q"], attn["k"], attn["v"], *(m["kernel"] for m in mlp_in)]
    fused = {"in": concatenate([rows(w) for w in matrices], 1),
             "in_bias": xp.concatenate([bias(attn, f"{name}_bias", attn[name].shape[-1]) for name in "qkv"]
                                       + [bias(m, "bias", m["kernel"].shape[-1]) for m in mlp_in], -1)}
    if scales is not None:
        groups = ("q", "k", "v", "gate", "fc_in") if "gate" in layer["mlp"] else ("q", "k", "v", "fc_in")
        fused["in_scale"] = xp.concatenate([scales[g].reshape(tp_size, -1) for g in groups], -1)
    return fused


def fuse_outputs(layer: dict, tp_size: int, xp=jnp, scales: dict | None = None,
                 concatenate: Callable | None = None) -> dict:
    """`fuse_layer`'s "out", "out_bias" (and "out_scale"), from attn out and fc_out alone; "out" is written in its
    final order at once (each part's columns transposed as they are joined), so numpy makes one copy of it
    (`concatenate` as in `fuse_inputs`)."""
    attn_out, fc_out = layer["attn"]["out"], layer["mlp"]["fc_out"]
    d = attn_out.shape[-1]

    def columns(w):  # [C, D] -> [tp, D, C/tp]: each device's input rows, as columns
        return w.reshape(tp_size, -1, d).transpose(0, 2, 1)

    fused = {"out": (concatenate or xp.concatenate)([columns(attn_out), columns(fc_out["kernel"])], 2),
             "out_bias": fc_out["bias"] if "bias" in fc_out else xp.zeros(d, _float(attn_out.dtype, xp))}
    if "out_bias" in layer["attn"]:
        fused["attn_bias"] = layer["attn"]["out_bias"]
    if scales is not None:
        fused["out_scale"] = xp.broadcast_to(scales["out"], (tp_size, d))
    return fused


def _float(dtype, xp):
    """A bias's dtype beside matrices of this dtype (int8 ones: f32)."""
    return xp.float32 if dtype == xp.int8 else dtype
