"""Params for inference: the Layout the decode programs run on, a checkpoint read onto it, and the params placed for
decoding (compute dtype, layers unstacked, each layer's projections joined).

The decode programs are the Megatron ones (model layers under shard_map over ('dp', 'mp')) whatever layout the
params were trained with: checkpoints hold global arrays, so any mesh reads any checkpoint.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import math
from collections.abc import Sequence
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from tqdm import tqdm

from mesh_transformer.config import Config, ConfigError, model_parallel_widths
from mesh_transformer.model import fused, gptj, lora, lora_slots, quant, table
from mesh_transformer.parallel.layout import SHARD_MAP, Layout, make_layout
from mesh_transformer.parallel.mesh import DP, MP, make_mesh
from mesh_transformer.store import convert, placing, readahead
from mesh_transformer.store.adapters import taken_apart

log = logging.getLogger(__name__)


def choose_mp(cfg: Config, n_devices: int, mp: int | None = None) -> int:
    """The model-parallel width of inference on n_devices: `mp` when given (it must divide the devices, n_heads and
    n_vocab); else the config's cores_per_replica where that divides them, else the largest width that does."""
    widths = model_parallel_widths(cfg, n_devices)
    if mp is not None:
        if mp not in widths:
            raise ConfigError(f"--mp {mp} must be at least 1 and divide the device count ({n_devices}), n_heads "
                              f"({cfg.n_heads}) and n_vocab ({cfg.n_vocab})")
        return mp
    return cfg.cores_per_replica if cfg.cores_per_replica in widths else widths[-1]


