"""Sharded checkpoints of a pytree: asynchronous save, atomic commit, checksums, restore onto any mesh.

One checkpoint is a directory per step:
    {root}/step_{N}/arrays/{leaf/path}/{start-stop_...}.npy   one piece per unique shard, written by its owner
    {root}/step_{N}/index_p{k}.json    process k's pieces (path, global shape, dtype, slice ranges, sha256); process 0's
                                       also holds the user metadata
    {root}/step_{N}/COMMITTED          written last, by process 0, once every process has written; without it the step
                                       does not exist and the next save deletes it
"""
from __future__ import annotations

import hashlib
import io
import json
import logging
import math
import re
import threading
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from mesh_transformer.store import storage

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
COMMIT_NAME = "COMMITTED"
_STEP_DIR = re.compile(r"^step_(\d+)$")
_BARRIER_TIMEOUT_MS = 30 * 60 * 1000
_HASH_CHUNK_BYTES = 1 << 20
_VALUE_TYPES = (bool, int, float, str)


class CorruptCheckpointError(OSError):
    """A committed checkpoint whose files are damaged or missing."""


class ChecksumError(CorruptCheckpointError):
    """A piece file whose sha256 differs from the one recorded in the index."""


class MissingPieceError(CorruptCheckpointError, FileNotFoundError):
    """A piece or index file named by a committed checkpoint that is not there."""


def step_dir(root: str, step: int) -> str:
    return storage.join(root, f"step_{step}")


def _key_name(key: Any) -> str:
    for attr in ("key", "idx", "name"):  # DictKey, SequenceKey, GetAttrKey (namedtuples such as optax states)
        if hasattr(key, attr):
            return str(getattr(key, attr))
    return str(key)


def _leaf_path(keypath: tuple) -> str:
    parts = [_key_name(k) for k in keypath]
    for part in parts:
        if not part or "/" in part or part in (".", ".."):
            raise ValueError(f"checkpoint leaf key {part!r} in {parts} can't name a file; use keys without '/'")
    return "/".join(parts)


def _bounds(index: tuple, shape: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(start, stop) per dimension of a tuple of slices, as jax gives shard indices."""
    ranges = [s.indices(n)[:2] for s, n in zip(index, shape)]
    return tuple(a for a, _ in ranges), tuple(b for _, b in ranges)


def _storable(array: np.ndarray) -> np.ndarray:
    # numpy can't load bfloat16 & co. from .npy without pickle, so those travel as unsigned ints of the same width.
    if np.dtype(array.dtype.str) != array.dtype:
        return array.view(f"u{array.dtype.itemsize}")
    return array


# ----------------------------------------------------------------------------------------------------------- saving
class _HashingWriter:
    """Forwards writes to a file while hashing them, so a piece is hashed without reading it back."""

    def __init__(self, f: Any):
        self._f = f
        self.sha256 = hashlib.sha256()

    def write(self, data: bytes) -> int:
        self.sha256.update(data)
        return self._f.write(data)


_Piece = tuple[str, tuple[int, ...], tuple[int, ...], Any]  # leaf path, start, stop, data


def _capture(tree: Any) -> tuple[dict[str, dict], list[_Piece]]:
    """Describes every leaf and copies this process's unique shards (replica 0) to host memory."""
    leaves: dict[str, dict] = {}
    on_device: list[_Piece] = []
    pieces: list[_Piece] = []
    for keypath, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        path = _leaf_path(keypath)
        if isinstance(leaf, jax.Array):
            leaves[path] = {"shape": list(leaf.shape), "dtype": leaf.dtype.name, "pieces": []}
            for shard in leaf.addressable_shards:
                if shard.replica_id == 0:
                    on_device.append((path, *_bounds(shard.index, leaf.shape), shard.data))
        elif isinstance(leaf, (np.ndarray, np.generic)):
            array = np.array(leaf)  # a copy: the caller may change its array while we write
            leaves[path] = {"shape": list(array.shape), "dtype": array.dtype.name, "pieces": []}
            if jax.process_index() == 0:
                pieces.append((path, (0,) * array.ndim, array.shape, array))
        elif isinstance(leaf, _VALUE_TYPES):
            leaves[path] = {"value": leaf}
        else:
            raise TypeError(f"checkpoint leaf '{path}' has type {type(leaf).__name__}; expected an array or a "
                            f"bool/int/float/str")
    host_arrays = jax.device_get([data for *_, data in on_device])
    for (path, start, stop, data), host in zip(on_device, host_arrays):
        # On CPU device_get returns a view of the device buffer, which would pin it (no donation) until written.
        on_cpu = all(d.platform == "cpu" for d in data.devices())
        pieces.append((path, start, stop, host.copy() if on_cpu else host))
    return leaves, pieces


def _piece_name(leaf: str, start: tuple[int, ...], stop: tuple[int, ...]) -> str:
    return f"arrays/{leaf}/{'_'.join(f'{a}-{b}' for a, b in zip(start, stop)) or 'scalar'}.npy"


def _write_commit(directory: str, step: int, process_count: int) -> None:
    """The commit record, written last: until it exists the step does not."""
    commit = {"format_version": FORMAT_VERSION, "step": step, "committed_unix_s": time.time(),
              "index_files": [f"index_p{k}.json" for k in range(process_count)]}
    storage.write_bytes_atomic(storage.join(directory, COMMIT_NAME), json.dumps(commit).encode())


def _write_index(directory: str, step: int, leaves: dict[str, dict], pieces: list[_Piece],
                 metadata: dict | None, process: int) -> None:
    """Writes this process's pieces, then its index file naming them."""
    for leaf, start, stop, data in pieces:
        name = _piece_name(leaf, start, stop)
        with storage.open_file(storage.join(directory, name), "wb") as f:
            writer = _HashingWriter(f)
            np.save(writer, _storable(data), allow_pickle=False)
        leaves[leaf]["pieces"].append({"file": name, "start": list(start), "stop": list(stop),
                                       "sha256": writer.sha256.hexdigest()})
    index = {"format_version": FORMAT_VERSION, "step": step, "process_index": process, "metadata": metadata,
             "leaves": leaves}
    storage.write_bytes_atomic(storage.join(directory, f"index_p{process}.json"), json.dumps(index).encode())


_barrier_count = 0


def _barrier(name: str) -> None:
    """Blocks until every process gets here; the coordination service's barrier is safe off the main thread."""
    if jax.process_count() == 1:
        return
    from jax._src import distributed

    client = distributed.global_state.client
    if client is None:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)
    else:
        client.wait_at_barrier(name, _BARRIER_TIMEOUT_MS)


