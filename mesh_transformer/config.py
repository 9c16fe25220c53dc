"""Flat JSON configs: the original GPT-J keys plus a few new ones, loaded into a frozen, validated dataclass."""
from __future__ import annotations

import dataclasses
import difflib
import json
import re
import types
import typing
from typing import Any
from collections.abc import Sequence


LORA_TARGETS = ("q", "k", "v", "out", "fc_in", "fc_out", "gate")  # "gate": a gated MLP's (llama)


class ConfigError(ValueError):
    """A config file or override that cannot be used; the message names the key."""


@dataclasses.dataclass(frozen=True)
class Config:
    # The model family (model/families/: "gptj", "gptneox") and its own keys (each family names those it reads).
    family: str = "gptj"
    parallel_residual: bool = True  # gptneox: attention and the MLP read the layer's input side by side
    rotary_base: float = 10000.0  # gptneox, llama: the rotary embedding's base (HF's rope_theta)
    n_kv_heads: int = 0  # llama: key and value heads (grouped-query attention; 0: n_heads)
    intermediate_size: int = 0  # llama: the MLP's width (0: 4 x d_model)
    rope_scaling: dict | None = None  # llama: HF's rope scaling ({"rope_type": "llama3" | "linear", "factor", ...})
    # Model shape (original keys).
    layers: int = 28
    d_model: int = 4096
    n_heads: int = 16
    n_vocab: int = 50400
    norm: str = "layernorm"
    pe: str = "rotary"
    pe_rotary_dims: int = 64
    seq: int = 2048
    # Parallelism and batch (original keys).
    cores_per_replica: int = 8
    per_replica_batch: int = 1
    gradient_accumulation_steps: int = 1
    tpu_size: int = 8
    # Optimizer schedule (original keys).
    warmup_steps: int = 3000
    anneal_steps: int = 300000
    lr: float = 1.2e-4
    end_lr: float = 1.2e-5
    weight_decay: float = 0.1
    total_steps: int = 350000
    # Data, checkpoints, logging (original keys).
    bucket: str | None = None
    model_dir: str = "model_dir"
    train_set: str | list | None = None
    val_set: dict = dataclasses.field(default_factory=dict)
    eval_harness_tasks: list = dataclasses.field(default_factory=list)
    eval_harness_limit: int | None = None  # new key: examples per eval_harness_tasks task at most (None: all)
    val_batches: int = 100
    val_every: int = 500
    ckpt_every: int = 500
    keep_every: int = 10000
    name: str = "gptj"
    wandb_project: str | None = None
    comment: str = ""
    # New keys.
    compute_dtype: str = "auto"
    remat: bool = True
    remat_policy: str = "full"  # with remat: "full" keeps each layer's input, "save_qkv" / "save_mlp_hidden" more
    join_projections: bool = False
    seed: int = 0
    tokenizer: str = "gpt2"
    parallelism: str = "shard_map"
    # shard_map kind with dp > 1: Adam's moments split over 'dp' too, the gradients reduce-scattered onto them once a
    # step and the updated params all-gathered (ZeRO-1/2, parallel/layout.py); false: every replica holds them whole.
    shard_optimizer: bool = True
    mesh_fsdp: int = 1
    mesh_tensor: int = 1
    keep_last: int = 3
    # LoRA fine-tuning (model/lora.py): rank 0 is off.
    lora_rank: int = 0
    lora_alpha: float | None = None
    lora_targets: list = dataclasses.field(default_factory=lambda: list(LORA_TARGETS))
    base_dtype: str = "float32"
    # Inference: what the layers' matrices are held in, "compute" (the compute dtype) or "int8" (model/quant.py).
    weight_dtype: str = "compute"
    quantize_head: bool = False  # with int8 weights, the LM head in int8 too (the embedding stays in compute dtype)
    kv_cache_dtype: str = "compute"  # the paged KV cache: in the compute dtype, or "int8" (infer/paged.py)
    # Serving LoRA adapters side by side over the base (model/lora_slots.py): slots held, and their rank (0: none).
    max_loras: int = 0
    max_lora_rank: int = 16

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def d_ff(self) -> int:
        return self.intermediate_size or 4 * self.d_model

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def model_path(self) -> str:
        """Where checkpoints and metrics live: gs://bucket/model_dir when `bucket` is set, as in the original."""
        if self.bucket and not self.model_dir.startswith("gs://"):
            return f"gs://{self.bucket}/{self.model_dir}"
        return self.model_dir

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


