"""Checkpoint interchange: read the params of any checkpoint one array at a time, place them on a mesh, or write them
as our checkpoint (for any cores_per_replica, slim or not); hf_export.py writes them as an HF GPT-J directory.

Sources: our checkpoints (a root holding step_N, or one step directory), original mesh-transformer-jax checkpoints
(mtj_v1.py) and HF GPT-J directories with safetensors weights (pytorch_model.bin is pickle and is never loaded).
Readers give one param, or one layer of a stacked param, at a time and writers take them as they come, so a
conversion holds about one layer in host memory, never the model.
"""
from __future__ import annotations

import contextlib
import itertools
import json
import logging
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np
from tqdm import tqdm

from mesh_transformer.model import families, quant, table
from mesh_transformer import storage
from mesh_transformer.store import adapters, checkpoint, hf, mtj_v1, placing, safetensors_io
from mesh_transformer import config
from mesh_transformer.model import gptj as model
from mesh_transformer.model.table import Path, get_path, param_paths, set_path
from mesh_transformer.parallel.layout import MEGATRON, Layout, followed_param, param_specs
from mesh_transformer.store.checkpoint_stream import LeafReader, StreamingWriter
from mesh_transformer.config import Config, ConfigError
from mesh_transformer.parallel.mesh import DP, MP

log = logging.getLogger(__name__)

CHECKPOINT, MTJ_V1, HF = "checkpoint", "mtj_v1", "hf"
_SHAPE_KEYS = ("family", "layers", "d_model", "n_heads", "n_vocab", "pe_rotary_dims", "parallel_residual",
               "rotary_base")
_PICKLE_WEIGHTS = ("pytorch_model.bin", "pytorch_model.bin.index.json")
SCALES = "scales/"  # an int8 checkpoint's leaf of per-output scales [L, N] beside each int8 matrix (model/quant.py)


def _check_config(saved: Mapping, cfg: Config, where: str) -> None:
    differ = [f"{key}={saved[key]} (the config says {getattr(cfg, key)})" for key in _SHAPE_KEYS
              if key in saved and saved[key] != getattr(cfg, key)]
    if differ:
        raise ConfigError(f"{where} holds a model with {', '.join(differ)}: the config does not match the checkpoint")


# ----------------------------------------------------------------------------------------------------------- sources
def detect_format(path: str) -> str:
    """Which kind of checkpoint `path` holds: CHECKPOINT (ours), MTJ_V1 (original) or HF (a GPT-J directory)."""
    path = path.rstrip("/")
    with contextlib.suppress(FileNotFoundError):
        checkpoint.find_step(path)
        return CHECKPOINT
    if mtj_v1.is_mtj_v1(path):
        return MTJ_V1
    names = set(storage.listdir(path))
    weights = {safetensors_io.SINGLE_FILE, safetensors_io.INDEX_FILE, *_PICKLE_WEIGHTS}
    if "config.json" in names and (names & weights or any(n.endswith(".safetensors") for n in names)):
        return HF
    raise FileNotFoundError(f"no checkpoint at {path}: expected one of ours (step_N/COMMITTED), an original "
                            f"mesh-transformer-jax one (step_N/shard_0/0.npz) or an HF GPT-J directory "
                            f"(config.json and safetensors weights)")


def _hf_config(path: str) -> dict:
    try:
        return json.loads(storage.read_bytes(storage.join(path, "config.json")))
    except FileNotFoundError:
        raise FileNotFoundError(f"HF directory {path} has no config.json") from None


def _config_of_hf_dir(path: str, **overrides: Any) -> Config:
    try:
        raw = _hf_config(path)
        if families.for_hf(raw).own_tokenizer:  # read with the directory's own tokenizer unless told otherwise
            overrides = {"tokenizer": path, **overrides}
        return hf.config_from_hf(raw, **overrides)
    except ConfigError:
        raise
    except ValueError as e:  # a config.json of another model type
        raise ConfigError(f"{storage.join(path, 'config.json')}: {e}") from None


