"""The param tree, described once: each param's logical axes, from which its shape (the config's axis sizes), its
placement (a Layout's rules), its init and its paths follow; the one table of dtype names.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp

from mesh_transformer.config import Config

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}
Path = tuple[str, ...]  # a param's keys from the root of the tree, e.g. ("layers", "attn", "q")


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
    """The size of each logical axis of the params and the LoRA adapters."""
    return {"layers": cfg.layers, "embed": cfg.d_model, "heads": cfg.n_heads * cfg.head_dim, "mlp": cfg.d_ff,
            "vocab": cfg.n_vocab, "lora": cfg.lora_rank}


def param_shapes(cfg: Config, dtype=jnp.float32) -> dict:
    """The global param tree as ShapeDtypeStructs; layers stacked on a leading axis L."""
    return shapes_of(PARAM_AXES, axis_sizes(cfg), dtype)


def shapes_of(axes_tree: dict, sizes: Mapping[str, int], dtype=jnp.float32) -> dict:
    """A tree of logical axes (PARAM_AXES, the adapters') as ShapeDtypeStructs of these axis sizes."""
    return jax.tree.map(lambda axes: jax.ShapeDtypeStruct(tuple(sizes[a] for a in axes), dtype), axes_tree,
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