_FIELDS = {f.name: f for f in dataclasses.fields(Config)}
_CHOICES = {
    "norm": ("layernorm",),
    "pe": ("rotary",),
    "compute_dtype": ("auto", "float32", "bfloat16"),
    "parallelism": ("shard_map", "dp", "fsdp", "tp", "fsdp_tp"),
    "base_dtype": ("float32", "bfloat16", "int8"),
    "weight_dtype": ("compute", "int8"),
    "kv_cache_dtype": ("compute", "int8"),
    "remat_policy": ("full", "save_qkv", "save_mlp_hidden"),
}


def _type_name(tp: Any) -> str:
    names = {int: "an integer", float: "a number", str: "a string", bool: "true or false", list: "a list",
             dict: "an object", type(None): "null"}
    args = typing.get_args(tp) if isinstance(tp, types.UnionType) else (tp,)
    return " or ".join(names[a] for a in args)


def _type_ok(value: Any, tp: Any) -> bool:
    args = typing.get_args(tp) if isinstance(tp, types.UnionType) else (tp,)
    for arg in args:
        if arg is float and isinstance(value, (int, float)) and not isinstance(value, bool):
            return True
        if arg is int and isinstance(value, int) and not isinstance(value, bool):
            return True
        if arg not in (int, float) and isinstance(value, arg):
            return True
    return False


def _check_keys(raw: dict) -> None:
    hints = typing.get_type_hints(Config)
    for key, value in raw.items():
        if key not in _FIELDS:
            near = difflib.get_close_matches(key, list(_FIELDS), n=1)
            hint = f"; did you mean '{near[0]}'?" if near else ""
            raise ConfigError(f"unknown config key '{key}'{hint}")
        if not _type_ok(value, hints[key]):
            raise ConfigError(f"config key '{key}' must be {_type_name(hints[key])}, got {value!r}")
        if key in _CHOICES and value not in _CHOICES[key]:
            raise ConfigError(f"config key '{key}' must be one of {', '.join(_CHOICES[key])}, got {value!r}")


def _check_family(cfg: Config) -> None:
    from mesh_transformer.model import families

    try:
        own = families.of(cfg).config_keys
    except ValueError as e:
        raise ConfigError(f"config key 'family': {e}") from None
    defaults = Config()
    for name in families.names():
        for key in families.named(name).config_keys:
            if key not in own and getattr(cfg, key) != getattr(defaults, key):
                raise ConfigError(f"config key '{key}' belongs to the {name} family, not this config's "
                                  f"{cfg.family}")


def _check_values(cfg: Config) -> None:
    _check_family(cfg)
    positive = ("layers", "d_model", "n_heads", "n_vocab", "seq", "cores_per_replica", "per_replica_batch",
                "gradient_accumulation_steps", "tpu_size", "total_steps", "keep_last", "mesh_fsdp", "mesh_tensor",
                "max_lora_rank")
    for key in positive:
        if getattr(cfg, key) < 1:
            raise ConfigError(f"config key '{key}' must be at least 1, got {getattr(cfg, key)}")
    if cfg.d_model % cfg.n_heads:
        raise ConfigError(f"config key 'd_model' ({cfg.d_model}) must be divisible by n_heads ({cfg.n_heads})")
    if cfg.n_kv_heads < 0 or cfg.n_heads % cfg.kv_heads or cfg.intermediate_size < 0:
        raise ConfigError(f"config key 'n_kv_heads' ({cfg.n_kv_heads}) must divide n_heads ({cfg.n_heads}), and "
                          f"'intermediate_size' must be at least 0 (0: 4 x d_model)")
    split = ("n_heads", "n_vocab") if cfg.parallelism == "shard_map" else ()  # GSPMD: parallel.layout
    for key in split:
        if getattr(cfg, key) % cfg.cores_per_replica:
            raise ConfigError(f"config key '{key}' ({getattr(cfg, key)}) must be divisible by "
                              f"cores_per_replica ({cfg.cores_per_replica})")
    if split and cfg.kv_heads % cfg.cores_per_replica and cfg.cores_per_replica % cfg.kv_heads:
        raise ConfigError(f"config key 'n_kv_heads' ({cfg.kv_heads}) must divide cores_per_replica "
                          f"({cfg.cores_per_replica}) or be divisible by it: fewer key heads are held whole on every "
                          f"device, more are split")
    _check_lora(cfg)
    if cfg.quantize_head and cfg.weight_dtype != "int8":
        raise ConfigError("config key 'quantize_head' (--quantize-head) needs int8 weights: weight_dtype \"int8\" "
                          "(--dtype int8)")
    rot = cfg.pe_rotary_dims
    if rot < 0 or rot % 2 or rot > cfg.head_dim:
        raise ConfigError(f"config key 'pe_rotary_dims' ({rot}) must be even, at least 0 and at most the head "
                          f"dimension d_model/n_heads ({cfg.head_dim})")