def source_config(path: str, **overrides: Any) -> Config | None:
    """The config a checkpoint carries (ours: its metadata; HF: config.json), with `overrides`; None for MTJ v1."""
    fmt = detect_format(path)
    if fmt == CHECKPOINT:
        saved = checkpoint.read_metadata(*checkpoint.find_step(path)).get("config")
        return config.from_dict({**saved, **overrides}) if saved else None
    return _config_of_hf_dir(path.rstrip("/"), **overrides) if fmt == HF else None


class CheckpointReader:
    """Our checkpoint as a param source; also reads its other leaves (optimizer state) for full rewrites."""

    def __init__(self, path: str, cfg: Config):
        root, self.step = checkpoint.find_step(path)
        self._leaves = LeafReader(root, self.step)
        where = checkpoint.step_dir(root, self.step)
        _check_config(self._leaves.metadata.get("config") or {}, cfg, f"checkpoint {where}")
        for param, like in param_paths(cfg):
            key = "params/" + "/".join(param)
            if key not in self._leaves.leaves:
                raise ConfigError(f"checkpoint {where} has no leaf '{key}'; it does not hold this config's params")
            if self._leaves.shape(key) != like.shape:
                raise ConfigError(f"checkpoint {where} leaf '{key}' has shape {self._leaves.shape(key)}, the config "
                                  f"needs {like.shape}")

    @property
    def metadata(self) -> dict:
        return self._leaves.metadata

    def read(self, path: Path, layer: int | None = None) -> np.ndarray:
        """One param (or one layer of it) as stored; an int8 one dequantized, in f32."""
        held = self.read_int8(path, layer)
        return self.read_leaf("params/" + "/".join(path), layer) if held is None else quant.dequantize(*held)

    def read_mapped(self, path: Path) -> np.ndarray | None:
        """One whole param as its read-only file mapping, where one local piece holds it as a float; else None."""
        key = "/".join(path)
        return None if SCALES + key in self._leaves.leaves else self._leaves.read_mapped("params/" + key)

    def read_int8(self, path: Path, layer: int | None = None) -> tuple[np.ndarray, np.ndarray] | None:
        """(int8 values, f32 scale per output) of a param an int8 checkpoint holds so; None for any other."""
        key = "/".join(path)
        if SCALES + key not in self._leaves.leaves:
            return None
        return self.read_leaf("params/" + key, layer), self.read_leaf(SCALES + key, layer)

    def other_leaves(self) -> list[str]:
        """Every saved leaf besides the params, their scales and the step (the optimizer state, for one)."""
        return [leaf for leaf in self._leaves.leaves
                if not leaf.startswith(("params/", SCALES)) and leaf != "step"]

    def leaf_shape(self, leaf: str) -> tuple[int, ...] | None:
        entry = self._leaves.leaves[leaf]
        return None if "value" in entry else tuple(entry["shape"])

    def read_leaf(self, leaf: str, layer: int | None = None) -> Any:
        if layer is None:
            return self._leaves.read(leaf)
        return self._leaves.read(leaf, (slice(layer, layer + 1),))[0]

    def close(self) -> None:
        self._leaves.close()


