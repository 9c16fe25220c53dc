"""A checkpoint's params read ahead of a loader that places them, a module or a layer at a time: while the loader
puts one layer on the devices and converts it there, one background thread reads the next few (the reader is used by
that thread alone, in order), so the host's reads, the transfers and the devices' work overlap. At most `ahead`
reads are done or under way beyond the one being placed (`depth`), which bounds the host memory they hold.
"""
from __future__ import annotations

import collections
import itertools
import logging
import math
import mmap
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import numpy as np

from mesh_transformer.config import Config
from mesh_transformer.model import quant, table

log = logging.getLogger(__name__)
T = TypeVar("T")
AHEAD_BYTES = 1 << 30  # what a loader may hold read ahead, MOST_AHEAD layers at most (GPT-J-6B in bf16: two)
MOST_AHEAD = 2


def depth(cfg: Config, dtype: Any) -> int:
    """Layers to read ahead: as many as AHEAD_BYTES holds in `dtype`, at least one, at most MOST_AHEAD."""
    layer_bytes = sum(math.prod(like.shape[1:]) * np.dtype(dtype).itemsize
                      for path, like in table.param_paths(cfg) if path[0] == "layers")
    return max(1, min(MOST_AHEAD, AHEAD_BYTES // max(1, layer_bytes)))


def read_ahead(reads: Iterable[Callable[[], T]], ahead: int) -> Iterator[T]:
    """Each read's result, in order, while one background thread runs the next `ahead` reads. A read's exception
    is raised where its result would have been; closing the iterator early waits for the read under way and drops
    the rest."""
    reads, waited_s, done = iter(reads), 0.0, 0
    with ThreadPoolExecutor(1, thread_name_prefix="read-ahead") as pool:
        pending = collections.deque(pool.submit(read) for read in itertools.islice(reads, ahead))
        try:
            while pending:
                start_s = time.perf_counter()
                result = pending.popleft().result()
                waited_s, done = waited_s + time.perf_counter() - start_s, done + 1
                pending.extend(pool.submit(read) for read in itertools.islice(reads, 1))
                yield result
                del result  # not held while the next is awaited
        finally:
            for future in pending:
                future.cancel()
            log.info("%d reads, up to %d ahead of their use: %.1f s waited on them", done, ahead, waited_s)


def resident(x: np.ndarray) -> np.ndarray:
    """x with its pages in memory: of a view of a file's mapping (an HF directory's tensors) the whole mapping is
    read here, a byte a page, so the copy that places it finds every page mapped and runs at the speed of memory."""
    if isinstance(x, np.memmap) and x.size:
        mapped = x
        while isinstance(mapped.base, np.ndarray):
            mapped = mapped.base  # the array np.memmap made, contiguous
        mapped.reshape(-1).view(np.uint8)[::mmap.PAGESIZE].max()
    return x


def read_module(reader: Any, cfg: Config, key: str, dtype: Any = None) -> dict:
    """A module outside the layers (embedding, ln_f, head) as stored, or in `dtype` (a param our checkpoint holds in
    one local piece in that dtype given as the file's own mapping: `read_whole`)."""
    module: dict = {}
    for path, _ in table.param_paths(cfg):
        if path[0] == key:
            array = resident(reader.read(path)) if dtype is None else read_whole(reader, path, dtype)
            table.set_path(module, path, array)
    return module[key]


def read_whole(reader: Any, path: tuple, dtype: np.dtype) -> np.ndarray:
    """One param outside the layers in `dtype`: the file's own mapping where our checkpoint holds it in one local
    piece in that dtype (`PieceReader.mapped`; on the CPU the device buffer is the mapping, so of GPT-J-6B's
    0.41 GB embedding only the rows looked up become resident), else read into host memory."""
    mapped = getattr(reader, "read_mapped", None)
    array = None if mapped is None else mapped(path)
    if array is not None and array.dtype == dtype and array.flags.c_contiguous and array.ctypes.data % 64 == 0:
        return array  # (an unaligned one would be copied whole, every page touched)
    return resident(reader.read(path)).astype(dtype, copy=False)


def read_layer(reader: Any, read_int8: Any, cfg: Config, i: int, dtype: Any = None) -> tuple[dict, dict | None]:
    """(layer i of the param tree in host memory, as stored or in `dtype`; the scales of its groups where the
    checkpoint holds it as int8, read by `read_int8`)."""
    layer: dict = {}
    scales: dict = {}
    for path, _ in table.param_paths(cfg):
        if path[0] != "layers":
            continue
        held = None if read_int8 is None else read_int8(path, i)
        if held is None:
            array = resident(reader.read(path, i))
            table.set_path(layer, path[1:], array if dtype is None else array.astype(dtype, copy=False))
        else:
            table.set_path(layer, path[1:], held[0])
            scales[quant.MATRICES[path[1:]]] = held[1]
    return layer, scales or None
