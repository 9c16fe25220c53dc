"""safetensors directories read and written one tensor at a time: numpy only, bfloat16 included, local or gs://.

The format is an 8-byte little-endian header length, a JSON header (name -> dtype, shape, data_offsets), then the raw
little-endian tensor bytes. The `safetensors` package's numpy API has no bfloat16 and needs every tensor of a file in
memory at once; since every shape is known before a file is started, we write the header first and stream the data.
A model split over several files gets `model.safetensors.index.json` with a weight_map, as transformers expects.
"""
from __future__ import annotations

import json
from collections.abc import Iterator
from typing import IO

import ml_dtypes
import numpy as np

from mesh_transformer import storage

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
_DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16, "I64": np.int64,
           "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_}
_CODES = {np.dtype(dtype): code for code, dtype in _DTYPES.items()}
_HEADER_ALIGN = 8  # the reference writer pads the header so tensor data starts 8-byte aligned

Entry = tuple[str, tuple[int, ...], np.dtype]  # name, shape, dtype


def _nbytes(entry: Entry) -> int:
    _, shape, dtype = entry
    return int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize


def plan_files(entries: list[Entry], max_file_bytes: int) -> list[list[Entry]]:
    """Consecutive tensors grouped into files of at most `max_file_bytes` (a bigger tensor gets a file of its own)."""
    groups: list[list[Entry]] = [[]]
    size = 0
    for entry in entries:
        if groups[-1] and size + _nbytes(entry) > max_file_bytes:
            groups.append([])
            size = 0
        groups[-1].append(entry)
        size += _nbytes(entry)
    return groups


def _header_bytes(group: list[Entry]) -> bytes:
    header: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    for entry in group:
        name, shape, dtype = entry
        header[name] = {"dtype": _CODES[np.dtype(dtype)], "shape": list(shape),
                        "data_offsets": [offset, offset + _nbytes(entry)]}
        offset += _nbytes(entry)
    data = json.dumps(header, separators=(",", ":")).encode()
    return data + b" " * (-len(data) % _HEADER_ALIGN)


def write_dir(directory: str, entries: list[Entry], arrays: Iterator[tuple[str, np.ndarray]],
              max_file_bytes: int, single_file: str = SINGLE_FILE) -> list[str]:
    """Writes `arrays` (arriving in `entries` order, one at a time) as safetensors files; returns the file names."""
    groups = plan_files(entries, max_file_bytes)
    names = [single_file] if len(groups) == 1 else [f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
                                                    for i in range(len(groups))]
    weight_map = {}
    for file_name, group in zip(names, groups):
        header = _header_bytes(group)
        with storage.open_file(storage.join(directory, file_name), "wb") as f:
            f.write(len(header).to_bytes(8, "little"))
            f.write(header)
            for name, shape, dtype in group:
                got_name, array = next(arrays)
                if got_name != name or tuple(array.shape) != tuple(shape) or array.dtype != dtype:
                    raise ValueError(f"expected tensor {name} {tuple(shape)} {dtype}, got {got_name} "
                                     f"{tuple(array.shape)} {array.dtype}")
                f.write(np.ascontiguousarray(array).reshape(-1).view(np.uint8).data)
                weight_map[name] = file_name
    if len(groups) > 1:
        index = {"metadata": {"total_size": sum(_nbytes(e) for e in entries)}, "weight_map": weight_map}
        storage.write_bytes_atomic(storage.join(directory, INDEX_FILE), json.dumps(index, indent=2).encode())
        names.append(INDEX_FILE)
    return names


def _read_header(f: IO) -> tuple[dict, int]:
    length = int.from_bytes(f.read(8), "little")
    header = json.loads(f.read(length))
    header.pop("__metadata__", None)
    return header, 8 + length


class DirReader:
    """The tensors of a safetensors directory (one file, or several with an index), read one at a time."""

    def __init__(self, directory: str, single_file: str = SINGLE_FILE):
        self.directory = directory
        index_path = storage.join(directory, INDEX_FILE)
        if storage.exists(index_path):
            weight_map = json.loads(storage.read_bytes(index_path))["weight_map"]
            files = sorted(set(weight_map.values()))
        elif storage.exists(storage.join(directory, single_file)):
            files = [single_file]
        else:
            raise FileNotFoundError(f"no {single_file} or {INDEX_FILE} in {directory}")
        self._handles: dict[str, IO] = {}
        self._tensors: dict[str, tuple[str, dict, int]] = {}  # name -> (file, header entry, data start)
        for file_name in files:
            path = storage.join(directory, file_name)
            try:
                handle = self._handles[file_name] = storage.open_file(path, "rb")
            except FileNotFoundError:
                raise FileNotFoundError(f"safetensors file {path} is missing") from None
            header, start = _read_header(handle)
            self._tensors.update((name, (file_name, entry, start)) for name, entry in header.items())

    def __contains__(self, name: str) -> bool:
        return name in self._tensors

    def names(self) -> list[str]:
        return list(self._tensors)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._tensors[name][1]["shape"])

    def read(self, name: str) -> np.ndarray:
        """One tensor; local files are memory-mapped, so only what is used is paged in."""
        file_name, entry, start = self._tensors[name]
        if entry["dtype"] not in _DTYPES:
            raise ValueError(f"tensor {name} has safetensors dtype {entry['dtype']}, which this reader lacks")
        dtype = np.dtype(_DTYPES[entry["dtype"]])  # safetensors is little-endian, as every host we run on
        begin, end = entry["data_offsets"]
        shape = tuple(entry["shape"])
        path = storage.join(self.directory, file_name)
        if not storage.is_gcs(path):
            return np.memmap(path, dtype, "r", offset=start + begin, shape=shape)
        handle = self._handles[file_name]
        handle.seek(start + begin)
        return np.frombuffer(handle.read(end - begin), dtype).reshape(shape)

    def close(self) -> None:
        for handle in self._handles.values():
            handle.close()
        self._handles.clear()
