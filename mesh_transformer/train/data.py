"""Token datasets over TFRecord files: index files, deterministic resumable shuffled batches, process split, mixtures.

An index file lists record files, one per line (relative paths are resolved against the index's directory). Every
record is a tf.train.Example whose int64 feature "text" holds seq + 1 token ids.

Training order is a pure function of (seed, source, epoch, position): each epoch permutes the files, groups them into
windows of `window_files` files, and permutes the records inside each window. So resuming needs only a position per
source: the record to read is computed, then read at its byte offset, never by reading what came before. Windows keep
memory bounded (one record permutation per window, one offset table per open file) on datasets of any size.
"""
from __future__ import annotations

import logging
import math
import os
import re
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import IO, Any

import numpy as np

from mesh_transformer import storage
from mesh_transformer.store.tfrecord import DataError, decode_example, read_record_at, scan_offsets

__all__ = ["DataError", "RecordFiles", "TokenDataset", "count_from_name", "read_index", "val_batches"]

logger = logging.getLogger(__name__)

TOKENS_FEATURE = "text"
# The original tool names files {name}_{i}_{n_records}.tfrecords; the trailing count saves reading every file.
_COUNT_IN_NAME = re.compile(r"_(\d+)\.tfrecords$")
# Distinct first words for the random streams, so no two uses of one seed ever share draws.
_STREAM_FILES, _STREAM_WINDOW, _STREAM_MIXTURE = 1, 2, 3


def _dirname(path: str) -> str:
    return path.rsplit("/", 1)[0] if storage.is_gcs(path) else os.path.dirname(os.path.abspath(path))


def read_index(index_path: str) -> list[str]:
    """The record files an index lists, in order, relative paths resolved against the index's directory."""
    if not storage.exists(index_path):
        raise DataError(f"index file {index_path} does not exist")
    lines = [line.strip() for line in storage.read_bytes(index_path).decode().splitlines()]
    entries = [line for line in lines if line]
    if not entries:
        raise DataError(f"index file {index_path} lists no record files")
    base = _dirname(index_path)
    return [e if storage.is_gcs(e) or os.path.isabs(e) else storage.join(base, e) for e in entries]


def count_from_name(path: str) -> int | None:
    """The record count a file name like `{name}_{i}_{n_records}.tfrecords` carries, or None."""
    match = _COUNT_IN_NAME.search(path)
    return int(match.group(1)) if match else None


def _memo(cache: OrderedDict, key: Any, compute: Callable[[], Any], max_items: int,
          on_evict: Callable[[Any], None] | None = None) -> Any:
    """A least-recently-used cache lookup: returns cache[key], computing and inserting it when absent."""
    if key in cache:
        cache.move_to_end(key)
        return cache[key]
    value = compute()
    cache[key] = value
    while len(cache) > max_items:
        _, evicted = cache.popitem(last=False)
        if on_evict is not None:
            on_evict(evicted)
    return value


