"""HF state dicts of the config's model family (`GPTJForCausalLM`, `GPTNeoXForCausalLM`, ...) <-> our param tree, as
numpy arrays, no torch (torch Linear weight = our kernel transposed). The names come from the family's param table;
where HF holds q, k and v in one tensor (heads outermost, [H, 3, K] on its output axis), each is its part."""
from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import NamedTuple

import numpy as np

from mesh_transformer.config import Config
from mesh_transformer.model import families
from mesh_transformer.model.table import Path, get_path, param_shapes, params_table, set_path


class Piece(NamedTuple):
    """One of our params (one layer of it) in an HF tensor: the whole tensor, or its `part` of q, k, v."""
    path: Path
    transposed: bool
    part: int | None


class Entry(NamedTuple):
    """One HF tensor: its name, its layer (None: a top-level one) and the pieces of ours it holds."""
    name: str
    layer: int | None
    pieces: tuple[Piece, ...]


def hf_layout(cfg: Config) -> list[Entry]:
    """Every HF tensor of the config's family, in `to_hf_arrays` order: the top-level ones, then each layer tensor
    for every layer. Streaming converters use it to read and write one tensor at a time, and to know every shape up
    front."""
    prefix = families.of(cfg).hf_layers
    top: dict[str, list[Piece]] = {}
    per_layer: dict[str, list[Piece]] = {}
    for path, row in params_table(cfg).items():
        (per_layer if path[0] == "layers" else top).setdefault(row.hf, []).append(
            Piece(path, row.transposed, row.hf_part))
    layout = [Entry(name, None, tuple(pieces)) for name, pieces in top.items()]
    layout += [Entry(f"{prefix}.{i}.{name}", i, tuple(sorted(pieces, key=lambda p: p.part or 0)))
               for name, pieces in per_layer.items() for i in range(cfg.layers)]
    return layout


def held_name(cfg: Config, entry: Entry, names) -> str | None:
    """The name a checkpoint holding `names` keeps this tensor under (the table's, or an alias of it), or None."""
    prefix = entry.name[:len(entry.name) - len(_local(entry))]
    for name in (_local(entry), *families.of(cfg).hf_aliases.get(_local(entry), ())):
        if prefix + name in names:
            return prefix + name
    return None


def _local(entry: Entry) -> str:
    """The entry's name inside its layer (the whole name of a top-level one)."""
    return entry.name if entry.layer is None else entry.name.split(f".{entry.layer}.", 1)[1]


def hf_names(cfg: Config) -> list[str]:
    """Every tensor name of the family's HF state dict, in our export order."""
    return [entry.name for entry in hf_layout(cfg)]


def hf_shape(cfg: Config, entry: Entry) -> tuple[int, ...]:
    """The shape of an HF tensor, from our params' shapes."""
    shapes = param_shapes(cfg)
    piece = entry.pieces[0]
    shape = get_path(shapes, piece.path).shape[1 if entry.layer is not None else 0:]
    shape = shape[::-1] if piece.transposed else shape
    return (len(entry.pieces) * shape[0], *shape[1:])


def from_hf(array: np.ndarray, piece: Piece, n_heads: int) -> np.ndarray:
    """Our piece of an HF tensor: its part of the heads-outermost q, k, v, transposed as ours."""
    if piece.part is not None:
        array = array.reshape(n_heads, 3, -1, *array.shape[1:])[:, piece.part].reshape(-1, *array.shape[1:])
    return array.T if piece.transposed else array


def to_hf(arrays: list[np.ndarray], entry: Entry, n_heads: int) -> np.ndarray:
    """An HF tensor from our pieces of it (in `entry.pieces` order), contiguous."""
    arrays = [np.asarray(a).T if piece.transposed else np.asarray(a) for a, piece in zip(arrays, entry.pieces)]
    if len(arrays) == 1:
        return np.ascontiguousarray(arrays[0])
    heads = [a.reshape(n_heads, 1, -1, *a.shape[1:]) for a in arrays]
    joined = np.concatenate(heads, 1)
    return np.ascontiguousarray(joined.reshape(-1, *arrays[0].shape[1:]))


def to_hf_arrays(get: Callable[[Path], np.ndarray], cfg: Config) -> Iterator[tuple[str, np.ndarray]]:
    """Yield (HF name, array) one at a time; `get(path)` returns one of our (stacked) arrays as numpy."""
    for entry in hf_layout(cfg):
        parts = [get(piece.path) for piece in entry.pieces]
        if entry.layer is not None:
            parts = [part[entry.layer] for part in parts]
        yield entry.name, to_hf(parts, entry, cfg.n_heads)


def params_to_hf(params: Mapping, cfg: Config) -> dict[str, np.ndarray]:
    """Our param tree (numpy or jax arrays) as an HF state dict of the config's family, of numpy arrays."""
    return dict(to_hf_arrays(lambda path: np.asarray(get_path(params, path)), cfg))


def hf_to_params(state: Mapping[str, np.ndarray], cfg: Config) -> dict:
    """An HF state dict of the config's family (numpy arrays) as our param tree; checks every name and shape."""
    shapes = param_shapes(cfg)
    layers: dict[Path, list] = {}
    params: dict = {}
    for entry in hf_layout(cfg):
        name = held_name(cfg, entry, state)
        if name is None:
            raise ValueError(f"HF checkpoint lacks weight '{entry.name}'")
        array = np.asarray(state[name])
        if array.shape != (want := hf_shape(cfg, entry)):
            raise ValueError(f"HF weight {entry.name} has shape {array.shape}, the config needs {want}")
        for piece in entry.pieces:
            ours = from_hf(array, piece, cfg.n_heads)
            if entry.layer is None:
                set_path(params, piece.path, ours)
            else:
                layers.setdefault(piece.path, []).append(ours)
    for path, per_layer in layers.items():
        set_path(params, path, np.stack(per_layer))
        assert per_layer[0].shape == get_path(shapes, path).shape[1:]
    return params


def hf_config(cfg: Config) -> dict:
    """config.json for the family's HF model matching our config."""
    return families.of(cfg).hf_config(cfg)


def config_from_hf(hf: Mapping, **overrides) -> Config:
    """Our config for an HF config.json of any family's (shape and block keys; the rest keep their defaults)."""
    from mesh_transformer.config import from_dict

    fam = families.for_hf(hf)
    raw = {"family": fam.name, **fam.config_from_hf(hf)}
    # HF keeps no model-parallel width: the widest of the original's that splits the heads and the vocab
    raw["cores_per_replica"] = max(w for w in (8, 4, 2, 1) if raw["n_heads"] % w == 0 and raw["n_vocab"] % w == 0)
    raw.update(overrides)
    return from_dict(raw)