def _steps_to_delete(steps: list[int], keep_last: int, keep_every: int | None) -> list[int]:
    keep = set(sorted(steps)[-keep_last:])
    if keep_every:
        keep |= {s for s in steps if s % keep_every == 0}
    return sorted(s for s in steps if s not in keep)


def _remove_uncommitted(root: str) -> None:
    for step in _step_dirs(root):
        if not _is_committed(root, step):
            log.warning("removing half-written checkpoint %s", step_dir(root, step))
            storage.remove_tree(step_dir(root, step))


class SaveHandle:
    """A save in flight: wait() blocks until it is committed and re-raises whatever went wrong."""

    def __init__(self, step: int, work: Callable[[], None], blocking: bool):
        self.step = step
        self._error: BaseException | None = None
        self._reported = False
        self._thread = threading.Thread(target=self._run, args=(work,), name=f"checkpoint-save-{step}")
        if blocking:
            self._run(work)
        else:
            self._thread.start()  # not a daemon: the interpreter finishes the last save before it exits

    def _run(self, work: Callable[[], None]) -> None:
        try:
            work()
        except Exception as e:
            log.error("checkpoint save of step %d failed: %r", self.step, e)
            self._error = e

    def done(self) -> bool:
        return not self._thread.is_alive()

    def wait(self, timeout_s: float | None = None) -> None:
        if self._thread.ident is not None:
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                raise TimeoutError(f"checkpoint save of step {self.step} still running after {timeout_s} s")
        if self._error is not None:
            self._reported = True
            raise self._error

    def _wait_unless_reported(self) -> None:
        """Waits; raises the error only if no earlier wait() has raised it already."""
        reported = self._reported
        try:
            self.wait()
        except BaseException:
            if not reported:
                raise


_last_save: SaveHandle | None = None


def wait_for_saves() -> None:
    """Blocks until the previous save has finished; raises its error unless a wait() on its handle already did."""
    global _last_save
    handle, _last_save = _last_save, None
    if handle is not None:
        handle._wait_unless_reported()


