"""Our checkpoint format on disk: directory layout, index and commit record, piece files, reading them back verified.

Both writers (`checkpoint.Checkpointer` for a train state on devices, `checkpoint_stream.StreamingWriter` for
converters) and both readers (`checkpoint.restore`, `checkpoint_stream.LeafReader`) go through this module only.

One checkpoint is a directory per step under a root:
    {root}/step_{N}/arrays/{leaf/path}/{a0-b0_a1-b1_...}.npy   one piece per unique shard: the slice [a0:b0, a1:b1, ...]
                                                               of the leaf (scalar.npy for a 0-d leaf), written by the
                                                               process that owns it
    {root}/step_{N}/index_p{k}.json    process k's index
    {root}/step_{N}/COMMITTED          the commit record, written last by process 0 once every process has written;
                                       without it the step does not exist (and the next save deletes it)

A leaf path joins the keys from the tree's root with '/': dict keys, sequence indices, attribute names of
namedtuples (optax states), e.g. "params/layers/attn/q" or "opt_state/1/mu/embed/wte".

index_p{k}.json:
    {"format_version": 1, "step": N, "process_index": k,
     "metadata": {...} (user metadata: config, data state; process 0's index only, null in the others),
     "leaves": {leaf path: {"shape": [...], "dtype": "bfloat16",
                            "pieces": [{"file": "arrays/...npy", "start": [...], "stop": [...], "sha256": hex}]}
                        or {"value": a bool / int / float / str saved as it is}}}
    A leaf appears in every index; its pieces are those that process wrote (none in some). Merged, the pieces of a
    leaf cover it exactly once.
COMMITTED:
    {"format_version": 1, "step": N, "committed_unix_s": t, "index_files": ["index_p0.json", ...]}

Pieces are plain .npy files (never pickle). Dtypes numpy can't load without pickle (bfloat16 & co.) are stored as
unsigned ints of the same width and viewed back as the index's dtype on reading. Each piece's sha256 is checked the
first time it is read.
"""
from __future__ import annotations

import hashlib
import io
import json
import math
import os
import re
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import jax.numpy as jnp
import numpy as np

from mesh_transformer import storage
from mesh_transformer.store import npz

FORMAT_VERSION = 1
COMMIT_NAME = "COMMITTED"
VALUE_TYPES = (bool, int, float, str)  # leaves saved in the index as they are, not as arrays
_STEP_DIR = re.compile(r"^step_(\d+)$")
# Threads reading an array's pieces at once: a read from the page cache is a copy, so about one a core; at least a
# few for gs://, where each waits on the network.
READ_THREADS = min(16, max(4, os.cpu_count() or 1))

Box = tuple[tuple[int, ...], tuple[int, ...]]  # (start, stop) per dimension


class CorruptCheckpointError(OSError):
    """A committed checkpoint whose files are damaged or missing."""


class ChecksumError(CorruptCheckpointError):
    """A piece file whose sha256 differs from the one recorded in the index."""


class MissingPieceError(CorruptCheckpointError, FileNotFoundError):
    """A piece or index file named by a committed checkpoint that is not there."""


# ------------------------------------------------------------------------------------------------------------- names
def step_dir(root: str, step: int) -> str:
    return storage.join(root, f"step_{step}")


def parse_step_dir(name: str) -> int | None:
    """The step of a directory named step_N, else None."""
    match = _STEP_DIR.match(name)
    return int(match.group(1)) if match else None


def step_dirs(root: str) -> list[int]:
    """Steps of every step_N directory under `root`, committed or not, ascending."""
    return sorted(step for name in storage.listdir(root) if (step := parse_step_dir(name)) is not None)


def is_committed(root: str, step: int) -> bool:
    return storage.exists(storage.join(step_dir(root, step), COMMIT_NAME))


def _key_name(key: Any) -> str:
    for attr in ("key", "idx", "name"):  # DictKey, SequenceKey, GetAttrKey (namedtuples such as optax states)
        if hasattr(key, attr):
            return str(getattr(key, attr))
    return str(key)


def leaf_path(keypath: tuple) -> str:
    """The leaf path of a jax key path: its key names joined with '/'."""
    parts = [_key_name(k) for k in keypath]
    for part in parts:
        if not part or "/" in part or part in (".", ".."):
            raise ValueError(f"checkpoint leaf key {part!r} in {parts} can't name a file; use keys without '/'")
    return "/".join(parts)


def piece_name(leaf: str, start: tuple[int, ...], stop: tuple[int, ...]) -> str:
    """The file of a leaf's piece [start, stop), relative to the step directory."""
    return f"arrays/{leaf}/{'_'.join(f'{a}-{b}' for a, b in zip(start, stop)) or 'scalar'}.npy"


def bounds(index: tuple, shape: tuple[int, ...]) -> Box:
    """(start, stop) per dimension of a tuple of slices, as jax gives shard indices."""
    ranges = [s.indices(n)[:2] for s, n in zip(index, shape)]
    return tuple(a for a, _ in ranges), tuple(b for _, b in ranges)


