"""The GPT-J transformer as pure functions of global arrays: the param tree (described once), init, forward, loss.

Knows no mesh: a Layout (parallel/layout.py) runs these under shard_map (with a tensor-parallel axis name) or under
jit with shardings (with a `constrain` hook for activations).
"""
from __future__ import annotations

from collections.abc import Callable, Mapping
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from mesh_transformer.config import Config
from mesh_transformer.model import layers, lora
from mesh_transformer.platforms import Policy

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}
Path = tuple[str, ...]  # a param's keys from the root of the tree, e.g. ("layers", "attn", "q")
HIDDEN_AXES = ("batch", "length", "embed")
LOGITS_AXES = ("batch", "length", "vocab")
# (x, logical axes) -> x placed as a parallelism mode wants; the GSPMD path passes one, the model never sees a mesh.
Constrain = Callable[[jax.Array, tuple[str, ...]], jax.Array]


def _unconstrained(x: jax.Array, logical_axes: tuple[str, ...]) -> jax.Array:
    return x


def is_axes(x) -> bool:
    """True for a leaf of PARAM_AXES (a tuple of names, which jax.tree would otherwise walk into)."""
    return isinstance(x, tuple) and all(isinstance(a, str) for a in x)


# The param tree, written once: each leaf's logical axes. Shapes follow from the config's axis sizes, placements
# from a Layout's rule table (parallel/layout.py). "heads" is the H*K projection width, "layers" the stack axis L.
_QKV, _STACKED = ("layers", "embed", "heads"), ("layers", "embed")
PARAM_AXES = {
    "embed": {"wte": ("vocab", "embed")},
    "layers": {
        "ln_1": {"scale": _STACKED, "bias": _STACKED},
        "attn": {"q": _QKV, "k": _QKV, "v": _QKV, "out": ("layers", "heads", "embed")},
        "mlp": {"fc_in": {"kernel": ("layers", "embed", "mlp"), "bias": ("layers", "mlp")},
                "fc_out": {"kernel": ("layers", "mlp", "embed"), "bias": _STACKED}},
    },
    "ln_f": {"scale": ("embed",), "bias": ("embed",)},
    "lm_head": {"kernel": ("embed", "vocab"), "bias": ("vocab",)},
}


def axis_sizes(cfg: Config) -> dict[str, int]:
    """The size of each logical axis of the params."""
    return {"layers": cfg.layers, "embed": cfg.d_model, "heads": cfg.n_heads * cfg.head_dim, "mlp": cfg.d_ff,
            "vocab": cfg.n_vocab}


def param_shapes(cfg: Config, dtype=jnp.float32) -> dict:
    """The global param tree as ShapeDtypeStructs; layers stacked on a leading axis L."""
    sizes = axis_sizes(cfg)
    return jax.tree.map(lambda axes: jax.ShapeDtypeStruct(tuple(sizes[a] for a in axes), dtype), PARAM_AXES,
                        is_leaf=is_axes)


def param_paths(cfg: Config) -> list[tuple[Path, jax.ShapeDtypeStruct]]:
    """(path, global shape) of every param, in the param tree's flattening order."""
    flat = jax.tree_util.tree_flatten_with_path(param_shapes(cfg))[0]
    return [(tuple(key.key for key in keypath), shape) for keypath, shape in flat]


def get_path(tree: Mapping, path: Path) -> Any:
    """The node at `path` of a param tree, or of a tree shaped like it (shapes, specs, shardings)."""
    for key in path:
        tree = tree[key]
    return tree


def set_path(tree: dict, path: Path, value: Any) -> None:
    """Puts `value` at `path` of a nested dict, making the dicts on the way."""
    for key in path[:-1]:
        tree = tree.setdefault(key, {})
    tree[path[-1]] = value


def unstack_layers(params: dict, split: Callable | None = None) -> dict:
    """The params with "layers" as a list of L per-layer trees, for inference programs that loop over the layers
    in Python. `split(stacked leaf) -> its L slices` (default: indexing) may also place or describe them."""
    split = split or (lambda x: [x[i] for i in range(x.shape[0])])
    stacked, treedef = jax.tree.flatten(params["layers"])
    slices = [split(x) for x in stacked]
    return {**params, "layers": [jax.tree.unflatten(treedef, list(layer)) for layer in zip(*slices)]}