def make_inference_layout(cfg: Config, devices: Sequence[jax.Device] | None = None, mesh: Mesh | None = None,
                          mp: int | None = None) -> Layout:
    """The shard_map Layout the decode programs run on: on `mesh`, else over the devices (by default all) with the
    model-parallel width `choose_mp` gives and the rest data parallel, whatever layout the params were trained in."""
    cfg = dataclasses.replace(cfg, parallelism=SHARD_MAP)
    if mesh is None:
        devices = list(jax.devices() if devices is None else devices)
        width = choose_mp(cfg, len(devices), mp)
        cfg = dataclasses.replace(cfg, cores_per_replica=width)
        mesh = make_mesh({DP: len(devices) // width, MP: width}, devices)
        log.info("inference mesh: dp %d x mp %d over %d %s devices", len(devices) // width, width, len(devices),
                 devices[0].platform)
    if cfg.kv_heads % mesh.shape[MP]:  # the caches and kernels hold a device's own key heads
        raise ConfigError(f"inference splits the key heads over the model-parallel width: n_kv_heads "
                          f"({cfg.kv_heads}) must be divisible by mp ({mesh.shape[MP]})")
    return make_layout(cfg, mesh=mesh)


def load_params(layout: Layout, ckpt_path: str | None = None) -> dict:
    """The params (never the optimizer state) of a checkpoint of any format, placed by the Layout, in the compute
    dtype. `ckpt_path` is one of our checkpoints (a root, whose latest committed step is read, or a step directory),
    an original mesh-transformer-jax checkpoint or an HF GPT-J directory; None means cfg.model_path. A checkpoint
    whose shapes differ from the config is a ConfigError (a ValueError); no checkpoint there, FileNotFoundError."""
    return convert.load_params(layout, ckpt_path or layout.cfg.model_path)


def _placed(x: Any, sharding: NamedSharding, dtype: Any) -> jax.Array:
    """One param leaf on its shards in `dtype`; no copy when it is already there (a 6B model has no room for two)."""
    if not isinstance(x, jax.Array):
        return jax.device_put(np.asarray(x, dtype), sharding)  # each device receives only its slice
    if not x.sharding.is_equivalent_to(sharding, x.ndim):
        x = jax.device_put(x, sharding)
    return x if x.dtype == dtype else x.astype(dtype)


def is_placed(params: dict) -> bool:
    """Whether a param tree is already in the decode programs' form (`place_params` or `read_params` made it)."""
    return isinstance(params["layers"], list) and "fused" in params["layers"][0]


# Made once per shape and placement: a jit made afresh on every call would compile again (each eval in training).
@functools.cache
def _splitter(n_layers: int, one: NamedSharding):
    """A stacked leaf [L, ...] -> L leaves, each placed by `one`."""
    return jax.jit(lambda s: [s[i] for i in range(n_layers)], out_shardings=[one] * n_layers)


def _in_dtype(tree: Any, dtype: Any, adapters: dict | None = None, lora_scale: float = 0.0) -> Any:
    """Every float leaf of a tree in `dtype` (int8 weights as they are), the `adapters` merged first (in f32)."""
    tree = lora.merge_layers(tree, adapters, lora_scale, dtype) if adapters else tree
    return jax.tree.map(lambda x: x if x.dtype == jnp.int8 else x.astype(dtype), tree)


@functools.cache
def _amax_of(dtype: Any, replicated: NamedSharding, lora_scale: float = 0.0):
    """(a layer's parts, or an LM head, in any float dtype[, the layer's adapters]) -> the largest magnitudes per
    output of its scale groups (`quant.group_amax`; a head: its kernel's), computed in `dtype` on the devices after
    the adapters are merged, replicated."""
    def amax(tree, adapters=None):
        tree = _in_dtype(tree, dtype, adapters, lora_scale)
        return quant.group_amax(tree, jnp) if "kernel" not in tree else quant.amax(tree["kernel"], jnp)

    return jax.jit(amax, out_shardings=replicated)


def _host_scales(peaks: Any) -> tuple[Any, Any]:
    """(scales, their inverses) of per-output magnitudes fetched from the devices, computed by numpy as the host
    path computes them, so the devices quantize to the same int8 values."""
    scales = jax.tree.map(lambda peak: quant.scale_of(np.asarray(peak)), peaks)
    return scales, jax.tree.map(quant.inverse, scales)


@functools.cache
def _fuser(mesh: Mesh, spec_leaves: tuple, spec_tree: Any, lora_scale: float, int8: bool, dtype: Any):
    """(one layer in any float dtype, its adapters' slices or None[, its groups' scales where the layer is int8
    already]) -> `join_layer` of the merged layer in `dtype` on `mesh`, placed by the decode specs (given
    flattened, to be hashable)."""
    specs = jax.tree.unflatten(spec_tree, spec_leaves)

    def fuse(layer, adapters, scales=None, inverses=None):
        layer = _in_dtype(layer, dtype, adapters, lora_scale)
        if inverses is not None:  # scales from the host (`_host_scales`): quantized here as the host would
            layer, _ = quant.quantize_layer(layer, jnp, scales, inverses)
        return join_layer(layer, mesh.shape[MP], int8, jnp, scales)

    return jax.jit(fuse, out_shardings=jax.tree.map(partial(NamedSharding, mesh), specs,
                                                    is_leaf=lambda x: isinstance(x, P)))


def join_layer(layer: dict, tp_size: int, int8: bool, xp=jnp, scales: dict | None = None) -> dict:
    """One layer of the param tree in the decode programs' form: its projections joined (`fused.fuse_layer`), with
    `int8` quantized first (`quant.quantize_layer`; an int8 layer read from a checkpoint comes with its `scales`)."""
    if int8 and scales is None:
        layer, scales = quant.quantize_layer(layer, xp)
    return fused.fuse_layer(layer, tp_size, xp, scales if int8 else None)


def place_params(params: dict, layout: Layout, adapters: dict | None = None) -> dict:
    """The params for the decode programs: on their shards, in the compute dtype, layers unstacked into a list,
    each layer's projections joined (`fused.fuse_layer`), in int8 where the config's weight_dtype says. A tree
    already in that form is returned as it is. LoRA adapters (a LoRA run's, beside its base) are merged into each
    layer's weights before it is joined.

    A stacked leaf is placed and split before the next one is touched, and a layer is joined before the next, so
    the device holds little besides the result and the caller's tree.
    """
    if is_placed(params):
        return params
    cfg, mesh = layout.cfg, layout.mesh
    precision = gptj.precision(cfg)
    shardings = layout.param_shardings()
    placed = jax.tree.map(partial(_placed, dtype=precision.compute), {k: v for k, v in params.items() if k != "layers"},
                          {k: v for k, v in shardings.items() if k != "layers"})
    if precision.int8_head:  # the scales from the host, as `read_params` quantizes: the same int8 values
        head_shardings = jax.tree.map(partial(NamedSharding, mesh), layout.placed_specs()["lm_head"],
                                      is_leaf=lambda x: isinstance(x, P))
        scale, inv = _host_scales(_amax_of(precision.compute, layout.replicated)(placed["lm_head"]))
        placed["lm_head"] = _head_quantizer(head_shardings, precision.compute)(placed["lm_head"], scale, inv)
    layer_shardings = iter(jax.tree.leaves(shardings["layers"]))
    adapters = jax.device_get(adapters)  # small: on the host, off the training mesh
    if adapters and not cfg.lora_rank:
        raise ConfigError("LoRA adapters were given but the config has no lora_rank")

    def split(x):
        sharding = next(layer_shardings)
        return _splitter(cfg.layers, NamedSharding(mesh, P(*sharding.spec[1:])))(_placed(x, sharding,
                                                                                          precision.compute))

    unstacked_params = table.unstack_layers({**placed, "layers": params["layers"]}, split)
    spec_leaves, spec_tree = jax.tree.flatten(layout.placed_specs(slots=False)["layers"][0],
                                              is_leaf=lambda x: isinstance(x, P))
    lora_scale = lora.scale(cfg) if adapters else 0.0
    fuse = _fuser(mesh, tuple(spec_leaves), spec_tree, lora_scale, precision.int8, precision.compute)
    amax = _amax_of(precision.compute, layout.replicated, lora_scale)

    def fuse_one(layer, layer_adapters):
        if not precision.int8:
            return fuse(layer, layer_adapters)
        return fuse(layer, layer_adapters, *_host_scales(amax(layer, layer_adapters)))  # as `read_params` does

    layer_list = unstacked_params.pop("layers")
    layer_adapters = table.unstack_layers({"layers": adapters})["layers"] if adapters else [None] * cfg.layers
    return {**unstacked_params, "layers": [fuse_one(layer_list.pop(0), ab) for ab in layer_adapters]}


def abstract_params(layout: Layout) -> dict:
    """The decode programs' params (joined per layer, in the compute dtype, int8 where the config says) as sharded
    ShapeDtypeStructs: what `read_params` and `place_params` give, for compiling before any weights exist."""
    precision = gptj.precision(layout.cfg)
    shapes = table.param_shapes(layout.cfg, precision.compute)
    layer = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape[1:], s.dtype), shapes["layers"])
    fused = jax.eval_shape(partial(join_layer, tp_size=layout.mesh.shape[MP], int8=precision.int8), layer)
    if precision.int8_head:
        shapes = {**shapes, "lm_head": jax.eval_shape(partial(quant.quantize_head, xp=jnp), shapes["lm_head"])}
    if layout.cfg.max_loras:  # the served adapters' slots (infer/adapter_slots.py)
        fused = {**fused, "lora": lora_slots.slot_shapes(layout.cfg, precision.compute)}
    shardings = jax.tree.map(partial(NamedSharding, layout.mesh), layout.placed_specs(),
                             is_leaf=lambda x: isinstance(x, P))
    return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                        {**shapes, "layers": [fused] * layout.cfg.layers}, shardings)