def save(root: str, step: int, tree: Any, metadata: dict | None = None, *, keep_last: int = 3,
         keep_every: int | None = None, blocking: bool = False) -> SaveHandle:
    """Starts writing `tree` as checkpoint `step` under `root`; returns once device data is on the host."""
    global _last_save, _barrier_count
    if keep_last < 1:
        raise ValueError(f"keep_last must be at least 1, got {keep_last}")
    try:
        metadata = json.loads(json.dumps(metadata or {}))  # a copy, and an early error for what JSON can't hold
    except TypeError as e:
        raise TypeError(f"checkpoint metadata must be JSON-serialisable: {e}") from None
    wait_for_saves()
    if _is_committed(root, step):
        raise ValueError(f"{step_dir(root, step)} is already a committed checkpoint; delete it or save another step")
    leaves, pieces = _capture(tree)
    process, process_count = jax.process_index(), jax.process_count()
    _barrier_count += 1
    barrier = f"checkpoint_{_barrier_count}_step_{step}"

    def work() -> None:
        start_s = time.monotonic()
        directory = step_dir(root, step)
        if process == 0:
            _remove_uncommitted(root)
        _barrier(f"{barrier}_clean")
        _write_index(directory, step, leaves, pieces, metadata if process == 0 else None, process)
        _barrier(f"{barrier}_written")
        if process == 0:
            _write_commit(directory, step, process_count)
            log.info("checkpoint %s committed in %.1f s", directory, time.monotonic() - start_s)
        _barrier(f"{barrier}_committed")  # so that every process's wait() means "committed"
        if process != 0:
            return
        for old in _steps_to_delete(list_steps(root), keep_last, keep_every):
            log.info("removing checkpoint %s (retention)", step_dir(root, old))
            storage.remove_tree(step_dir(root, old))

    handle = _last_save = SaveHandle(step, work, blocking)
    if blocking:
        wait_for_saves()
    return handle


# ---------------------------------------------------------------------------------------------------------- listing
def _step_dirs(root: str) -> list[int]:
    return sorted(int(m.group(1)) for name in storage.listdir(root) if (m := _STEP_DIR.match(name)))


def _is_committed(root: str, step: int) -> bool:
    return storage.exists(storage.join(step_dir(root, step), COMMIT_NAME))


def list_steps(root: str) -> list[int]:
    """Committed checkpoint steps under `root`, ascending; half-written ones are not listed."""
    return [step for step in _step_dirs(root) if _is_committed(root, step)]


def latest_step(root: str) -> int | None:
    """The newest committed step under `root`, or None when there is none."""
    steps = list_steps(root)
    return steps[-1] if steps else None


def find_step(path: str) -> tuple[str, int]:
    """(root, step) of a checkpoint given as its root (then its latest committed step) or as one step directory."""
    path = path.rstrip("/")
    parent, _, name = path.rpartition("/")
    match = _STEP_DIR.match(name)
    if match and _is_committed(parent or ".", int(match.group(1))):
        return parent or ".", int(match.group(1))
    step = latest_step(path)
    if step is None:
        raise FileNotFoundError(f"no committed checkpoint at {path}")
    return path, step


# -------------------------------------------------------------------------------------------------------- restoring
def _read_json(path: str, what: str) -> dict:
    try:
        return json.loads(storage.read_bytes(path))
    except FileNotFoundError:
        raise MissingPieceError(f"{what} {path} is missing") from None


def _read_commit(root: str, step: int) -> dict:
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
    commit = _read_commit(root, step)
    return _read_json(storage.join(step_dir(root, step), commit["index_files"][0]), "checkpoint index")["metadata"]


def _read_index(root: str, step: int) -> tuple[dict[str, dict], dict]:
    """Every process's index merged into one: (leaves by path, metadata)."""
    commit = _read_commit(root, step)
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
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_HASH_CHUNK_BYTES):
            digest.update(chunk)
    return digest.hexdigest()


class _PieceReader:
    """Loads the pieces of one checkpoint, checking each file's sha256 the first time it is read."""

    def __init__(self, directory: str):
        self._directory = directory
        self._loaded: dict[str, np.ndarray] = {}

    def load(self, piece: dict, leaf: str, dtype_name: str) -> np.ndarray:
        if piece["file"] not in self._loaded:
            self._loaded[piece["file"]] = self._load_verified(piece, leaf, dtype_name)
        return self._loaded[piece["file"]]

    def forget(self) -> None:
        """Drops loaded pieces; called after each leaf so memory holds one leaf's pieces at a time."""
        self._loaded.clear()

    def _load_verified(self, piece: dict, leaf: str, dtype_name: str) -> np.ndarray:
        path = storage.join(self._directory, piece["file"])
        try:
            if storage.is_gcs(path):
                data = storage.read_bytes(path)
                digest, source, mmap_mode = hashlib.sha256(data).hexdigest(), io.BytesIO(data), None
            else:  # hash by streaming, then map: only the slices a device needs are paged in
                digest, source, mmap_mode = _sha256_file(path), path, "r"
        except FileNotFoundError:
            raise MissingPieceError(f"checkpoint piece {path} of leaf '{leaf}' is missing") from None
        if digest != piece["sha256"]:
            raise ChecksumError(f"checkpoint piece {path} of leaf '{leaf}' is corrupt: sha256 {digest}, index "
                                f"says {piece['sha256']}")
        array = np.load(source, mmap_mode=mmap_mode, allow_pickle=False)
        dtype = jnp.dtype(dtype_name)
        return array if array.dtype == dtype else array.view(dtype)


