"""The model families, one module each, and their registry: a family module defines FAMILY (model/family.py's
`Family`); adding one is its import and its name in `_MODULES` below."""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from mesh_transformer.model.families import gptj, gptneox, llama
from mesh_transformer.model.family import Family, Path

_MODULES = (gptj, gptneox, llama)


def _lora_paths(family: Family) -> dict[str, Path]:
    return {row.lora: path[1:] for path, row in family.params.items() if row.lora}


def _registry() -> dict[str, Family]:
    """The families by name; a LoRA target adapts the weight at the same path in every family (adapters are named
    by target alone)."""
    families: dict[str, Family] = {}
    for family in (module.FAMILY for module in _MODULES):
        for other in families.values():
            for target, path in _lora_paths(family).items():
                if _lora_paths(other).get(target, path) != path:
                    raise ValueError(f"family {family.name}'s LoRA target {target!r} adapts {'/'.join(path)}, "
                                     f"family {other.name}'s {'/'.join(_lora_paths(other)[target])}")
        families[family.name] = family
    return families


FAMILIES = _registry()


def named(name: str) -> Family:
    """The family of this name; a ValueError naming the choices otherwise."""
    if name not in FAMILIES:
        raise ValueError(f"unknown model family {name!r}; choose one of {', '.join(sorted(FAMILIES))}")
    return FAMILIES[name]


def of(cfg: Any) -> Family:
    """The config's family."""
    return named(cfg.family)


def for_hf(hf_config: Mapping) -> Family:
    """The family of an HF config.json, by its model_type."""
    kind = hf_config.get("model_type")
    for family in FAMILIES.values():
        if kind == family.hf_model_type or kind in family.hf_also_reads:
            return family
    types = ", ".join(repr(f.hf_model_type) for f in FAMILIES.values())
    raise ValueError(f"HF config has model_type {kind!r}; the model families read {types}")


def names() -> list[str]:
    return sorted(FAMILIES)


def lora_paths() -> dict[str, Path]:
    """LoRA target -> the path inside one layer of the weight it adapts, in every family."""
    return {target: path for family in FAMILIES.values() for target, path in _lora_paths(family).items()}