def read_params(layout: Layout, source: str, lora: str | None = None) -> dict:
    """A checkpoint of any format read straight into the decode programs' form, one layer at a time. The device
    ends up holding one copy of the model; the host, the layers read ahead besides it (`readahead`: a thread reads
    the next few while one is placed, so reads, transfers and conversions overlap). LoRA adapters (a LoRA run as
    `source`, or `lora`: a LoRA run or a PEFT directory) are merged into each weight (W + A @ B * scale in f32,
    `lora.merge_layers`); with int8 weights (the config's weight_dtype), each layer is quantized, or read as int8
    from an int8 checkpoint (`slim_model.py --dtype int8`), which holds the same numbers.

    Where the layer is merged, joined, converted and quantized is the platform policy's (`host_loading`): on the CPU,
    on the host (`_host_placer`, the merge by the reading thread; params placed from the file's mapping where they
    can be, `readahead.read_whole`); on an accelerator the host only reads, and each layer's parts and adapters go to
    the devices as stored, where programs made once per layer shape merge them, convert, quantize and join them
    (`_layer_placer`), not awaited before the next layer's parts are sent. Both give the same params bit for bit."""
    cfg = layout.cfg
    precision = gptj.precision(cfg)
    on_host = layout.policy.host_loading
    shardings = jax.tree.map(partial(NamedSharding, layout.mesh), layout.placed_specs(),
                             is_leaf=lambda x: isinstance(x, P))
    modules = [key for key in dict.fromkeys(path[0] for path, _ in table.param_paths(cfg)) if key != "layers"]
    with convert.open_params(source, cfg, lora=lora) as reader:
        reader, adapters, lora_scale = taken_apart(reader)
        read_int8 = getattr(reader, "read_int8", None) if precision.int8 and adapters is None else None
        layer_dtype = precision.compute if on_host and adapters is None else None  # else as stored

        def read_layer(i: int) -> tuple[dict, dict | None, dict | None]:
            layer, scales = readahead.read_layer(reader, read_int8, cfg, i, layer_dtype)
            layer_adapters = None if adapters is None else jax.tree.map(lambda x: x[i], adapters)
            if on_host and layer_adapters is not None:  # merged here, in the reading thread, beside the joins
                merged = _merger(precision.compute, lora_scale)(layer, layer_adapters)
                return jax.tree.map(np.asarray, merged), scales, None
            return layer, scales, layer_adapters

        reads = [partial(readahead.read_module, reader, cfg, key, precision.compute if on_host else None)
                 for key in modules] + [partial(read_layer, i) for i in range(cfg.layers)]
        with contextlib.closing(readahead.read_ahead(reads, readahead.depth(cfg, precision.compute))) as read:
            params = {key: _place_module(next(read), shardings[key], precision.compute,
                                         key == "lm_head" and precision.int8_head, on_host, layout) for key in modules}
            place = _host_placer(layout) if on_host else _layer_placer(layout, lora_scale)
            layers: list = []
            for _ in tqdm(range(cfg.layers), desc="loading layers", unit="layer", leave=False):
                layers.append(place(*next(read)))
                jax.block_until_ready(layers[-2:-1])  # the layer before: one layer's parts on the devices in flight
    params["layers"] = jax.block_until_ready(layers)
    return params


