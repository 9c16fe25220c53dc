"""The param tree, described once per model family (model/families/): each param's logical axes, from which its shape
(the config's axis sizes), its placement (a Layout's rules), its init and its paths follow; the one table of dtype
names.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping
import functools
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from mesh_transformer import config
from mesh_transformer.config import Config, ConfigError
from mesh_transformer.model import families
from mesh_transformer.model.family import Param, Path

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


def dtype_named(name: Any) -> np.dtype:
    """A numpy dtype from 'bf16' / 'fp16' / 'fp32', a full name such as 'bfloat16', or a dtype."""
    if not isinstance(name, str):
        return np.dtype(name)
    full = config.DTYPE_FLAGS.get(name, name)
    if full not in DTYPES:
        raise ConfigError(f"dtype {name!r} must be one of {', '.join([*config.DTYPE_FLAGS, *DTYPES])}")
    return np.dtype(DTYPES[full])


def is_axes(x) -> bool:
    """True for a leaf of `param_axes` (a tuple of names, which jax.tree would otherwise walk into)."""
    return isinstance(x, tuple) and all(isinstance(a, str) for a in x)


def params_table(cfg: Config) -> dict[Path, Param]:
    """The param tree of the config's model family, one row per param (model/families/)."""
    return families.of(cfg).params


@functools.cache
def _axes_tree(name: str) -> dict:
    return _tree({path: row.axes for path, row in families.named(name).params.items()})


def param_axes(cfg: Config) -> dict:
    """The param tree of logical axes of the config's family (shared: do not modify it)."""
    return _axes_tree(cfg.family)


def _tree(rows: dict[Path, Any]) -> dict:
    tree: dict = {}
    for path, value in rows.items():
        set_path(tree, path, value)
    return tree


def lora_targets(cfg: Config) -> dict[str, Path]:
    """LoRA target -> the path of the weight it adapts."""
    return {row.lora: path for path, row in params_table(cfg).items() if row.lora}


def axis_sizes(cfg: Config) -> dict[str, int]:
    """The size of each logical axis of the params and the LoRA adapters."""
    return {"layers": cfg.layers, "embed": cfg.d_model, "heads": cfg.n_heads * cfg.head_dim,
            "kv_heads": cfg.kv_heads * cfg.head_dim, "mlp": cfg.d_ff,
            "vocab": cfg.n_vocab, "lora": cfg.lora_rank}


def param_shapes(cfg: Config, dtype=jnp.float32) -> dict:
    """The global param tree as ShapeDtypeStructs; layers stacked on a leading axis L."""
    return shapes_of(param_axes(cfg), axis_sizes(cfg), dtype)


def shapes_of(axes_tree: dict, sizes: Mapping[str, int], dtype=jnp.float32) -> dict:
    """A tree of logical axes (`param_axes`, the adapters') as ShapeDtypeStructs of these axis sizes."""
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


def _init_std(cfg: Config, path: Path) -> float | None:
    """The original's truncated-normal scale of a param; 0 means zeros, None ones."""
    init = params_table(cfg)[path].init
    return {"ones": None, "zeros": 0.0, "vocab": 1.0 / cfg.n_vocab ** 0.5, "fan_in": 1.0 / cfg.d_model ** 0.5,
            "residual": (2.0 / cfg.layers) / cfg.d_model ** 0.5}[init]


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