def _read_slice(reader: _PieceReader, leaf: str, entry: dict, index: tuple, dtype: Any) -> np.ndarray:
    """Assembles one device's slice of a leaf from the pieces that overlap it, cast to `dtype`."""
    shape = tuple(entry["shape"])
    start, stop = _bounds((slice(None),) * len(shape) if index is None else index, shape)
    out = np.empty([b - a for a, b in zip(start, stop)], dtype)
    covered = 0
    for piece in entry["pieces"]:
        lo = [max(a, p) for a, p in zip(start, piece["start"])]
        hi = [min(b, p) for b, p in zip(stop, piece["stop"])]
        if any(low >= high for low, high in zip(lo, hi)):
            continue
        source = reader.load(piece, leaf, entry["dtype"])
        out[tuple(slice(low - a, high - a) for low, high, a in zip(lo, hi, start))] = source[
            tuple(slice(low - p, high - p) for low, high, p in zip(lo, hi, piece["start"]))]
        covered += math.prod(high - low for low, high in zip(lo, hi))
    if covered != out.size:
        raise CorruptCheckpointError(f"checkpoint pieces of leaf '{leaf}' cover {covered} of the {out.size} "
                                     f"elements in [{start}, {stop}); an index file lacks pieces")
    return out


def restore(root: str, step: int, target: Any, *, paths_prefix: str | None = None) -> tuple[Any, dict]:
    """Loads checkpoint `step` into the shapes, dtypes and shardings of `target`; returns (tree, metadata).

    `target` is a pytree of jax.ShapeDtypeStruct (or arrays) with `.sharding` on any mesh: each device reads only the
    pieces overlapping its slice, and only the leaves `target` names are read. With `paths_prefix` ('params'),
    `target` describes that subtree of the saved tree. Leaves that are not arrays in `target` get the saved value.
    """
    start_s = time.monotonic()
    leaves, metadata = _read_index(root, step)
    reader = _PieceReader(step_dir(root, step))
    prefix = paths_prefix.strip("/") + "/" if paths_prefix else ""

    def restore_leaf(keypath: tuple, like: Any) -> Any:
        path = prefix + _leaf_path(keypath)
        if path not in leaves:
            raise KeyError(f"checkpoint {step_dir(root, step)} has no leaf '{path}'")
        entry = leaves[path]
        if "value" in entry:
            return entry["value"]
        shape = tuple(entry["shape"])
        if not (hasattr(like, "shape") and hasattr(like, "dtype")):
            array = _read_slice(reader, path, entry, None, jnp.dtype(entry["dtype"]))
        elif tuple(like.shape) != shape:
            raise ValueError(f"checkpoint leaf '{path}' has shape {shape}, the target wants {tuple(like.shape)}")
        else:
            sharding = getattr(like, "sharding", None) or jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
            array = jax.make_array_from_callback(
                shape, sharding, lambda index: _read_slice(reader, path, entry, index, like.dtype))
        reader.forget()
        return array

    tree = jax.tree_util.tree_map_with_path(restore_leaf, target)
    log.info("restored %s in %.1f s", step_dir(root, step), time.monotonic() - start_s)
    return tree, metadata


def restore_latest_valid(root: str, target: Any, *,
                         paths_prefix: str | None = None) -> tuple[int, Any, dict] | None:
    """Restores the newest committed step that reads cleanly, falling back past corrupt ones.

    Returns (step, tree, metadata), or None when `root` holds no committed checkpoint.
    """
    steps = list_steps(root)
    for step in reversed(steps):
        try:
            tree, metadata = restore(root, step, target, paths_prefix=paths_prefix)
            return step, tree, metadata
        except CorruptCheckpointError as e:
            if step == steps[0]:
                raise
            log.warning("checkpoint step %d is unreadable (%s); falling back to the previous step", step, e)
    return None
