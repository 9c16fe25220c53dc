"""Where a fine-tune starts: the params of --tune-model-path (any format) straight into the train state's placement,
and for LoRA the frozen base model with its identity, so that a resume finds it and a different base is refused.

A base's identity is its path, format and step, a hash of its param shapes and a fingerprint of its weights: a few
values of every param (a strided sample, the same on any mesh), rounded to bfloat16 so that a base held in float32
and the same base held in bfloat16 are one base.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os

import jax
import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

from mesh_transformer.config import ConfigError
from mesh_transformer.model import gptj, lora, table
from mesh_transformer.parallel.layout import Layout
from mesh_transformer import storage
from mesh_transformer.store import adapters, checkpoint, convert, placing

log = logging.getLogger(__name__)
SAMPLES_PER_DIM = 4
BASE_KEY = adapters.BASE_KEY  # where a LoRA run's checkpoint metadata keeps the base's identity


def _sample(x: jax.Array) -> jax.Array:
    """About SAMPLES_PER_DIM values along each dim of x (every max(1, n // SAMPLES_PER_DIM)-th), as bfloat16 rounds
    them. One gather of those values alone: XLA:TPU stages a strided slice's whole operand in the core's 128 MiB
    VMEM, which GPT-J-6B's embedding (812 MiB) does not fit."""
    index = np.ix_(*(np.arange(0, n, max(1, n // SAMPLES_PER_DIM)) for n in x.shape))
    return x[index].astype(jnp.bfloat16).astype(jnp.float32)


def fingerprint_fn(replicated: jax.sharding.Sharding):
    """The jitted program of `fingerprint`: params -> their samples, replicated (the fit check compiles it too)."""
    return jax.jit(lambda p: jax.tree.map(_sample, p), out_shardings=replicated)


def fingerprint(params: dict, replicated: jax.sharding.Sharding) -> str:
    """sha256 of a strided sample of every param: equal for equal weights on any mesh and in f32 or bf16."""
    samples = fingerprint_fn(replicated)(params)  # on every process
    flat = jax.tree_util.tree_flatten_with_path(samples)[0]
    digest = hashlib.sha256()
    for path, sample in flat:
        digest.update(jax.tree_util.keystr(path).encode())
        digest.update(np.asarray(jax.device_get(sample), np.float32).tobytes())
    return digest.hexdigest()[:32]


def _shapes_hash(params: dict) -> str:
    flat = jax.tree_util.tree_flatten_with_path(params)[0]
    shapes = [(jax.tree_util.keystr(path), list(x.shape)) for path, x in flat]
    return hashlib.sha256(json.dumps(shapes).encode()).hexdigest()[:32]


def tuned_params(layout: Layout, path: str) -> dict:
    """The params of a checkpoint of any format, in the train state's placement and the master dtype (float32)."""
    if adapters.run_metadata(path) is not None:
        raise ConfigError(f"--tune-model-path {path} is a LoRA run: export it merged (to_hf_weights.py) and tune that")
    log.info("fine-tuning from %s with a fresh schedule and optimizer state", path)
    return convert.load_params(layout, path, gptj.precision(layout.cfg).params)


def load_base(layout: Layout, path: str) -> tuple[dict, dict]:
    """The frozen base of a LoRA run, placed as the Layout places params, in cfg.base_dtype; and its identity."""
    if adapters.run_metadata(path) is not None:
        raise ConfigError(f"the LoRA base {path} is itself a LoRA run: export it merged (to_hf_weights.py) first")
    params = (_int8_base(layout, path) if layout.cfg.base_dtype == "int8"
              else convert.load_params(layout, path, gptj.precision(layout.cfg).frozen))
    fmt = convert.detect_format(path)
    step = checkpoint.find_step(path)[1] if fmt == convert.CHECKPOINT else None
    if not storage.is_gcs(path):
        path = os.path.abspath(path)
    identity = {"path": path, "format": fmt, "step": step, "shapes": _shapes_hash(params),
                "fingerprint": fingerprint(params, layout.replicated)}
    log.info("LoRA base %s (%s, step %s, fingerprint %s) held in %s", path, fmt, step, identity["fingerprint"],
             layout.cfg.base_dtype)
    return params, identity


def _int8_base(layout: Layout, source: str) -> dict:
    """An int8 LoRA base from a checkpoint of any format: as `convert.load_params` places params (the rest in bf16),
    but each layer's matrices quantized on the host as they are read, one layer at a time, and placed in int8 with
    their scales under params["layers"][lora.SCALES] (`lora.base_axes`): no device holds a float copy of them."""
    cfg, dtype = layout.cfg, gptj.precision(layout.cfg).frozen
    abstract = lora.base_dtypes(cfg, layout.abstract(lora.base_axes(cfg), dtype))
    matrices = {("layers", *path): target for target, path in lora.base_matrices(cfg).items()}
    params: dict = {}
    with convert.open_params(source, cfg) as reader:
        for path, like in tqdm(table.param_paths(cfg), desc="loading params", unit="array", leave=False):
            target = table.get_path(abstract, path)
            if path in matrices:
                scales = []

                def quantized(i, p=path, scales=scales):
                    q, scale = lora.quantize_matrix(np.asarray(reader.read(p, i), np.float32))
                    scales.append(scale)
                    return q

                array = placing.put_layers(like.shape, np.int8, target.sharding, quantized)
                where = ("layers", lora.SCALES, matrices[path])
                scales_LxN = placing.put_host(np.stack(scales), table.get_path(abstract, where).sharding)
                table.set_path(params, where, scales_LxN)
            elif path[0] == "layers":
                array = placing.put_layers(like.shape, dtype, target.sharding, lambda i, p=path: reader.read(p, i))
            else:
                array = placing.put_host(convert.read_array(reader, path, like.shape, dtype), target.sharding)
            table.set_path(params, path, array)
    return params


def check_base(saved: dict, identity: dict) -> None:
    """A resumed LoRA run must have the base it was trained on: same shapes and weights (wherever it now lies)."""
    for key, what in (("shapes", "param shapes (another config)"), ("fingerprint", "weights")):
        if saved.get(key) != identity[key]:
            raise ConfigError(f"LoRA base {identity['path']} differs from the one this run was trained on "
                              f"({saved.get('path')}): other {what}; give that base with --tune-model-path")
