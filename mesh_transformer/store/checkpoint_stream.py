"""Our checkpoint format written and read one host array at a time, for converters that never hold a whole model.

`StreamingWriter` lays a global numpy array out in the pieces a mesh layout would give it (a PartitionSpec over named
axis sizes, e.g. {'mp': 8}), streaming each piece file as slices along the first axis arrive (one layer at a time), then
writes the index and the commit record of checkpoint_format.py as a `checkpoint.Checkpointer` does, so
`checkpoint.restore` reads the result onto any mesh. `LeafReader` reads whole leaves, or slices of them, from a
committed checkpoint.
"""
from __future__ import annotations

import itertools
import json
import math
from collections.abc import Iterable, Mapping
from typing import Any

import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec

from mesh_transformer.store import checkpoint_format as fmt
from mesh_transformer import storage
from mesh_transformer.store.checkpoint_format import Box, step_dir


def piece_boxes(shape: tuple[int, ...], spec: PartitionSpec | None, axis_sizes: Mapping[str, int]) -> list[Box]:
    """The distinct pieces a leaf of `shape` splits into when placed with `spec` on a mesh of `axis_sizes`."""
    if not shape:
        return [((), ())]
    per_dim = []
    for dim, size in enumerate(shape):
        entry = spec[dim] if spec is not None and dim < len(spec) else None
        names = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
        parts = math.prod(axis_sizes.get(name, 1) for name in names)
        if size % parts:
            raise ValueError(f"dimension {dim} of shape {shape} does not split into {parts} pieces ({spec})")
        step = size // parts
        per_dim.append([(i * step, (i + 1) * step) for i in range(parts)])
    return [(tuple(a for a, _ in combo), tuple(b for _, b in combo)) for combo in itertools.product(*per_dim)]


def _raw_bytes(array: np.ndarray) -> memoryview:
    # Byte view of the C-ordered data: memoryview can't describe bfloat16 & co. itself.
    return np.ascontiguousarray(array).reshape(-1).view(np.uint8).data


class StreamingWriter:
    """Writes checkpoint `step` under `root` leaf by leaf; nothing is visible until `commit()`."""

    def __init__(self, root: str, step: int, metadata: dict | None = None,
                 axis_sizes: Mapping[str, int] | None = None):
        if fmt.is_committed(root, step):
            raise FileExistsError(f"{step_dir(root, step)} is already a committed checkpoint; choose another output")
        self._directory = step_dir(root, step)
        if storage.exists(self._directory):  # leftovers of an interrupted write of this step
            storage.remove_tree(self._directory)
        self._step = step
        self._metadata = json.loads(json.dumps(metadata or {}))
        self._axis_sizes = dict(axis_sizes or {})
        self._leaves: dict[str, dict] = {}

    @property
    def directory(self) -> str:
        return self._directory

    def add(self, path: str, array: Any, spec: PartitionSpec | None = None) -> None:
        """Writes one whole leaf: an array (split as `spec` places it) or a bool/int/float/str value."""
        if isinstance(array, fmt.VALUE_TYPES):
            self._new_leaf(path, {"value": array})
            return
        array = np.asarray(array)
        self.add_chunks(path, array.shape, array.dtype, [array], spec)

    def add_chunks(self, path: str, shape: tuple[int, ...], dtype: Any, chunks: Iterable[np.ndarray],
                   spec: PartitionSpec | None = None) -> None:
        """Writes a leaf arriving as consecutive slices along its first axis (e.g. one layer at a time), cast to dtype.

        Every piece file is open at once and gets each slice's part appended, so memory holds one slice.
        """
        shape, dtype = tuple(shape), np.dtype(dtype)
        stored = fmt.storable(np.empty(0, dtype)).dtype
        pieces, files = [], []
        try:
            for start, stop in piece_boxes(shape, spec, self._axis_sizes):
                name = fmt.piece_name(path, start, stop)
                f = storage.open_file(storage.join(self._directory, name), "wb")
                writer = fmt.HashingWriter(f)
                files.append(f)
                np.lib.format.write_array_header_1_0(writer, {
                    "descr": np.lib.format.dtype_to_descr(stored), "fortran_order": False,
                    "shape": tuple(b - a for a, b in zip(start, stop))})
                pieces.append((name, start, stop, writer))
            rows = self._write_chunks(path, shape, dtype, chunks, pieces)
        finally:
            for f in files:
                f.close()
        if shape and rows != shape[0]:
            raise ValueError(f"leaf '{path}' got {rows} of its {shape[0]} rows")
        self._new_leaf(path, {"shape": list(shape), "dtype": dtype.name,
                              "pieces": [fmt.piece_entry(*piece) for piece in pieces]})

    @staticmethod
    def _write_chunks(path: str, shape: tuple[int, ...], dtype: np.dtype, chunks: Iterable[np.ndarray],
                      pieces: list) -> int:
        done = 0
        for chunk in chunks:
            chunk = np.asarray(chunk)
            if not shape:
                pieces[0][3].write(_raw_bytes(fmt.storable(chunk.astype(dtype))))
                continue
            if chunk.shape[1:] != shape[1:] or done + chunk.shape[0] > shape[0]:
                raise ValueError(f"leaf '{path}' of shape {shape} got a slice of shape {chunk.shape} after {done} rows")
            for _, start, stop, writer in pieces:
                lo, hi = max(start[0], done), min(stop[0], done + chunk.shape[0])
                if lo < hi:
                    part = chunk[(slice(lo - done, hi - done), *(slice(a, b) for a, b in zip(start[1:], stop[1:])))]
                    writer.write(_raw_bytes(fmt.storable(part.astype(dtype, copy=False))))
            done += chunk.shape[0]
        return done

    def _new_leaf(self, path: str, entry: dict) -> None:
        if path in self._leaves:
            raise ValueError(f"leaf '{path}' was written twice")
        self._leaves[path] = entry

    def commit(self) -> None:
        """Writes the index, then the commit record that makes the step visible."""
        fmt.write_index(self._directory, self._step, 0, self._leaves, self._metadata)
        fmt.write_commit(self._directory, self._step, 1)


class LeafReader:
    """Reads leaves of one committed checkpoint, whole or sliced, into host memory; checksums checked on first read."""

    def __init__(self, root: str, step: int):
        self.root, self.step = root, step
        self.leaves, self.metadata = fmt.read_index(root, step)
        self._pieces = fmt.PieceReader(step_dir(root, step))
        self._current: str | None = None

    def shape(self, path: str) -> tuple[int, ...]:
        return tuple(self._entry(path)["shape"])

    def _entry(self, path: str) -> dict:
        if path not in self.leaves:
            raise KeyError(f"checkpoint {step_dir(self.root, self.step)} has no leaf '{path}'")
        return self.leaves[path]

    def read(self, path: str, index: tuple[slice, ...] = ()) -> Any:
        """A leaf (or its `index` slice, leading dimensions first) as a numpy array; a saved value as it is."""
        entry = self._entry(path)
        if "value" in entry:
            return entry["value"]
        if path != self._current:  # pieces stay mapped while one leaf is read slice by slice, then are let go
            self._pieces.forget()
            self._current = path
        full = tuple(index) + (slice(None),) * (len(entry["shape"]) - len(index))
        return self._pieces.read_slice(path, entry, full, jnp.dtype(entry["dtype"]))

    def close(self) -> None:
        self._pieces.close()

    def read_mapped(self, path: str) -> np.ndarray | None:
        """A whole leaf as its read-only file mapping where one local piece holds it (`PieceReader.mapped`), else
        None."""
        entry = self._entry(path)
        return None if "value" in entry else self._pieces.mapped(path, entry)
