"""A checkpoint of any format written as an HF directory of its model family (safetensors weights, config.json, the
tokenizer's files), one tensor at a time from `convert.open_params`."""
from __future__ import annotations

import json
import logging
import os
import tempfile
from collections.abc import Iterator
from typing import Any

import numpy as np
from tqdm import tqdm

from mesh_transformer import storage
from mesh_transformer.config import Config
from mesh_transformer.model import table
from mesh_transformer.store import hf, safetensors_io
from mesh_transformer.store.convert import open_params

log = logging.getLogger(__name__)


def write_hf(source: str, cfg: Config, output: str, *, dtype: Any = "fp16", max_shard_bytes: int = 5 * 10**9,
             tokenizer: str | None = None) -> list[str]:
    """Writes a checkpoint of any format as an HF directory of its family (safetensors, config.json, tokenizer
    files).

    Weights larger in total than `max_shard_bytes` are split over several files with an index. config.json comes
    last, so a directory from an interrupted export does not load. Returns the names of the files written.
    """
    dtype = table.dtype_named(dtype)
    layout = hf.hf_layout(cfg)
    entries = [(entry.name, entry.shape, dtype) for entry in layout]
    with open_params(source, cfg) as reader:
        def arrays() -> Iterator[tuple[str, np.ndarray]]:
            for entry in tqdm(layout, desc=f"writing {output}", unit="tensor"):
                parts = [reader.read(piece.path, entry.layer) for piece in entry.pieces]
                yield entry.name, hf.to_hf(parts, entry, cfg.n_heads).astype(dtype, copy=False)

        files = safetensors_io.write_dir(output, entries, arrays(), max_shard_bytes)
    files += _write_tokenizer(output, tokenizer or cfg.tokenizer)
    hf_config = {**hf.hf_config(cfg), "torch_dtype": dtype.name}
    storage.write_bytes_atomic(storage.join(output, "config.json"), json.dumps(hf_config, indent=2).encode())
    log.info("wrote HF directory %s (%d weight files)", output, len(files))
    return [*files, "config.json"]


def _write_tokenizer(output: str, name: str) -> list[str]:
    """The tokenizer's files (saved by transformers) copied into `output`, local or gs://."""
    from mesh_transformer.tokenizer import load_tokenizer

    with tempfile.TemporaryDirectory() as tmp:
        load_tokenizer(name).save_pretrained(tmp)
        names = sorted(os.listdir(tmp))
        for file_name in names:
            with open(os.path.join(tmp, file_name), "rb") as f:
                storage.write_bytes_atomic(storage.join(output, file_name), f.read())
    return names