def _check_lora(cfg: Config) -> None:
    if cfg.max_loras < 0:
        raise ConfigError(f"config key 'max_loras' must be at least 0 (0 = no adapter slots), got {cfg.max_loras}")
    if cfg.lora_rank < 0:
        raise ConfigError(f"config key 'lora_rank' must be at least 0 (0 = no LoRA), got {cfg.lora_rank}")
    if cfg.lora_alpha is not None and cfg.lora_alpha <= 0:
        raise ConfigError(f"config key 'lora_alpha' must be greater than 0, got {cfg.lora_alpha}")
    targets = cfg.lora_targets
    unknown = [t for t in targets if t not in LORA_TARGETS]
    if unknown or (cfg.lora_rank and not targets) or len(set(map(repr, targets))) < len(targets):
        raise ConfigError(f"config key 'lora_targets' must list distinct names from {', '.join(LORA_TARGETS)}, "
                          f"got {cfg.lora_targets!r}")
    if targets != list(LORA_TARGETS):  # named, not the default (every family's targets)
        from mesh_transformer.model import families

        own = [row.lora for row in families.of(cfg).params.values() if row.lora]
        if missing := [t for t in targets if t not in own]:
            raise ConfigError(f"config key 'lora_targets': {', '.join(map(repr, missing))} is not a LoRA target of "
                              f"the {cfg.family} family; its targets are {', '.join(own)}")
    if not cfg.remat and cfg.remat_policy != "full":
        raise ConfigError(f"config key 'remat_policy' ({cfg.remat_policy!r}) says what remat keeps: use it with remat "
                          "true, or leave it \"full\"")
    if cfg.lora_rank and cfg.join_projections:
        raise ConfigError("config key 'join_projections' joins the base weights, which LoRA adapts one by one: "
                          "set it false with lora_rank > 0")
    if cfg.base_dtype == "int8" and cfg.eval_harness_tasks:
        raise ConfigError("config key 'base_dtype' int8 holds the LoRA base quantized for training; the lm-eval tasks "
                          "of 'eval_harness_tasks' run on a float base: set base_dtype bfloat16, or score the run "
                          "after it (device_eval.py --lora)")


def from_dict(raw: dict) -> Config:
    """Build a validated Config from a flat dict (e.g. parsed JSON)."""
    if not isinstance(raw, dict):
        raise ConfigError(f"a config must be a JSON object, got {type(raw).__name__}")
    _check_keys(raw)
    cfg = Config(**raw)
    _check_values(cfg)
    return cfg


def _parse_override(item: str) -> tuple[str, Any]:
    key, sep, text = item.partition("=")
    if not sep or not key:
        raise ConfigError(f"override '{item}' must look like key=value")
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        value = text  # a bare word such as model_dir=runs/a is a string
    if key in _FIELDS and _FIELDS[key].type in ("str", "str | None") and not isinstance(value, str):
        # name=123 stays the string "123"; bucket=null unsets an optional key
        value = None if value is None and _FIELDS[key].type == "str | None" else text
    return key, value


def parse_overrides(overrides: Sequence[str]) -> dict[str, Any]:
    """`key=value` overrides (value parsed as JSON, else a string; `null` unsets an optional key) as a dict."""
    return dict(_parse_override(item) for item in overrides)


def load(path: str, overrides: Sequence[str] = ()) -> Config:
    """Read a JSON config file, apply `key=value` overrides, validate."""
    from mesh_transformer import storage

    try:
        raw = json.loads(storage.read_bytes(path))
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"config file {path} is not valid JSON: {e}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"config file {path} must hold a JSON object")
    raw.update(parse_overrides(overrides))
    return from_dict(raw)