class HFReader:
    """An HF GPT-J directory (safetensors, one file or sharded with an index) as a param source."""

    def __init__(self, path: str, cfg: Config):
        self.path, self.cfg, self.step = path, cfg, 0
        names = set(storage.listdir(path))
        pickled = sorted(names & set(_PICKLE_WEIGHTS))
        if pickled and not names & {safetensors_io.SINGLE_FILE, safetensors_io.INDEX_FILE}:
            raise FileNotFoundError(
                f"HF directory {path} has only PyTorch pickle weights ({', '.join(pickled)}), which are never "
                f"unpickled here (pickle runs code): re-save them as safetensors, e.g. "
                f"model.save_pretrained(dir, safe_serialization=True)")
        _check_config(_config_of_hf_dir(path, cores_per_replica=1).to_dict(), cfg, f"HF directory {path}")
        self._files = safetensors_io.DirReader(path)
        self._shapes = dict(param_paths(cfg))
        self._names: dict[tuple[Path, int | None], tuple[str, hf.Piece]] = {}
        for entry in hf.hf_layout(cfg):
            name = entry.held_name(self._files)
            if name is None:
                raise checkpoint.CorruptCheckpointError(f"HF checkpoint {path} lacks weight '{entry.name}'")
            if self._files.shape(name) != entry.shape:
                raise ConfigError(f"HF weight {name} in {path} has shape {self._files.shape(name)}, the config needs "
                                  f"{entry.shape}")
            self._names.update({(piece.path, entry.layer): (name, piece) for piece in entry.pieces})
        self._shared: tuple[str, np.ndarray] | None = None  # the last tensor read that holds several of our params

    def read(self, path: Path, layer: int | None = None) -> np.ndarray:
        if path[0] == "layers" and layer is None:
            return mtj_v1.stack_layers(lambda i: self.read(path, i), self._shapes[path].shape)
        name, piece = self._names[path, layer]
        if piece.part is None:
            return hf.from_hf(self._files.read(name), piece, self.cfg.n_heads)
        if self._shared is None or self._shared[0] != name:  # q, k and v are read in turn: the tensor once
            self._shared = name, self._files.read(name)
        return hf.from_hf(self._shared[1], piece, self.cfg.n_heads)

    def close(self) -> None:
        self._files.close()


@contextlib.contextmanager
def open_params(path: str, cfg: Config, fmt: str | None = None, lora: str | None = None) -> Iterator[Any]:
    """An open param source of any format: `.read(path, layer=None)` gives one param (or one layer) as numpy.

    A LoRA run of ours reads as its base with the run's adapters merged into the weights; `lora` (a LoRA run or a
    PEFT directory) merges those adapters into the weights of `path`.
    """
    fmt = fmt or detect_format(path)
    run = adapters.run_metadata(path) if fmt == CHECKPOINT and lora is None else None
    if run is not None:
        lora, path = path, run[adapters.BASE_KEY]["path"]
        fmt = detect_format(path)
    reader = {CHECKPOINT: CheckpointReader, MTJ_V1: mtj_v1.Reader, HF: HFReader}[fmt](path.rstrip("/"), cfg)
    if lora is not None:
        reader = adapters.MergedReader(reader, *adapters.read_adapters(lora, cfg))
        log.info("merging the LoRA adapters of %s into the weights", lora)
    log.info("reading %s checkpoint %s (step %d)", fmt, path, reader.step)
    try:
        yield reader
    finally:
        reader.close()


def read_array(reader: Any, path: Path, shape: tuple[int, ...], dtype: np.dtype | None = None) -> np.ndarray:
    """One whole param as a global numpy array, stacked leaves assembled layer by layer in `dtype`."""
    if path[0] == "layers":
        return mtj_v1.stack_layers(lambda i: reader.read(path, i), shape, dtype)
    array = reader.read(path)
    return array if dtype is None else array.astype(dtype, copy=False)


def iter_params(path: str, cfg: Config, dtype: Any = None) -> Iterator[tuple[Path, np.ndarray]]:
    """(our param path, global numpy array) for every param of a checkpoint of any format, one array at a time."""
    dtype = None if dtype is None else table.dtype_named(dtype)
    with open_params(path, cfg) as reader:
        for param, like in param_paths(cfg):
            yield param, read_array(reader, param, like.shape, dtype)