def _place_module(module: dict, shardings: dict, dtype: np.dtype, int8_head: bool, on_host: bool,
                  layout: Layout) -> dict:
    """A module outside the layers (embedding, ln_f, head) placed in `dtype`, the head quantized where `int8_head`:
    on the host (`on_host`), else on the devices as read, converted (and quantized) there."""
    if on_host:
        module = quant.quantize_head(module) if int8_head else module
        return jax.block_until_ready(jax.device_put(module, shardings))
    placed = _put(module, {name: shardings[name] for name in module})
    if int8_head:
        scale, inv = _host_scales(_amax_of(dtype, layout.replicated)(placed))
        return jax.block_until_ready(_head_quantizer(shardings, dtype)(placed, scale, inv))
    return jax.block_until_ready(jax.tree.map(lambda x: x.astype(dtype), placed))


@functools.cache
def _head_quantizer_cached(spec_leaves: tuple, spec_tree: Any, dtype: Any):
    shardings = jax.tree.unflatten(spec_tree, spec_leaves)
    return jax.jit(lambda head, scale, inv: quant.quantize_head(_in_dtype(head, dtype), jnp, scale, inv),
                   out_shardings=shardings)


def _head_quantizer(shardings: dict, dtype: Any):
    """(the LM head in any float dtype, its scales, their inverses) -> the head in `dtype` with its kernel
    quantized (`quant.quantize_head`), on the devices."""
    leaves, tree = jax.tree.flatten(shardings)
    return _head_quantizer_cached(tuple(leaves), tree, dtype)