def check_devices(cfg: Config, n_devices: int) -> None:
    """The device count must split into whole model-parallel groups (or GSPMD fsdp x tensor groups)."""
    if cfg.parallelism != "shard_map":
        if n_devices % (cfg.mesh_fsdp * cfg.mesh_tensor):
            raise ConfigError(f"config keys 'mesh_fsdp' x 'mesh_tensor' ({cfg.mesh_fsdp} x {cfg.mesh_tensor}) must "
                              f"divide the device count ({n_devices})")
        return
    if n_devices % cfg.cores_per_replica:
        raise ConfigError(f"config key 'cores_per_replica' ({cfg.cores_per_replica}) must divide the device count "
                          f"({n_devices}); --set cores_per_replica={model_parallel_widths(cfg, n_devices)[-1]} is the "
                          f"widest that fits these devices")


def fit_devices(cfg: Config, n_devices: int) -> Config:
    """The config with its model-parallel width fitted to the devices present, as inference fits it: the config's
    cores_per_replica where it divides the device count, n_heads and n_vocab, else the widest width that does (the
    demo's 4 on one chip: 1). The GSPMD kinds' mesh_fsdp x mesh_tensor must divide the device count as given."""
    widths = model_parallel_widths(cfg, n_devices, kv_whole=True)
    if cfg.parallelism != "shard_map" or cfg.cores_per_replica in widths:
        check_devices(cfg, n_devices)
        return cfg
    return dataclasses.replace(cfg, cores_per_replica=widths[-1])


def model_parallel_widths(cfg: Config, n_devices: int, kv_whole: bool = False) -> list[int]:
    """The model-parallel widths, smallest first, that divide the device count, n_heads, n_kv_heads and n_vocab (1
    always does); with `kv_whole` (training: the key heads held whole on every device where fewer) also those that
    n_kv_heads divides."""
    return [width for width in range(1, n_devices + 1)
            if n_devices % width == 0 and cfg.n_heads % width == 0 and cfg.n_vocab % width == 0
            and (cfg.kv_heads % width == 0 or (kv_whole and width % cfg.kv_heads == 0))]


DTYPE_FLAGS = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}  # the tools' --dtype names
# The sampling, serving and eval tools' --dtype: the config keys each sets (int8: int8 weights, bf16 compute).
INFERENCE_DTYPES = {**{flag: {"compute_dtype": name, "weight_dtype": "compute", "quantize_head": False}
                       for flag, name in DTYPE_FLAGS.items()},
                    "int8": {"compute_dtype": "bfloat16", "weight_dtype": "int8"}}
_SIZE_UNITS = {"": 1, "b": 1, "kb": 10 ** 3, "mb": 10 ** 6, "gb": 10 ** 9, "tb": 10 ** 12, "kib": 2 ** 10,
               "mib": 2 ** 20, "gib": 2 ** 30, "tib": 2 ** 40}


def parse_size(text: str, what: str = "size") -> int:
    """Bytes in a size such as '5GB' (powers of ten, as transformers reads them), '16GiB' (powers of two) or a plain
    byte count; a ConfigError naming `what` (a flag) otherwise."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", str(text))
    if not match or match.group(2).lower() not in _SIZE_UNITS:
        raise ConfigError(f"{what} must look like 5GB, 500MB or 16GiB (or a number of bytes), got {text!r}")
    return int(float(match.group(1)) * _SIZE_UNITS[match.group(2).lower()])


def check_sampling(temperature: Sequence[float], top_k: Sequence[int], top_p: Sequence[float]) -> None:
    """Raises a ValueError naming the first sampling value out of range."""
    if bad := [t for t in temperature if not t >= 0]:  # NaN fails too
        raise ValueError(f"temperature must be at least 0 (0 = greedy), got {bad[0]}")
    if any(k < 0 for k in top_k):
        raise ValueError(f"top_k must be at least 0 (0 = off), got {min(top_k)}")
    if any(not 0 < p <= 1 for p in top_p):
        raise ValueError(f"top_p must be in (0, 1], got {next(p for p in top_p if not 0 < p <= 1)}")