# ----------------------------------------------------------------------------------------------------------- writing
def storable(array: np.ndarray) -> np.ndarray:
    """The array as it goes into a .npy file: dtypes .npy can't hold without pickle as same-width unsigned ints."""
    if np.dtype(array.dtype.str) != array.dtype:
        return array.view(f"u{array.dtype.itemsize}")
    return array


class HashingWriter:
    """Forwards writes to a file while hashing them, so a piece is hashed without reading it back."""

    def __init__(self, f: Any):
        self._f = f
        self.sha256 = hashlib.sha256()

    def write(self, data: bytes) -> int:
        self.sha256.update(data)
        return self._f.write(data)


def piece_entry(name: str, start: tuple[int, ...], stop: tuple[int, ...], writer: HashingWriter) -> dict:
    """The index entry of a piece file that `writer` has written in full."""
    return {"file": name, "start": list(start), "stop": list(stop), "sha256": writer.sha256.hexdigest()}


def write_piece(directory: str, leaf: str, start: tuple[int, ...], stop: tuple[int, ...], data: np.ndarray) -> dict:
    """Writes one piece of a leaf; returns its index entry."""
    name = piece_name(leaf, start, stop)
    with storage.open_file(storage.join(directory, name), "wb") as f:
        writer = HashingWriter(f)
        np.save(writer, storable(data), allow_pickle=False)
    return piece_entry(name, start, stop, writer)


def write_index(directory: str, step: int, process: int, leaves: dict[str, dict], metadata: dict | None) -> None:
    """Writes process `process`'s index file, once the pieces it names are written."""
    index = {"format_version": FORMAT_VERSION, "step": step, "process_index": process, "metadata": metadata,
             "leaves": leaves}
    storage.write_bytes_atomic(storage.join(directory, f"index_p{process}.json"), json.dumps(index).encode())


def write_commit(directory: str, step: int, process_count: int) -> None:
    """The commit record, written last: until it exists the step does not."""
    commit = {"format_version": FORMAT_VERSION, "step": step, "committed_unix_s": time.time(),
              "index_files": [f"index_p{k}.json" for k in range(process_count)]}
    storage.write_bytes_atomic(storage.join(directory, COMMIT_NAME), json.dumps(commit).encode())


# ----------------------------------------------------------------------------------------------------------- reading
def _read_json(path: str, what: str) -> dict:
    try:
        return json.loads(storage.read_bytes(path))
    except FileNotFoundError:
        raise MissingPieceError(f"{what} {path} is missing") from None


def read_commit(root: str, step: int) -> dict:
    """The commit record of a step; FileNotFoundError when the step is not committed."""
    path = storage.join(step_dir(root, step), COMMIT_NAME)
    try:
        commit = json.loads(storage.read_bytes(path))
    except FileNotFoundError:
        raise FileNotFoundError(f"no committed checkpoint for step {step} under {root}") from None
    if commit.get("format_version") != FORMAT_VERSION:
        raise ValueError(f"{path} has checkpoint format {commit.get('format_version')}; this code reads "
                         f"{FORMAT_VERSION}")
    return commit


def read_metadata(root: str, step: int) -> dict:
    """The user metadata (config, data-iterator state, ...) saved with a committed step."""
    commit = read_commit(root, step)
    return _read_json(storage.join(step_dir(root, step), commit["index_files"][0]), "checkpoint index")["metadata"]


def read_index(root: str, step: int) -> tuple[dict[str, dict], dict]:
    """Every process's index merged into one: (leaves by path, metadata)."""
    commit = read_commit(root, step)
    leaves: dict[str, dict] = {}
    metadata: dict = {}
    for name in commit["index_files"]:
        index = _read_json(storage.join(step_dir(root, step), name), "checkpoint index")
        if index["process_index"] == 0:
            metadata = index["metadata"]
        for path, entry in index["leaves"].items():
            leaves.setdefault(path, {**entry, "pieces": []})["pieces"] += entry.get("pieces", [])
    return leaves, metadata


def _sha256_file(path: str) -> str:
    """A file's sha256, streamed through one small buffer (hashlib's 256 KiB): READ_THREADS hash at once."""
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _read_into(region: np.ndarray, target: np.ndarray, leaf: str) -> bool:
    """Copy a mapped piece's region into `target` by reading its file, where the region is one run of bytes (a
    layer of a stacked leaf, a whole piece) and `target` one run too, in the same dtype; False where not. Copying
    through the mapping would page the region into this process as well, beside the copy (GPT-J-6B: a 134 MB fc_in
    layer twice)."""
    if (not isinstance(region, np.memmap) or region.dtype != target.dtype
            or not (region.flags.c_contiguous and target.flags.c_contiguous)):
        return False
    base = region
    while isinstance(base.base, np.memmap):
        base = base.base  # the array np.load mapped: its offset is the file's
    start = base.offset + region.ctypes.data - base.ctypes.data  # addresses only: no page is touched
    with open(base.filename, "rb") as f:
        f.seek(start)
        if f.readinto(target.reshape(-1).view(np.uint8)) != target.nbytes:
            raise CorruptCheckpointError(f"checkpoint piece {base.filename} of leaf '{leaf}' ends early")
    return True