def _put(tree: Any, shardings: Any) -> Any:
    """A tree of host arrays on the devices by `shardings` (`placing.put_host`)."""
    return jax.tree.map(placing.put_host, tree, shardings)


def _layer_placer(layout: Layout, lora_scale: float):
    """(layer as stored (int8 with its scales from an int8 checkpoint), scales or None, its adapters' slices or
    None) -> the layer's parts put on the devices as the training layout splits them (the adapters replicated),
    merged there (`_merger`), then converted, quantized and joined by one program (`_fuser`; the scales of a
    quantization from the host, `_host_scales`), not awaited. The shardings and programs are made once."""
    precision = gptj.precision(layout.cfg)
    part_shardings = jax.tree.map(lambda s: NamedSharding(layout.mesh, P(*s.spec[1:])),
                                  layout.param_shardings()["layers"])
    spec_leaves, spec_tree = jax.tree.flatten(layout.placed_specs(slots=False)["layers"][0],
                                              is_leaf=lambda x: isinstance(x, P))
    fuse = _fuser(layout.mesh, tuple(spec_leaves), spec_tree, 0.0, precision.int8, precision.compute)
    amax = _amax_of(precision.compute, layout.replicated)

    def place(layer: dict, scales: dict | None, layer_adapters: dict | None) -> dict:
        parts = _put(layer, part_shardings)
        if layer_adapters is not None:
            parts = _merger(precision.compute, lora_scale)(parts, jax.device_put(layer_adapters, layout.replicated))
        inverses = None
        if precision.int8 and scales is None:  # quantized here, from scales the host computes as it would
            scales, inverses = _host_scales(amax(parts))
        return fuse(parts, None, scales, inverses)

    return place


def _host_placer(layout: Layout):
    """(layer in the compute dtype (int8 with its scales from an int8 checkpoint), scales or None, None: merged as
    read) -> the layer joined on the host and placed (`_place_layer`)."""
    precision = gptj.precision(layout.cfg)
    shardings = jax.tree.map(partial(NamedSharding, layout.mesh), layout.placed_specs(slots=False)["layers"][0],
                             is_leaf=lambda x: isinstance(x, P))
    return lambda layer, scales, _: _place_layer(layer, scales, dtype=precision.compute,
                                                 tp_size=layout.mesh.shape[MP], int8=precision.int8,
                                                 shardings=shardings)


@functools.cache
def _merger(dtype: Any, lora_scale: float):
    """(one layer's parts as stored, its adapters' slices) -> the layer merged and in `dtype` (`_in_dtype`), where
    the parts are: the one program both paths merge a layer by (the host's, on the host's device)."""
    return jax.jit(lambda layer, adapters: _in_dtype(layer, dtype, adapters, lora_scale))