def load_params(layout: Layout, source: str, dtype: Any = None) -> dict:
    """The params of a checkpoint of any format, placed as the Layout places them, in `dtype`.

    `dtype` defaults to the config's compute dtype. Our checkpoints are read slice by slice onto the devices; other
    formats one layer of a stacked param at a time (`placing.put_layers`), the rest one global array at a time.
    """
    cfg = layout.cfg
    dtype = table.dtype_named(dtype if dtype is not None else model.precision(cfg).compute)
    fmt = detect_format(source)
    if fmt == CHECKPOINT and not _holds_int8(source):
        root, step = checkpoint.find_step(source)
        _check_config(checkpoint.read_metadata(root, step).get("config") or {}, cfg,
                      f"checkpoint {checkpoint.step_dir(root, step)}")
        try:
            params, _ = checkpoint.restore(root, step, layout.abstract_params(dtype), paths_prefix="params")
        except (KeyError, ValueError) as e:
            raise ConfigError(f"checkpoint {checkpoint.step_dir(root, step)} does not match the config: "
                              f"{e.args[0]}") from e
        return params
    shardings = layout.param_shardings()
    params: dict = {}
    with open_params(source, cfg, fmt) as reader:
        for path, like in tqdm(param_paths(cfg), desc="loading params", unit="array", leave=False):
            sharding = get_path(shardings, path)
            if path[0] == "layers":  # one layer on the host at a time, converted on the devices
                array = placing.put_layers(like.shape, dtype, sharding, lambda i, p=path: reader.read(p, i))
            else:
                array = placing.put_host(read_array(reader, path, like.shape, dtype), sharding)
            set_path(params, path, array)
    return params


def _holds_int8(path: str) -> bool:
    """Whether one of our checkpoints holds int8 params (with their scales)."""
    root, step = checkpoint.find_step(path)
    return any(leaf.startswith(SCALES) for leaf in LeafReader(root, step).leaves)


# ----------------------------------------------------------------------------------------------------------- writers
def _copy_leaf(writer: StreamingWriter, leaf: str, read: Any, key: Any, shape: tuple[int, ...], layered: bool,
               spec: Any) -> None:
    """Streams one array from `read(key[, layer])` into `writer` as `leaf`, layer by layer when `layered`."""
    chunks = (read(key, i)[None] for i in range(shape[0])) if layered else iter([read(key)])
    first = next(chunks)  # its dtype is the one written
    writer.add_chunks(leaf, shape, first.dtype, itertools.chain([first], chunks), spec)


def _write_leaves(reader: Any, writer: StreamingWriter, cfg: Config, extra: list[str], dtype: np.dtype | None,
                  int8: bool = False) -> None:
    """The params (cast to `dtype`; with `int8`, the layers' matrices quantized from their values in `dtype`, their
    scales after) and then the `extra` leaves, split as the Megatron layout places them."""
    specs = param_specs(MEGATRON, cfg)
    params = param_paths(cfg)
    shapes = {path: like.shape for path, like in params}
    layer_paths = [path[1:] for path, _ in params if path[0] == "layers"]
    scales = quant.stacked_scales(lambda path, i: reader.read(("layers", *path), i).astype(dtype, copy=False),
                                  cfg.layers, layer_paths) if int8 else {}

    def read(path: Path, layer: int | None = None) -> np.ndarray:
        group = quant.MATRICES.get(path[1:]) if int8 and path[0] == "layers" else None
        array = reader.read(path, layer)
        array = array if dtype is None else array.astype(dtype, copy=False)
        return array if group is None else quant.quantize(array, scales[group][layer])

    with tqdm(total=len(params) + len(extra), desc=f"writing {writer.directory}", unit="array") as bar:
        for path, like in params:
            _copy_leaf(writer, "params/" + "/".join(path), read, path, like.shape, path[0] == "layers",
                       get_path(specs, path))
            bar.update()
        for path, group in quant.matrices(layer_paths).items() if int8 else ():
            writer.add(SCALES + "/".join(("layers", *path)), scales[group])
        for leaf in extra:
            shape = reader.leaf_shape(leaf)
            if shape is None:
                writer.add(leaf, reader.read_leaf(leaf))
            else:  # optimizer state: split like the param it follows, as training places it; the rest whole
                param = followed_param(leaf.split("/"), shape, shapes)
                layered = bool(shape) and "layers" in leaf.split("/")
                _copy_leaf(writer, leaf, reader.read_leaf, leaf, shape, layered,
                           None if param is None else get_path(specs, param))
            bar.update()


