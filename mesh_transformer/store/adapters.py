"""LoRA adapters on disk: a LoRA run's checkpoints (ours) or an HF PEFT directory read as numpy adapters, checked
against the base model, and a param source that merges them into the base's weights as it reads them.

A LoRA run's checkpoint is one of ours whose params are the adapters alone ("params/{target}/a" [L, in, r] and
"params/{target}/b" [L, r, out]) with their optimizer state; its metadata carries "lora_base": the base model's
path, format, step and identity (see train/finetune.py), so the base is found from the run itself.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from mesh_transformer import config
from mesh_transformer.config import Config, ConfigError
from mesh_transformer.model import families, lora
from mesh_transformer.model.table import Path
from mesh_transformer.store import checkpoint, peft
from mesh_transformer.store.checkpoint_stream import LeafReader

BASE_KEY = "lora_base"  # the metadata entry of a LoRA run's checkpoints


def run_metadata(path: str) -> dict | None:
    """The metadata of a LoRA run's checkpoint at `path` (root or step dir), or None for anything else."""
    try:
        metadata = checkpoint.read_metadata(*checkpoint.find_step(path))
    except FileNotFoundError:
        return None
    return metadata if BASE_KEY in metadata else None


def read_run(path: str) -> tuple[dict, float, dict]:
    """(adapters in f32, scale, metadata) of a LoRA run's latest checkpoint (or of one step directory)."""
    root, step = checkpoint.find_step(path)
    leaves = LeafReader(root, step)
    run_cfg = leaves.metadata["config"]
    rank, alpha = _rank_alpha(run_cfg)
    family_targets = {row.lora for row in families.named(run_cfg.get("family", "gptj")).params.values()}
    adapters = {t: {w: np.asarray(leaves.read(f"params/{t}/{w}"), np.float32) for w in "ab"}
                for t in run_cfg["lora_targets"] if t in family_targets}  # the default names every family's
    return adapters, alpha / rank, leaves.metadata


def check_shapes(adapters: dict, cfg: Config, where: str) -> None:
    """Each adapter must fit the base: A [L, in, r] and B [L, r, out] for the weight it adapts."""
    if not adapters:
        raise ConfigError(f"adapter {where} holds no adapters")
    rank = next(iter(adapters.values()))["a"].shape[-1]
    shapes = lora.lora_shapes(dataclasses.replace(cfg, lora_rank=rank, lora_targets=list(adapters)))
    for target, ab in adapters.items():
        for w in "ab":
            if tuple(ab[w].shape) != shapes[target][w].shape:
                raise ConfigError(f"adapter {where}: {target}.{w} has shape {tuple(ab[w].shape)}, the base model "
                                  f"needs {shapes[target][w].shape}")


def read_adapters(source: str, cfg: Config) -> tuple[dict, float]:
    """(adapters in f32, scale) from a LoRA run of ours or a PEFT directory, checked against the base's config."""
    if peft.is_peft_dir(source):
        adapters, scale = peft.read_peft(source, cfg)
    elif run_metadata(source) is not None:
        adapters, scale, _ = read_run(source)
    else:
        raise FileNotFoundError(f"--lora {source} is neither a LoRA run of ours (a checkpoint with lora_base in its "
                                f"metadata) nor a PEFT adapter directory ({peft.CONFIG_FILE})")
    check_shapes(adapters, cfg, source)
    return adapters, scale


class MergedReader:
    """A param source whose adapted weights read as W + A @ B * scale (in f32); everything else as the base's. A
    loader with devices to merge on takes it apart instead: `base` read as stored, `adapters` ({target: {"a", "b"}},
    stacked, f32) and `scale` merged by `lora.merge_layers` where the layer is placed."""

    def __init__(self, base: Any, adapters: dict, scale: float):
        self.base, self.adapters, self.scale, self.step = base, adapters, scale, base.step
        self._by_path = {("layers", *families.lora_paths()[t]): ab for t, ab in adapters.items()}

    def read(self, path: Path, layer: int | None = None) -> np.ndarray:
        array = self.base.read(path, layer)
        ab = self._by_path.get(tuple(path))
        if ab is None:
            return array
        a, b = (ab["a"], ab["b"]) if layer is None else (ab["a"][layer], ab["b"][layer])
        return np.asarray(array, np.float32) + lora.delta(a, b, self.scale, np)

    def close(self) -> None:
        self.base.close()


def taken_apart(reader: Any) -> tuple[Any, dict | None, float]:
    """(the base reader, the adapters or None, their scale) of a param source: a `MergedReader` taken apart for a
    loader that merges the adapters where it places each layer."""
    if isinstance(reader, MergedReader):
        return reader.base, reader.adapters, reader.scale
    return reader, None, 0.0


def export_peft(source: str, output: str) -> list[str]:
    """A LoRA run's adapters written as an HF PEFT adapter directory; returns the files written."""
    if run_metadata(source) is None:
        raise ConfigError(f"--peft needs a LoRA run (one of our checkpoints with lora_base in its metadata); "
                          f"{source} is not one")
    found, _, metadata = read_run(source)
    return peft.write_peft(output, found, config.from_dict(metadata["config"]), *_rank_alpha(metadata["config"]),
                           metadata[BASE_KEY]["path"])


def _rank_alpha(run_cfg: dict) -> tuple[int, float]:
    """A LoRA run's rank and alpha from its saved config."""
    return run_cfg["lora_rank"], lora.alpha(run_cfg["lora_rank"], run_cfg.get("lora_alpha"))