class RecordFiles:
    """The record files of one index: record counts, lazily scanned offset tables, random access to token rows."""

    def __init__(self, index_path: str, seq: int, max_open_files: int = 32):
        self.index_path = index_path
        self.seq = seq
        self.paths = read_index(index_path)
        self._max_open = max_open_files
        self._offsets: OrderedDict[int, np.ndarray] = OrderedDict()
        self._handles: OrderedDict[int, IO] = OrderedDict()
        for path in self.paths:
            if not storage.is_gcs(path) and not os.path.isfile(path):  # free to check locally; GCS fails on open
                raise DataError(f"record file {path} (listed in {index_path}) does not exist")
        self.counts_F = np.array([self._count(i) for i in range(len(self.paths))], np.int64)
        self.starts_F = np.cumsum(self.counts_F) - self.counts_F
        self.n_records = int(self.counts_F.sum())

    def _count(self, file_i: int) -> int:
        path = self.paths[file_i]
        n_records = count_from_name(path)
        if n_records is None:
            n_records = len(_memo(self._offsets, file_i, lambda: self._scan(file_i), self._max_open))
        if n_records == 0:
            raise DataError(f"record file {path} (listed in {self.index_path}) holds no records")
        return n_records

    def _scan(self, file_i: int) -> np.ndarray:
        path = self.paths[file_i]
        try:
            return scan_offsets(path)
        except DataError:
            raise
        except Exception as e:
            if not storage.exists(path):
                raise DataError(f"record file {path} (listed in {self.index_path}) does not exist") from e
            raise

    def offsets(self, file_i: int) -> np.ndarray:
        """Byte offsets of every record of one file; checks the count its name claims."""
        def scan_and_check() -> np.ndarray:
            offsets_N = self._scan(file_i)
            if len(offsets_N) != self.counts_F[file_i]:
                raise DataError(f"record file {self.paths[file_i]}: its name says {self.counts_F[file_i]} records "
                                f"but it holds {len(offsets_N)}")
            return offsets_N
        return _memo(self._offsets, file_i, scan_and_check, self._max_open)

    def _handle(self, file_i: int) -> IO:
        return _memo(self._handles, file_i, lambda: storage.open_file(self.paths[file_i], "rb"), self._max_open,
                     on_evict=lambda f: f.close())

    def locate(self, record: int) -> tuple[int, int]:
        """(file, record within file) of a record numbered across all files in index order."""
        file_i = int(np.searchsorted(self.starts_F, record, side="right")) - 1
        return file_i, record - int(self.starts_F[file_i])

    def read(self, file_i: int, record_i: int) -> np.ndarray:
        """The seq + 1 token ids [T] int32 of one record."""
        path, offset = self.paths[file_i], int(self.offsets(file_i)[record_i])
        data = read_record_at(self._handle(file_i), offset, path)
        try:
            tokens_T = decode_example(data)[TOKENS_FEATURE]
        except (ValueError, KeyError) as e:
            raise DataError(f"{path}: record at byte offset {offset} is not a tf.train.Example with an int64 "
                            f"{TOKENS_FEATURE!r} feature ({type(e).__name__}: {e})") from e
        if tokens_T.size != self.seq + 1:
            raise DataError(f"{path}: record at byte offset {offset} has {tokens_T.size} tokens; "
                            f"seq {self.seq} needs seq + 1 = {self.seq + 1}")
        return tokens_T.astype(np.int32)

    def close(self) -> None:
        while self._handles:
            self._handles.popitem()[1].close()


