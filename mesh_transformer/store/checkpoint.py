"""Checkpoints of a pytree (the train state): asynchronous sharded save with an atomic commit, retention, listing,
and restore onto any mesh.

A `Checkpointer` saves the checkpoints of one run: each process writes the unique shards it owns, process 0 commits
last, and a save runs in a background thread while training goes on. `restore` reads into any target mesh, each
device reading only the pieces that overlap its slice. The files are those of checkpoint_format.py.
"""
from __future__ import annotations

import functools
import json
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from mesh_transformer.store import checkpoint_format as fmt
from mesh_transformer.store import placing
from mesh_transformer import storage
from mesh_transformer.store.checkpoint_format import (COMMIT_NAME, ChecksumError, CorruptCheckpointError,
                                                      MissingPieceError, read_metadata, step_dir)

# The format's names a caller needs come along, so that saving, finding and restoring take one import.
__all__ = ["COMMIT_NAME", "ChecksumError", "Checkpointer", "CorruptCheckpointError", "MissingPieceError",
           "SaveHandle", "find_step", "latest_step", "list_steps", "read_metadata", "restore", "restore_latest_valid",
           "save", "step_dir"]

log = logging.getLogger(__name__)

_BARRIER_TIMEOUT_MS = 30 * 60 * 1000

_Piece = tuple[str, tuple[int, ...], tuple[int, ...], Any]  # leaf path, start, stop, data


# ----------------------------------------------------------------------------------------------------------- saving
def _capture(tree: Any) -> tuple[dict[str, dict], list[_Piece]]:
    """Describes every leaf and copies this process's unique shards (replica 0) to host memory."""
    leaves: dict[str, dict] = {}
    on_device: list[_Piece] = []
    pieces: list[_Piece] = []
    for keypath, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        path = fmt.leaf_path(keypath)
        if isinstance(leaf, jax.Array):
            leaves[path] = {"shape": list(leaf.shape), "dtype": leaf.dtype.name, "pieces": []}
            for shard in leaf.addressable_shards:
                if shard.replica_id == 0:
                    on_device.append((path, *fmt.bounds(shard.index, leaf.shape), shard.data))
        elif isinstance(leaf, (np.ndarray, np.generic)):
            array = np.array(leaf)  # a copy: the caller may change its array while we write
            leaves[path] = {"shape": list(array.shape), "dtype": array.dtype.name, "pieces": []}
            if jax.process_index() == 0:
                pieces.append((path, (0,) * array.ndim, array.shape, array))
        elif isinstance(leaf, fmt.VALUE_TYPES):
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
    for step in fmt.step_dirs(root):
        if not fmt.is_committed(root, step):
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

    def wait_unless_reported(self) -> None:
        """Waits; raises the error only if no earlier wait() has raised it already."""
        reported = self._reported
        try:
            self.wait()
        except BaseException:
            if not reported:
                raise


class Checkpointer:
    """Saves the checkpoints of one run under `root`, one at a time: each save waits for the one before it.

    Retention: after each commit, only the last `keep_last` steps and every multiple of `keep_every` are kept. Every
    process of a multi-process run makes the same saves in the same order (their barriers are counted here).
    """

    def __init__(self, root: str, *, keep_last: int = 3, keep_every: int | None = None):
        if keep_last < 1:
            raise ValueError(f"keep_last must be at least 1, got {keep_last}")
        self.root, self.keep_last, self.keep_every = root, keep_last, keep_every
        self._pending: SaveHandle | None = None
        self._saves = 0

    def wait(self) -> None:
        """Blocks until the previous save has finished; raises its error unless a wait() on its handle already did."""
        handle, self._pending = self._pending, None
        if handle is not None:
            handle.wait_unless_reported()

    def save(self, step: int, tree: Any, metadata: dict | None = None, *, blocking: bool = False) -> SaveHandle:
        """Starts writing `tree` as checkpoint `step`; returns once device data is on the host."""
        try:
            metadata = json.loads(json.dumps(metadata or {}))  # a copy, and an early error for what JSON can't hold
        except TypeError as e:
            raise TypeError(f"checkpoint metadata must be JSON-serialisable: {e}") from None
        self.wait()
        if fmt.is_committed(self.root, step):
            raise ValueError(f"{step_dir(self.root, step)} is already a committed checkpoint; delete it or save "
                             f"another step")
        leaves, pieces = _capture(tree)
        self._saves += 1
        work = functools.partial(self._write, step, leaves, pieces, metadata, f"checkpoint_{self._saves}_step_{step}")
        handle = self._pending = SaveHandle(step, work, blocking)
        if blocking:
            self.wait()
        return handle

    def _write(self, step: int, leaves: dict[str, dict], pieces: list[_Piece], metadata: dict, barrier: str) -> None:
        """The writing part of a save: clean up, write this process's pieces and index, commit, apply retention."""
        start_s = time.monotonic()
        directory = step_dir(self.root, step)
        process, process_count = jax.process_index(), jax.process_count()
        if process == 0:
            _remove_uncommitted(self.root)
        _barrier(f"{barrier}_clean")
        for leaf, start, stop, data in pieces:
            leaves[leaf]["pieces"].append(fmt.write_piece(directory, leaf, start, stop, data))
        fmt.write_index(directory, step, process, leaves, metadata if process == 0 else None)
        _barrier(f"{barrier}_written")
        if process == 0:
            fmt.write_commit(directory, step, process_count)
            log.info("checkpoint %s committed in %.1f s", directory, time.monotonic() - start_s)
        _barrier(f"{barrier}_committed")  # so that every process's wait() means "committed"
        if process != 0:
            return
        for old in _steps_to_delete(list_steps(self.root), self.keep_last, self.keep_every):
            log.info("removing checkpoint %s (retention)", step_dir(self.root, old))
            storage.remove_tree(step_dir(self.root, old))