def _init_std(cfg: Config, path: tuple[str, ...]) -> float:
    """The original's truncated-normal scales; 0 means a zero bias, None a LayerNorm scale of one."""
    name = "/".join(path)
    D, V = cfg.d_model, cfg.n_vocab
    if name.endswith("bias"):
        return 0.0
    if name.endswith("scale"):
        return None
    if name == "embed/wte":
        return 1.0 / V ** 0.5
    if name.endswith(("attn/out", "fc_out/kernel")):
        return (2.0 / cfg.layers) / D ** 0.5
    return 1.0 / D ** 0.5


def init_params(cfg: Config, key: jax.Array) -> dict:
    """Random params by the original's scales, as global arrays; jit it with out_shardings to create them sharded."""
    shapes = param_shapes(cfg)
    leaves, treedef = jax.tree_util.tree_flatten_with_path(shapes)
    keys = jax.random.split(key, len(leaves))
    out = []
    for k, (path, s) in zip(keys, leaves):
        std = _init_std(cfg, tuple(p.key for p in path))
        if std is None:
            out.append(jnp.ones(s.shape, s.dtype))
        elif std == 0.0:
            out.append(jnp.zeros(s.shape, s.dtype))
        else:
            out.append(std * jax.random.truncated_normal(k, -2.0, 2.0, s.shape, s.dtype))
    return jax.tree.unflatten(treedef, out)


def init_unsharded(cfg: Config, key: jax.Array) -> dict:
    """Random params on one device (for tests and tiny models); a Layout's init_params gives the same numbers."""
    return jax.jit(partial(init_params, cfg))(key)


def compute_dtype(cfg: Config, policy: Policy | None = None) -> jnp.dtype:
    """The dtype matmuls run in: cfg.compute_dtype, with "auto" what the platform policy says (bf16 where the
    matrix units are, f32 on CPU, where XLA's bf16 matmul is slower). A Layout's config has "auto" resolved for its
    devices already; with neither, "auto" is f32."""
    name = cfg.compute_dtype
    if name == "auto":
        name = policy.compute_dtype if policy is not None else "float32"
    return jnp.dtype(DTYPES[name])


def cast_for_compute(params: dict, cfg: Config) -> dict:
    """The params in the compute dtype, except the stacked layers: `hidden` casts one layer at a time inside its
    scan, so a base held in another dtype is never copied whole."""
    return {k: v if k == "layers" else jax.tree.map(lambda x: x.astype(compute_dtype(cfg)), v)
            for k, v in params.items()}


def forward(params: dict, ids_BxT: jax.Array, cfg: Config, tp_axis: str | None = None,
            constrain: Constrain | None = None, *, policy: Policy) -> jax.Array:
    """Logits [B, T, V] in f32 (this device's vocab columns under tensor parallelism).

    `constrain` pins activations between layers (GSPMD): under FSDP that makes XLA gather one layer's weights per
    scan iteration instead of splitting the activations like the weights.
    """
    constrain = constrain or _unconstrained
    params = cast_for_compute(params, cfg)
    h_BxTxD = hidden(params, ids_BxT, cfg, tp_axis, constrain, policy=policy)
    return constrain(layers.head(h_BxTxD, params["ln_f"], params["lm_head"]), LOGITS_AXES)


def hidden(params: dict, ids_BxT: jax.Array, cfg: Config, tp_axis: str | None, constrain: Constrain,
           layer_grad_sum: dict | None = None, *, policy: Policy) -> jax.Array:
    """The last block's output [B, T, D], before the final LayerNorm; each layer (and its adapters, if any: see
    model/lora.py) cast to the compute dtype as the scan reaches it. With `layer_grad_sum` (gradient accumulation,
    remat on) the trained layers' gradient comes out as layer_grad_sum + this batch's: see `_layers_into`."""
    h_BxTxD = constrain(layers.embed(ids_BxT, params["embed"]["wte"], tp_axis), HIDDEN_AXES)
    positions_1xT = jnp.arange(ids_BxT.shape[1])[None]
    sincos = layers.rotary_sincos(positions_1xT, cfg.pe_rotary_dims)

    def step(h_BxTxD, layer_params, sincos):
        layer_params = lora.adapt_layer(jax.tree.map(lambda x: x.astype(compute_dtype(cfg)), layer_params), cfg)
        h_BxTxD = layers.block(h_BxTxD, layer_params, cfg.head_dim, sincos, None, tp_axis,
                               join=cfg.join_projections, policy=policy)[0]
        return constrain(h_BxTxD, HIDDEN_AXES)

    if layer_grad_sum is not None:
        return _layers_into(step, h_BxTxD, params["layers"], sincos, layer_grad_sum)
    if cfg.remat:
        step = jax.checkpoint(step, prevent_cse=False)
    return lax.scan(lambda h, layer: (step(h, layer, sincos), None), h_BxTxD, params["layers"])[0]