class ShuffledOrder:
    """Which (file, record) one source serves at each position of each epoch: files shuffled, records within windows."""

    def __init__(self, counts_F: np.ndarray, seed: int, source_i: int, window_files: int):
        self.counts_F = counts_F
        self.seed, self.source_i, self.window_files = seed, source_i, window_files
        self._layouts: OrderedDict = OrderedDict()
        self._windows: OrderedDict = OrderedDict()

    def _layout(self, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        """This epoch's file order [F] and the first record position of each window [W + 1]."""
        def compute() -> tuple[np.ndarray, np.ndarray]:
            rng = np.random.default_rng([self.seed, _STREAM_FILES, self.source_i, epoch, 0])
            order_F = rng.permutation(len(self.counts_F))
            window_counts = np.add.reduceat(self.counts_F[order_F], np.arange(0, len(order_F), self.window_files))
            return order_F, np.concatenate([[0], np.cumsum(window_counts)])
        return _memo(self._layouts, epoch, compute, 2)

    def _window(self, epoch: int, window_i: int) -> tuple[np.ndarray, np.ndarray]:
        """A window's files [w] and its record permutation [N_window]."""
        def compute() -> tuple[np.ndarray, np.ndarray]:
            order_F, window_starts = self._layout(epoch)
            files_w = order_F[window_i * self.window_files:(window_i + 1) * self.window_files]
            size = int(window_starts[window_i + 1] - window_starts[window_i])
            rng = np.random.default_rng([self.seed, _STREAM_WINDOW, self.source_i, epoch, window_i])
            return files_w, rng.permutation(size)
        return _memo(self._windows, (epoch, window_i), compute, 4)

    def locate(self, epoch: int, position: int) -> tuple[int, int]:
        """(file, record within file) served at `position` of `epoch`."""
        _, window_starts = self._layout(epoch)
        window_i = int(np.searchsorted(window_starts, position, side="right")) - 1
        files_w, permutation = self._window(epoch, window_i)
        record = int(permutation[position - window_starts[window_i]])
        ends_w = np.cumsum(self.counts_F[files_w])
        slot = int(np.searchsorted(ends_w, record, side="right"))
        return int(files_w[slot]), record - int(ends_w[slot] - self.counts_F[files_w[slot]])


def _batch_per_process(global_batch: int, process_index: int, process_count: int) -> int:
    if global_batch <= 0 or process_count <= 0 or global_batch % process_count:
        raise ValueError(f"global batch {global_batch} must be a positive multiple of the process count "
                         f"{process_count}")
    if not 0 <= process_index < process_count:
        raise ValueError(f"process index {process_index} is outside [0, {process_count})")
    return global_batch // process_count


class TokenDataset:
    """Endless shuffled training batches [gradient_accumulation_steps, batch_per_process, seq + 1] int32.

    `sources` is one index path or a mixture [(index_path, weight), ...]. Every global row of a step draws its source
    from the weights (seeded by step); each source keeps its own position and epoch. Process p of P reads only rows
    [p * B / P, (p + 1) * B / P) of each micro-batch of B = global_batch rows. `state()` is small and global (the same
    on every process), so a run can resume on any number of processes.
    """

    def __init__(self, sources: str | Sequence[tuple[str, float]], seq: int, global_batch: int, *,
                 gradient_accumulation_steps: int = 1, seed: int = 0, process_index: int = 0,
                 process_count: int = 1, state: Mapping[str, Any] | None = None, window_files: int = 16):
        pairs = [(sources, 1.0)] if isinstance(sources, str) else [(str(p), float(w)) for p, w in sources]
        if not pairs:
            raise ValueError("a dataset needs at least one index file")
        for path, weight in pairs:
            if not (math.isfinite(weight) and weight > 0):
                raise ValueError(f"mixture weight of {path} must be a positive number, got {weight}")
        if seed < 0 or gradient_accumulation_steps <= 0 or window_files <= 0 or seq <= 0:
            raise ValueError("seed must be >= 0 and seq, gradient_accumulation_steps and window_files positive")
        self.seq, self.global_batch, self.seed = seq, global_batch, seed
        self.gradient_accumulation_steps = gradient_accumulation_steps
        self.batch_per_process = _batch_per_process(global_batch, process_index, process_count)
        self._own_rows = slice(process_index * self.batch_per_process, (process_index + 1) * self.batch_per_process)
        self.files = [RecordFiles(path, seq, max_open_files=2 * window_files) for path, _ in pairs]
        self.orders = [ShuffledOrder(f.counts_F, seed, i, window_files) for i, f in enumerate(self.files)]
        weights = np.array([w for _, w in pairs])
        self.weights = weights / weights.sum()
        self._step = 0
        self._consumed = [0] * len(self.files)  # records taken from each source since the start: epoch * n + position
        if state is not None:
            self.restore(state)

    def state(self) -> dict[str, Any]:
        """Where the iteration stands, as JSON-able data: {"step", "sources": [{"index", "epoch", "position"}]}."""
        sources = [{"index": f.index_path, "epoch": c // f.n_records, "position": c % f.n_records}
                   for f, c in zip(self.files, self._consumed)]
        return {"step": self._step, "sources": sources}

    def restore(self, state: Mapping[str, Any]) -> None:
        """Continue from a `state()`; the next batch is the one that followed it."""
        try:
            step, sources = int(state["step"]), list(state["sources"])
            positions = [(int(s["epoch"]), int(s["position"])) for s in sources]
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"data state must look like {{'step': int, 'sources': [{{'epoch': int, 'position': "
                             f"int}}, ...]}}, got {state!r}") from e
        if len(positions) != len(self.files):
            raise ValueError(f"data state has {len(positions)} sources, the dataset has {len(self.files)}")
        for source, f in zip(sources, self.files):
            if source.get("index", f.index_path) != f.index_path:
                logger.warning("data state was saved for %s, resuming it on %s", source["index"], f.index_path)
        self._step = step
        # A source that grew or shrank keeps its epoch; a position past its end starts the next epoch.
        self._consumed = [e * f.n_records + min(p, f.n_records) for (e, p), f in zip(positions, self.files)]

    def _draw_sources(self, step: int, n_rows: int) -> np.ndarray:
        """The source of each of a step's global rows [R]; the same on every process."""
        if len(self.files) == 1:
            return np.zeros(n_rows, np.int64)
        rng = np.random.default_rng([self.seed, _STREAM_MIXTURE, step, 0, 0])
        return rng.choice(len(self.files), size=n_rows, p=self.weights)

    def __iter__(self) -> Iterator[np.ndarray]:
        return self

    def __next__(self) -> np.ndarray:
        n_micro, batch = self.gradient_accumulation_steps, self.global_batch
        source_R = self._draw_sources(self._step, n_micro * batch)
        record_R = np.empty_like(source_R)
        consumed = list(self._consumed)
        for s in range(len(self.files)):
            rows = np.flatnonzero(source_R == s)
            record_R[rows] = consumed[s] + np.arange(rows.size)
            consumed[s] += rows.size
        source_GB = source_R.reshape(n_micro, batch)[:, self._own_rows]
        record_GB = record_R.reshape(n_micro, batch)[:, self._own_rows]
        reads = []
        for g, b in np.ndindex(source_GB.shape):
            s = int(source_GB[g, b])
            epoch, position = divmod(int(record_GB[g, b]), self.files[s].n_records)
            reads.append((s, *self.orders[s].locate(epoch, position), g, b))
        tokens_GBT = np.empty((n_micro, self.batch_per_process, self.seq + 1), np.int32)
        for s, file_i, record_i, g, b in sorted(reads):  # file order, so reads sweep each file forwards
            tokens_GBT[g, b] = self.files[s].read(file_i, record_i)
        self._consumed, self._step = consumed, self._step + 1  # only after every read succeeded
        return tokens_GBT

    def close(self) -> None:
        for f in self.files:
            f.close()


def val_batches(index_path: str, seq: int, global_batch: int, n_batches: int, *, process_index: int = 0,
                process_count: int = 1) -> Iterator[np.ndarray]:
    """The first `n_batches` batches [batch_per_process, seq + 1] int32 of an index, in file order, every call."""
    batch_per_process = _batch_per_process(global_batch, process_index, process_count)
    files = RecordFiles(index_path, seq)  # opened here, not lazily, so a bad index fails at the call
    available = files.n_records // global_batch
    if available == 0:
        files.close()
        raise DataError(f"val set {index_path} holds {files.n_records} records, fewer than one global batch of "
                        f"{global_batch}")
    if available < n_batches:
        logger.warning("val set %s holds %d batches of %d, not the %d asked for", index_path, available,
                       global_batch, n_batches)
    firsts = [b * global_batch + process_index * batch_per_process for b in range(min(n_batches, available))]

    def batches() -> Iterator[np.ndarray]:
        try:
            for first in firsts:
                yield np.stack([files.read(*files.locate(r)) for r in range(first, first + batch_per_process)])
        finally:
            files.close()
    return batches()