def _place_layer(layer: dict, scales: dict | None, *, dtype: np.dtype, tp_size: int, int8: bool,
                 shardings: dict) -> dict:
    """A layer (in `dtype`, or int8 with its `scales`) joined and placed one half at a time (`fused.fuse_inputs`:
    q, k, v, fc_in and the norms; then `fuse_outputs`: out and fc_out), each half quantized on the host where `int8`
    and the checkpoint holds floats. Besides the layer, the host holds one half's joined copy at most (GPT-J-6B in
    bf16: 235 MB), each half's parts freed once it is joined."""
    placed: dict = {"fused": {}}
    halves = _halves(layer)
    del layer
    for fuse in (fused.fuse_inputs, fused.fuse_outputs):
        half, half_scales = halves.pop(0), scales
        if int8 and scales is None:
            half, half_scales = quant.quantize_layer(half, np)
        for norm in ("ln_1", "ln_2"):
            if norm in half:
                placed[norm] = jax.device_put(half[norm], shardings[norm])
        joined = fuse(half, tp_size, np, half_scales if int8 else None, concatenate=join_on_host)
        del half  # its parts, before the devices take the joined half
        while joined:  # each host array freed once the devices hold it
            name, x = joined.popitem()
            placed["fused"][name] = jax.block_until_ready(jax.device_put(x, shardings["fused"][name]))
    return placed


def aligned_empty(shape: tuple, dtype: Any, alignment: int = 64) -> np.ndarray:
    """An uninitialized host array whose data starts on an `alignment`-byte boundary. JAX's CPU client takes such
    an array as a device buffer as it is (`device_put` copies nothing), so a joined matrix built in one is placed
    without a second copy beside it (GPT-J-6B bf16: a layer's 235 MB input half); elsewhere it is an array."""
    size = math.prod(shape) * np.dtype(dtype).itemsize
    raw = np.empty(size + alignment, np.uint8)
    start = -raw.ctypes.data % alignment
    return raw[start:start + size].view(dtype).reshape(shape)


def join_on_host(parts: list, axis: int) -> np.ndarray:
    """np.concatenate into an `aligned_empty` array, each part copied by `_copy_part`."""
    shape = (*parts[0].shape[:axis], sum(p.shape[axis] for p in parts), *parts[0].shape[axis + 1:])
    out, start = aligned_empty(shape, parts[0].dtype), 0
    for part in parts:
        _copy_part(out[(slice(None),) * axis + (slice(start, start + part.shape[axis]),)], part)
        start += part.shape[axis]
    return out


COPY_CHUNK_BYTES = 16 << 20  # a transposed part is copied this many bytes at a time


def _copy_part(dst: np.ndarray, src: np.ndarray) -> None:
    """dst[...] = src, where src is one of the transposed views `fused.fuse_inputs` and `fuse_outputs` join:
    numpy copies those element by element across rows (GPT-J-6B's int8 fc_in: 0.64 s, 0.20 s in cache-sized
    tiles), while XLA's transpose on the host's CPU device is blocked and vectorized (0.02 s), so each chunk of rows
    is transposed there and copied in; plain numpy where JAX has no CPU device or src's rows are contiguous."""
    transpose = _host_transpose()
    if transpose is None or src.strides[-1] == src.itemsize:
        dst[...] = src
        return
    rows = max(1, COPY_CHUNK_BYTES // (src.shape[-1] * src.itemsize))
    for lead in np.ndindex(*src.shape[:-2]):
        for start in range(0, src.shape[-2], rows):
            dst[lead][start:start + rows] = transpose(src[lead][start:start + rows].T)


@functools.cache
def _host_transpose() -> Any:
    """numpy x -> x.T computed by XLA on this process's first CPU device, or None where JAX has no CPU backend."""
    try:
        cpu = jax.local_devices(backend="cpu")[0]
    except RuntimeError:
        return None
    transposed = jax.jit(lambda x: x.T)
    return lambda x: np.asarray(transposed(jax.device_put(x, cpu)))


_OUTPUTS = {("attn", "out"), ("attn", "out_bias"), ("mlp", "fc_out", "kernel"),
            ("mlp", "fc_out", "bias")}  # the rest: the inputs half


def _halves(layer: dict) -> list[dict]:
    """[the params of a layer that `fused.fuse_inputs` joins, those `fused.fuse_outputs` joins]."""
    halves: list[dict] = [{}, {}]
    for keys, x in jax.tree_util.tree_flatten_with_path(layer)[0]:
        path = tuple(key.key for key in keys)
        table.set_path(halves[path in _OUTPUTS], path, x)
    return halves