@partial(jax.custom_vjp, nondiff_argnums=(0,))
def _layers_into(step: Callable, h_BxTxD: jax.Array, layers_: dict, sincos, grad_sum: dict) -> jax.Array:
    """The layer scan (remat: each layer's input is saved, the rest recomputed in the backward) whose backward adds
    each layer's gradient into `grad_sum` (stacked like the trained layers, f32) as the reverse scan makes it, in
    place: gradient accumulation holds one set of layer gradients, not the sum and this micro-batch's. The trained
    layers' cotangent it returns is grad_sum + this batch's gradient, the frozen layers and grad_sum get none. That
    is not linear in the output's cotangent: it is for one value_and_grad of the loss (Layout's accumulate), not for
    jvp or higher derivatives."""
    return lax.scan(lambda h, layer: (step(h, layer, sincos), None), h_BxTxD, layers_)[0]


def _layers_into_fwd(step, h_BxTxD, layers_, sincos, grad_sum):
    out_BxTxD, inputs_LxBxTxD = lax.scan(lambda h, layer: (step(h, layer, sincos), h), h_BxTxD, layers_)
    return out_BxTxD, (layers_, sincos, grad_sum, inputs_LxBxTxD)


def _layers_into_bwd(step, residuals, d_out_BxTxD):
    layers_, sincos, grad_sum, inputs_LxBxTxD = residuals

    def back(carry, xs):
        d_h_BxTxD, acc = carry
        index, layer, h_BxTxD = xs
        trained, frozen = lora.split_layers(layer)
        _, vjp = jax.vjp(lambda t, h: step(h, lora.join_layers(t, frozen), sincos), trained, h_BxTxD)
        d_trained, d_h_BxTxD = vjp(d_h_BxTxD)
        acc = jax.tree.map(lambda a, g: lax.dynamic_update_index_in_dim(
            a, lax.dynamic_index_in_dim(a, index, keepdims=False) + g.astype(a.dtype), index, 0), acc, d_trained)
        return (d_h_BxTxD, acc), None

    n_layers = inputs_LxBxTxD.shape[0]
    (d_h_BxTxD, acc), _ = lax.scan(back, (d_out_BxTxD, grad_sum), (jnp.arange(n_layers), layers_, inputs_LxBxTxD),
                                   reverse=True)
    _, frozen = lora.split_layers(layers_)
    return d_h_BxTxD, lora.join_layers(acc, jax.tree.map(lambda _: None, frozen)), None, None


_layers_into.defvjp(_layers_into_fwd, _layers_into_bwd)


def loss_fn(params: dict, tokens_BxT1: jax.Array, cfg: Config, tp_axis: str | None = None,
            dp_axis: str | None = None, constrain: Constrain | None = None,
            layer_grad_sum: dict | None = None, *, policy: Policy) -> jax.Array:
    """Mean next-token cross entropy of a [B, T+1] token batch (inputs [:-1], targets [1:]); `layer_grad_sum`:
    see `hidden`."""
    constrain = constrain or _unconstrained
    params = cast_for_compute(params, cfg)
    h_BxTxD = hidden(params, tokens_BxT1[:, :-1], cfg, tp_axis, constrain, layer_grad_sum, policy=policy)
    pin_logits = None if constrain is _unconstrained else (lambda logits: constrain(logits, LOGITS_AXES))
    ce_BxT = layers.head_cross_entropy(h_BxTxD, params["ln_f"], params["lm_head"], tokens_BxT1[:, 1:], tp_axis,
                                       pin_logits)
    loss = ce_BxT.mean()
    return loss if dp_axis is None else lax.pmean(loss, dp_axis)
