"""HF PEFT LoRA adapter directories <-> our adapters (numpy, {target: {"a": [L, in, r], "b": [L, r, out]}}).

A PEFT directory holds adapter_config.json (peft_type LORA, r, lora_alpha, target_modules, ...) and
adapter_model.safetensors with, per layer i and module, `base_model.model.transformer.h.{i}.{module}.lora_A.weight`
[r, in] and `.lora_B.weight` [out, r] (torch Linear layout: ours transposed). PEFT's scale is lora_alpha / r, ours
too. Written with numpy, no torch; adapter_config.json comes last, so a half-written directory does not load.
"""
from __future__ import annotations

import json
import re
from collections.abc import Iterator

import numpy as np

from mesh_transformer.config import Config, ConfigError
from mesh_transformer.model import families, table
from mesh_transformer import storage
from mesh_transformer.store import safetensors_io

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"


def modules(cfg: Config) -> dict[str, str]:
    """Our LoRA target -> its HF module inside layer i (the family's table's HF name, less ".weight"). A target
    whose weight HF holds in a shared tensor (GPT-NeoX's q, k, v in query_key_value) has no PEFT module of its own."""
    rows = table.params_table(cfg)
    return {target: rows[path].hf.removesuffix(".weight") for target, path in table.lora_targets(cfg).items()
            if rows[path].hf_part is None}


def _pattern(cfg: Config) -> re.Pattern:
    prefix = re.escape(families.of(cfg).hf_layers)
    return re.compile(rf"(?:^|\.){prefix}\.(\d+)\.(.+)\.lora_([AB])(?:\.[^.]+)?\.weight$")


def is_peft_dir(path: str) -> bool:
    return storage.exists(storage.join(path.rstrip("/"), CONFIG_FILE))


def _key(cfg: Config, layer: int, target: str, which: str) -> str:
    return f"base_model.model.{families.of(cfg).hf_layers}.{layer}.{modules(cfg)[target]}.lora_{which}.weight"


def write_peft(output: str, adapters: dict, cfg: Config, rank: int, alpha: float, base_model: str = "") -> list[str]:
    """Writes our adapters as a PEFT LoRA directory that `peft.PeftModel.from_pretrained` loads; returns the files."""
    targets = list(adapters)
    if missing := [t for t in targets if t not in modules(cfg)]:
        raise ConfigError(f"LoRA targets {', '.join(missing)} adapt part of a tensor HF holds whole in the "
                          f"{cfg.family} family, which a PEFT adapter cannot hold; export the merged model instead")
    n_layers = next(iter(adapters.values()))["a"].shape[0]
    names = [(i, t, w) for t in targets for i in range(n_layers) for w in "AB"]

    def tensor(i: int, t: str, which: str) -> np.ndarray:
        array = adapters[t]["a" if which == "A" else "b"][i]
        return np.ascontiguousarray(np.asarray(array, np.float32).T)

    entries = [(_key(cfg, i, t, w), tensor(i, t, w).shape, np.dtype(np.float32)) for i, t, w in names]

    def arrays() -> Iterator[tuple[str, np.ndarray]]:
        for i, t, w in names:
            yield _key(cfg, i, t, w), tensor(i, t, w)

    files = safetensors_io.write_dir(output, entries, arrays(), 2 ** 62, single_file=WEIGHTS_FILE)
    adapter_config = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model, "r": rank,
        "lora_alpha": alpha, "lora_dropout": 0.0, "bias": "none", "fan_in_fan_out": False, "inference_mode": True,
        "target_modules": [modules(cfg)[t].split(".")[-1] for t in targets], "init_lora_weights": True,
        "use_rslora": False, "use_dora": False, "modules_to_save": None, "layers_to_transform": None,
        "rank_pattern": {}, "alpha_pattern": {}}
    storage.write_bytes_atomic(storage.join(output, CONFIG_FILE), json.dumps(adapter_config, indent=2).encode())
    return [*files, CONFIG_FILE]


def _read_config(path: str) -> dict:
    adapter_config = json.loads(storage.read_bytes(storage.join(path, CONFIG_FILE)))
    where = storage.join(path, CONFIG_FILE)
    if adapter_config.get("peft_type") != "LORA":
        raise ConfigError(f"{where} has peft_type {adapter_config.get('peft_type')!r}; only LORA adapters are read")
    unsupported = [k for k in ("use_dora", "fan_in_fan_out", "rank_pattern", "alpha_pattern", "layers_to_transform")
                   if adapter_config.get(k)]
    if unsupported:
        raise ConfigError(f"{where} sets {', '.join(unsupported)}, which this reader does not support")
    return adapter_config


def read_peft(path: str, cfg: Config) -> tuple[dict, float]:
    """A PEFT LoRA directory as (our adapters in f32, scale); every adapted module must cover all layers."""
    path, n_layers, pattern = path.rstrip("/"), cfg.layers, _pattern(cfg)
    adapter_config = _read_config(path)
    by_module = {module: target for target, module in modules(cfg).items()}
    files = safetensors_io.DirReader(path, single_file=WEIGHTS_FILE)
    found: dict[str, dict[str, dict[int, np.ndarray]]] = {}
    try:
        for name in files.names():
            match = pattern.search(name)
            if match is None:
                continue
            layer, module, which = int(match.group(1)), match.group(2), match.group(3)
            if module not in by_module:
                raise ConfigError(f"PEFT adapter {path} adapts {module}, which the {cfg.family} family's LoRA "
                                  f"targets do not include")
            found.setdefault(by_module[module], {}).setdefault(which, {})[layer] = np.asarray(files.read(name),
                                                                                              np.float32).T
    finally:
        files.close()
    adapters = {}
    for target, parts in found.items():
        if any(sorted(parts.get(w, {})) != list(range(n_layers)) for w in "AB"):
            raise ConfigError(f"PEFT adapter {path} does not hold lora_A and lora_B of {modules(cfg)[target]} for "
                              f"all {n_layers} layers")
        adapters[target] = {"a": np.stack([parts["A"][i] for i in range(n_layers)]),
                            "b": np.stack([parts["B"][i] for i in range(n_layers)])}
    if not adapters:
        raise ConfigError(f"PEFT adapter {path} holds no LoRA weights of a {cfg.family} model")
    rank = next(iter(adapters.values()))["a"].shape[-1]
    alpha = adapter_config.get("lora_alpha", rank)
    scale = alpha / np.sqrt(rank) if adapter_config.get("use_rslora") else alpha / rank
    return adapters, float(scale)