class Threads:
    """READ_THREADS threads, started on first use, that read the pieces of one array at once (file reads, copies,
    hashes and CRCs release the GIL)."""

    def __init__(self, prefix: str = "piece-read"):
        self._prefix = prefix
        self._pool: ThreadPoolExecutor | None = None

    def map(self, fn: Callable[..., Any], items: Sequence[tuple]) -> list:
        """[fn(*item) for item in items], run at once where there are several; the first exception is raised."""
        if len(items) < 2:
            return [fn(*item) for item in items]
        if self._pool is None:
            self._pool = ThreadPoolExecutor(READ_THREADS, thread_name_prefix=self._prefix)
        return list(self._pool.map(lambda item: fn(*item), items))

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown()
            self._pool = None


class PieceReader:
    """Reads slices of leaves from the pieces of one step directory, checking each file's sha256 on first read."""

    def __init__(self, directory: str):
        self._directory = directory
        self._loaded: dict[str, np.ndarray] = {}
        # Local files already hashed: mapped again without hashing. A reader taking one layer of every stacked leaf
        # at a time (inference loading) would otherwise hash the whole checkpoint once per layer (6B: 12 s a layer).
        self._verified: set[str] = set()
        self._threads = Threads()

    def close(self) -> None:
        self._threads.close()

    def forget(self) -> None:
        """Drops loaded pieces; called after each leaf so memory holds one leaf's pieces at a time."""
        self._loaded.clear()

    def read_slice(self, leaf: str, entry: dict, index: tuple | None, dtype: Any) -> np.ndarray:
        """The `index` slice (None: all) of a leaf from the pieces that overlap it, cast to `dtype`."""
        shape = tuple(entry["shape"])
        start, stop = bounds((slice(None),) * len(shape) if index is None else index, shape)
        out = np.empty([b - a for a, b in zip(start, stop)], dtype)
        boxes = []
        for piece in entry["pieces"]:
            lo = [max(a, p) for a, p in zip(start, piece["start"])]
            hi = [min(b, p) for b, p in zip(stop, piece["stop"])]
            if all(low < high for low, high in zip(lo, hi)):
                boxes.append((piece, lo, hi))

        def copy(piece: dict, lo: list, hi: list) -> int:
            source = self._load(piece, leaf, entry["dtype"])
            target = out[tuple(slice(low - a, high - a) for low, high, a in zip(lo, hi, start)) or ...]  # a view
            region = source[tuple(slice(low - p, high - p) for low, high, p in zip(lo, hi, piece["start"]))]
            if not _read_into(region, target, leaf):
                target[...] = region
            return math.prod(high - low for low, high in zip(lo, hi))

        covered = sum(self._threads.map(copy, boxes))  # the pieces at once: hashed, read and copied in parallel
        if covered != out.size:
            raise CorruptCheckpointError(f"checkpoint pieces of leaf '{leaf}' cover {covered} of the {out.size} "
                                         f"elements in [{start}, {stop}); an index file lacks pieces")
        return out

    def mapped(self, leaf: str, entry: dict) -> np.ndarray | None:
        """A whole leaf held in one local piece, as its read-only mapping (checksum checked): only the pages that
        are touched become resident, and JAX's CPU client takes it as a device buffer without a copy (an embedding
        whose lookups read a few rows). None where the leaf is in several pieces or in object storage."""
        pieces = entry["pieces"]
        if (len(pieces) != 1 or list(pieces[0]["start"]) != [0] * len(entry["shape"])
                or list(pieces[0]["stop"]) != list(entry["shape"])):
            return None
        array = self._load(pieces[0], leaf, entry["dtype"])
        return array if isinstance(array, np.memmap) else None

    def _load(self, piece: dict, leaf: str, dtype_name: str) -> np.ndarray:
        if piece["file"] not in self._loaded:
            self._loaded[piece["file"]] = self._load_verified(piece, leaf, dtype_name)
        return self._loaded[piece["file"]]

    def _load_verified(self, piece: dict, leaf: str, dtype_name: str) -> np.ndarray:
        path = storage.join(self._directory, piece["file"])
        try:
            if storage.is_gcs(path):
                data = storage.read_bytes(path)
                digest, source, mmap_mode = hashlib.sha256(data).hexdigest(), io.BytesIO(data), None
            else:  # hash by streaming, then map: only the slices a device needs are paged in
                digest = piece["sha256"] if path in self._verified else _sha256_file(path)
                source, mmap_mode = path, "r"
        except FileNotFoundError:
            raise MissingPieceError(f"checkpoint piece {path} of leaf '{leaf}' is missing") from None
        if digest != piece["sha256"]:
            raise ChecksumError(f"checkpoint piece {path} of leaf '{leaf}' is corrupt: sha256 {digest}, index "
                                f"says {piece['sha256']}")
        if mmap_mode:
            self._verified.add(path)
        with npz.HEADER_LOCK:  # pieces are loaded by several threads at once
            array = np.load(source, mmap_mode=mmap_mode, allow_pickle=False)
        dtype = jnp.dtype(dtype_name)
        return array if array.dtype == dtype else array.view(dtype)
