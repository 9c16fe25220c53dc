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
    """One HF tensor: its name, its layer (None: a top-level one), the pieces of ours it holds, its shape, and the
    other names a checkpoint may hold it under (the family's aliases)."""
    name: str
    layer: int | None
    pieces: tuple[Piece, ...]
    shape: tuple[int, ...]
    aliases: tuple[str, ...] = ()

    def held_name(self, names) -> str | None:
        """The name a checkpoint holding `names` keeps this tensor under (its own, or an alias), or None."""
        return next((name for name in (self.name, *self.aliases) if name in names), None)


def hf_layout(cfg: Config) -> list[Entry]:
    """Every HF tensor of the config's family, in `to_hf_arrays` order: the top-level ones, then each layer tensor
    for every layer. Streaming converters use it to read and write one tensor at a time, and to know every shape up
    front."""
    family, shapes = families.of(cfg), param_shapes(cfg)
    groups: dict[tuple[bool, str], list[Piece]] = {}
    for path, row in params_table(cfg).items():
        groups.setdefault((path[0] == "layers", row.hf), []).append(Piece(path, row.transposed, row.hf_part))

    def entry(local: str, pieces: list[Piece], layer: int | None) -> Entry:
        prefix = "" if layer is None else f"{family.hf_layers}.{layer}."
        shape = get_path(shapes, pieces[0].path).shape[0 if layer is None else 1:]
        shape = shape[::-1] if pieces[0].transposed else shape
        return Entry(prefix + local, layer, tuple(sorted(pieces, key=lambda p: p.part or 0)),
                     (len(pieces) * shape[0], *shape[1:]),
                     tuple(prefix + alias for alias in family.hf_aliases.get(local, ())))

    layout = [entry(local, pieces, None) for (stacked, local), pieces in groups.items() if not stacked]
    return layout + [entry(local, pieces, i) for (stacked, local), pieces in groups.items() if stacked
                     for i in range(cfg.layers)]


def hf_names(cfg: Config) -> list[str]:
    """Every tensor name of the family's HF state dict, in our export order."""
    return [entry.name for entry in hf_layout(cfg)]


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
    layers: dict[Path, list] = {}
    params: dict = {}
    for entry in hf_layout(cfg):
        name = entry.held_name(state)
        if name is None:
            raise ValueError(f"HF checkpoint lacks weight '{entry.name}'")
        array = np.asarray(state[name])
        if array.shape != entry.shape:
            raise ValueError(f"HF weight {entry.name} has shape {array.shape}, the config needs {entry.shape}")
        for piece in entry.pieces:
            ours = from_hf(array, piece, cfg.n_heads)
            if entry.layer is None:
                set_path(params, piece.path, ours)
            else:
                layers.setdefault(piece.path, []).append(ours)
    for path, per_layer in layers.items():
        set_path(params, path, np.stack(per_layer))
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
    raw["cores_per_replica"] = max(w for w in (8, 4, 2, 1) if raw["n_heads"] % w == 0 and raw["n_vocab"] % w == 0
                                   and (raw.get("n_kv_heads") or raw["n_heads"]) % w == 0)
    raw.update(overrides)
    return from_dict(raw)
