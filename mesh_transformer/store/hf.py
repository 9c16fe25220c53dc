"""HF GPTJForCausalLM state dicts <-> our param tree, as numpy arrays, no torch (torch Linear weight = our kernel
transposed)."""
from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping

import numpy as np

from mesh_transformer.config import Config
from mesh_transformer.model.table import PARAMS, get_path, param_shapes, set_path

GPT2_EOS = 50256

# (our path, HF name, transposed?) of the top-level params and of a layer's (path and name inside one layer)
_TOP_NAMES = [(path, row.hf, row.transposed) for path, row in PARAMS.items() if path[0] != "layers"]
_LAYER_NAMES = [(path[1:], row.hf, row.transposed) for path, row in PARAMS.items() if path[0] == "layers"]


def hf_layout(n_layers: int) -> list[tuple[tuple[str, ...], int | None, str, bool]]:
    """(our path, layer index or None, HF name, transpose?) for every HF weight, in `to_hf_arrays` order.

    Streaming converters use it to read and write one weight at a time, and to know every shape up front.
    """
    layout = [(path, None, name, transpose) for path, name, transpose in _TOP_NAMES]
    layout += [(("layers", *path), i, f"transformer.h.{i}.{name}", transpose)
               for path, name, transpose in _LAYER_NAMES for i in range(n_layers)]
    return layout


def hf_names(n_layers: int) -> list[str]:
    """Every weight name of an HF GPT-J state dict, in our export order."""
    return [name for _, _, name, _ in hf_layout(n_layers)]


def to_hf_arrays(get: Callable[[tuple[str, ...]], np.ndarray], n_layers: int) -> Iterator[tuple[str, np.ndarray]]:
    """Yield (HF name, array) one at a time; `get(path)` returns one of our (stacked) arrays as numpy."""
    for path, name, transpose in _TOP_NAMES:
        array = np.asarray(get(path))
        yield name, np.ascontiguousarray(array.T) if transpose else array
    for path, name, transpose in _LAYER_NAMES:
        stacked = get(("layers", *path))
        for i in range(n_layers):
            array = np.asarray(stacked[i])
            yield f"transformer.h.{i}.{name}", np.ascontiguousarray(array.T) if transpose else array


def params_to_hf(params: Mapping, n_layers: int) -> dict[str, np.ndarray]:
    """Our param tree (numpy or jax arrays) as an HF GPTJForCausalLM state dict of numpy arrays."""
    return dict(to_hf_arrays(lambda path: np.asarray(get_path(params, path)), n_layers))


def hf_to_params(state: Mapping[str, np.ndarray], cfg: Config) -> dict:
    """An HF GPTJForCausalLM state dict (numpy arrays) as our param tree; checks every name and shape."""
    shapes = param_shapes(cfg)
    params: dict = {}

    def take(name: str) -> np.ndarray:
        if name not in state:
            raise ValueError(f"HF checkpoint lacks weight '{name}'")
        return np.asarray(state[name])

    def place(path, array):
        want = get_path(shapes, path).shape
        if array.shape != want:
            raise ValueError(f"HF weight for {'/'.join(path)} has shape {array.shape}, the config needs {want}")
        set_path(params, path, array)

    for path, name, transpose in _TOP_NAMES:
        array = take(name)
        place(path, array.T if transpose else array)
    for path, name, transpose in _LAYER_NAMES:
        per_layer = [take(f"transformer.h.{i}.{name}") for i in range(cfg.layers)]
        place(("layers", *path), np.stack([a.T if transpose else a for a in per_layer]))
    return params


def hf_config(cfg: Config) -> dict:
    """config.json for GPTJForCausalLM matching our config."""
    return {
        "architectures": ["GPTJForCausalLM"],
        "model_type": "gptj",
        "vocab_size": cfg.n_vocab,
        "n_positions": cfg.seq,
        "n_embd": cfg.d_model,
        "n_layer": cfg.layers,
        "n_head": cfg.n_heads,
        "rotary_dim": cfg.pe_rotary_dims,
        "n_inner": None,
        "activation_function": "gelu_new",
        "layer_norm_epsilon": 1e-5,
        "resid_pdrop": 0.0,
        "embd_pdrop": 0.0,
        "attn_pdrop": 0.0,
        "initializer_range": 0.02,
        "tie_word_embeddings": False,
        "bos_token_id": GPT2_EOS,
        "eos_token_id": GPT2_EOS,
        "use_cache": True,
    }


def config_from_hf(hf: Mapping, **overrides) -> Config:
    """Our config for an HF GPT-J config.json (shape keys only; the rest keep their defaults)."""
    from mesh_transformer.config import from_dict

    if hf.get("model_type") != "gptj":
        raise ValueError(f"HF config has model_type {hf.get('model_type')!r}, expected 'gptj'")
    if hf.get("activation_function", "gelu_new") != "gelu_new" or hf.get("n_inner") not in (None, 4 * hf["n_embd"]):
        raise ValueError("only GPT-J models with gelu_new and n_inner = 4 * n_embd are supported")
    raw = {"layers": hf["n_layer"], "d_model": hf["n_embd"], "n_heads": hf["n_head"], "n_vocab": hf["vocab_size"],
           "pe_rotary_dims": hf.get("rotary_dim") or hf["n_embd"] // hf["n_head"], "seq": hf["n_positions"],
           # HF keeps no model-parallel width: the widest of the original's that splits the heads and the vocab
           "cores_per_replica": max(w for w in (8, 4, 2, 1) if hf["n_head"] % w == 0 and hf["vocab_size"] % w == 0)}
    raw.update(overrides)
    return from_dict(raw)