def write_checkpoint(source: str, cfg: Config, output: str, *, cores_per_replica: int | None = None,
                     dtype: Any = None, slim: bool = False) -> str:
    """Rewrites a checkpoint of any format as ours under root `output`, laid out for `cores_per_replica`.

    Params are cast to `dtype` when given; "int8" (slim only) holds the layers' matrices as int8 with a scale per
    output (model/quant.py) and the rest in bf16, and its config says weight_dtype int8. Unless `slim`, the other
    leaves of one of our checkpoints (optimizer state) and its metadata come along; other formats give params only.
    Returns the written step directory.
    """
    int8 = dtype == quant.INT8
    if int8 and not slim:
        raise ConfigError("--dtype int8 writes an inference checkpoint, params only: add --slim")
    out_cfg = config.from_dict({**cfg.to_dict(), "cores_per_replica": cores_per_replica or cfg.cores_per_replica,
                                **(config.INFERENCE_DTYPES[quant.INT8] if int8 else {})})
    dtype = table.dtype_named("bf16" if int8 else dtype) if dtype is not None else None
    fmt = detect_format(source)
    with open_params(source, cfg, fmt) as reader:
        metadata = {"config": out_cfg.to_dict(),
                    "converted_from": {"path": source, "format": fmt, "step": reader.step}}
        extra: list[str] = []
        if not slim and isinstance(reader, CheckpointReader):
            metadata = {**reader.metadata, **metadata}
            extra = reader.other_leaves()
        elif not slim:
            log.warning("%s is a %s checkpoint: only its params are converted, no optimizer state", source, fmt)
        writer = StreamingWriter(output, reader.step, metadata, {DP: 1, MP: out_cfg.cores_per_replica})
        _write_leaves(reader, writer, cfg, extra, dtype, int8)
        writer.add("step", np.asarray(reader.step, np.int32))
        writer.commit()
    log.info("wrote checkpoint %s for cores_per_replica %d", writer.directory, out_cfg.cores_per_replica)
    return writer.directory


def _write_with_config(source: str, cfg: Config, output: str, **options: Any) -> tuple[str, str, dict]:
    """`write_checkpoint`, then the written model's config as {output}/config.json, which the training, sampling
    and serving tools load; returns (step directory, config path, config)."""
    step_dir = write_checkpoint(source, cfg, output, **options)
    out_cfg = checkpoint.read_metadata(*checkpoint.find_step(step_dir))["config"]
    config_path = storage.join(output, "config.json")
    storage.write_bytes_atomic(config_path, json.dumps(out_cfg, indent=2).encode())
    return step_dir, config_path, out_cfg


def convert_checkpoint(source: str, cfg: Config, output: str, *, cores_per_replica: int | None = None,
                       dtype: Any = None, slim: bool = False) -> str:
    """A checkpoint of any format rewritten as ours (see `write_checkpoint`) with its config.json beside the steps;
    returns a one-line summary (resharding_example.py, slim_model.py)."""
    step_dir, _, out_cfg = _write_with_config(source, cfg, output, cores_per_replica=cores_per_replica, dtype=dtype,
                                              slim=slim)
    return f"wrote {step_dir} (cores_per_replica {out_cfg['cores_per_replica']})"


def import_hf(hf_dir: str, output: str, *, cores_per_replica: int = 1, dtype: Any = None) -> str:
    """An HF GPT-J directory as our slim checkpoint (step 0) with its config.json, for `cores_per_replica`; returns a
    one-line summary (from_hf_weights.py)."""
    if detect_format(hf_dir) != HF:
        raise FileNotFoundError(f"{hf_dir} is not an HF directory (config.json + safetensors)")
    cfg = source_config(hf_dir, cores_per_replica=cores_per_replica)
    step_dir, config_path, _ = _write_with_config(hf_dir, cfg, output, dtype=dtype, slim=True)
    return f"wrote {step_dir} and {config_path}"