def save(root: str, step: int, tree: Any, metadata: dict | None = None, *, keep_last: int = 3,
         keep_every: int | None = None, blocking: bool = True) -> SaveHandle:
    """One save by a Checkpointer of its own (tests, tools), blocking by default; a run keeps one Checkpointer."""
    return Checkpointer(root, keep_last=keep_last, keep_every=keep_every).save(step, tree, metadata, blocking=blocking)


# ---------------------------------------------------------------------------------------------------------- listing
def list_steps(root: str) -> list[int]:
    """Committed checkpoint steps under `root`, ascending; half-written ones are not listed."""
    return [step for step in fmt.step_dirs(root) if fmt.is_committed(root, step)]


def latest_step(root: str) -> int | None:
    """The newest committed step under `root`, or None when there is none."""
    steps = list_steps(root)
    return steps[-1] if steps else None


def find_step(path: str) -> tuple[str, int]:
    """(root, step) of a checkpoint given as its root (then its latest committed step) or as one step directory."""
    path = path.rstrip("/")
    parent, _, name = path.rpartition("/")
    step = fmt.parse_step_dir(name)
    if step is not None and fmt.is_committed(parent or ".", step):
        return parent or ".", step
    step = latest_step(path)
    if step is None:
        raise FileNotFoundError(f"no committed checkpoint at {path}")
    return path, step


# -------------------------------------------------------------------------------------------------------- restoring
def restore(root: str, step: int, target: Any, *, paths_prefix: str | None = None) -> tuple[Any, dict]:
    """Loads checkpoint `step` into the shapes, dtypes and shardings of `target`; returns (tree, metadata).

    `target` is a pytree of jax.ShapeDtypeStruct (or arrays) with `.sharding` on any mesh: each device reads only the
    pieces overlapping its slice (a large stacked leaf a block of layers at a time: `placing.put`), and only the
    leaves `target` names are read. With `paths_prefix` ('params'), `target` describes that subtree of the saved
    tree. Leaves that are not arrays in `target` get the saved value.
    """
    start_s = time.monotonic()
    leaves, metadata = fmt.read_index(root, step)
    reader = fmt.PieceReader(step_dir(root, step))
    prefix = paths_prefix.strip("/") + "/" if paths_prefix else ""

    def restore_leaf(keypath: tuple, like: Any) -> Any:
        path = prefix + fmt.leaf_path(keypath)
        if path not in leaves:
            raise KeyError(f"checkpoint {step_dir(root, step)} has no leaf '{path}'")
        entry = leaves[path]
        if "value" in entry:
            return entry["value"]
        shape = tuple(entry["shape"])
        if not (hasattr(like, "shape") and hasattr(like, "dtype")):
            array = reader.read_slice(path, entry, None, jnp.dtype(entry["dtype"]))
        elif tuple(like.shape) != shape:
            raise ValueError(f"checkpoint leaf '{path}' has shape {shape}, the target wants {tuple(like.shape)}")
        else:
            sharding = getattr(like, "sharding", None) or jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
            array = placing.put(shape, like.dtype, sharding,
                                lambda index: reader.read_slice(path, entry, index, like.dtype))
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
