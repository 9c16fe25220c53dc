"""Reader for original mesh-transformer-jax (MTJ v1) checkpoints: our global params, one array or one layer at a time.

Layout: step_N/shard_{i}/{0..15}.npz, i < the model-parallel degree. Each shard holds its slice of the whole state
pytree, flattened with sorted dict keys (full: opt_state, params, step; slim: params, step) and split into 16 contiguous
chunks saved with np.savez (arr_0, arr_1, ...). The params are therefore the last leaves before the final step leaf,
whatever the optimizer state held; their order is the haiku names sorted. Members are read lazily from the zip files
(local or gs://, `npz.Archive`), a leaf's shards by several threads at once, each into its place in the global array,
so memory holds one leaf's global array. bfloat16 was saved as numpy void 'V2'.
"""
from __future__ import annotations

import bisect
import logging
import re
import threading
from collections.abc import Callable, Iterator
from functools import partial

import ml_dtypes
import numpy as np

from mesh_transformer.model import table
from mesh_transformer.store import checkpoint_format, npz
from mesh_transformer import storage
from mesh_transformer.config import Config, ConfigError

log = logging.getLogger(__name__)

N_FILES = 16
_ROOT = "causal_transformer_shard/~/"
_SHARD_DIR = re.compile(r"^shard_(\d+)$")
SUM, FIRST = "sum", "first"  # besides an axis to concatenate on: pieces summed (per-shard biases), or shard 0's copy
_BF16, _SAVED_BF16 = np.dtype(ml_dtypes.bfloat16), np.dtype("V2")  # how numpy saved jax's bfloat16

# our path inside a layer -> (haiku module inside layer_i, haiku leaf, how the shards' pieces combine)
_LAYER_LEAVES = {
    ("ln_1", "scale"): ("replicated_layer_norm", "scale", FIRST),
    ("ln_1", "bias"): ("replicated_layer_norm", "offset", FIRST),
    ("attn", "q"): ("linear", "w", -1),
    ("attn", "v"): ("linear_1", "w", -1),
    ("attn", "k"): ("linear_2", "w", -1),
    ("attn", "out"): ("linear_3", "w", 0),
    ("mlp", "fc_in", "kernel"): ("linear_4", "w", -1),
    ("mlp", "fc_in", "bias"): ("linear_4", "b", 0),
    ("mlp", "fc_out", "kernel"): ("linear_5", "w", 0),
    ("mlp", "fc_out", "bias"): ("linear_5", "b", SUM),
}
_EMBED = "embedding_shard/~/linear"  # w: this shard's vocab rows; b: a per-shard bias, summed, added to every row
_TOP_LEAVES = {
    ("embed", "wte"): (_EMBED, "w", 0),
    ("ln_f", "scale"): ("projection_shard/~/replicated_layer_norm", "scale", FIRST),
    ("ln_f", "bias"): ("projection_shard/~/replicated_layer_norm", "offset", FIRST),
    ("lm_head", "kernel"): ("projection_shard/~/linear", "w", -1),
    ("lm_head", "bias"): ("projection_shard/~/linear", "b", 0),
}


def check_params(cfg: Config) -> None:
    """The original layout holds GPT-J's params (the mesh-transformer-jax model): a ConfigError for a config whose
    param table is another."""
    ours = {path for path, _ in table.param_paths(cfg)}
    held = {("layers", *path) for path in _LAYER_LEAVES} | set(_TOP_LEAVES)
    if ours != held:
        raise ConfigError(f"the original mesh-transformer-jax checkpoint layout holds GPT-J's params, not the "
                          f"{cfg.family} family's: convert from an HF directory or one of our checkpoints")


def param_leaf_names(n_layers: int) -> list[str]:
    """The original's param leaf names in its flattening order: module names sorted, then leaf names sorted."""
    leaves = {(module, leaf) for module, leaf, _ in _TOP_LEAVES.values()} | {(_EMBED, "b")}
    leaves |= {(f"layer_{i}/~/{module}", leaf) for i in range(n_layers) for module, leaf, _ in _LAYER_LEAVES.values()}
    return [f"{_ROOT}{module}/{leaf}" for module, leaf in sorted(leaves)]


def _leaf_name(path: tuple[str, ...], layer: int | None) -> tuple[str, str | int]:
    """(original leaf name, how shards combine) of our param `path` (in layer `layer` for stacked ones)."""
    if path[0] == "layers":
        module, leaf, combine = _LAYER_LEAVES[path[1:]]
        return f"{_ROOT}layer_{layer}/~/{module}/{leaf}", combine
    module, leaf, combine = _TOP_LEAVES[path]
    return f"{_ROOT}{module}/{leaf}", combine


def param_paths() -> list[tuple[str, ...]]:
    """Our param paths, in the order `iter_params` yields them."""
    return [*_TOP_LEAVES, *(("layers", *path) for path in _LAYER_LEAVES)]


def _piece_shape(shape: tuple[int, ...], combine: str | int, n_shards: int) -> tuple[int, ...]:
    if combine in (SUM, FIRST):
        return shape
    axis = combine % len(shape)
    return tuple(n // n_shards if d == axis else n for d, n in enumerate(shape))


def resolve_step_dir(path: str) -> str | None:
    """The step directory of an MTJ v1 checkpoint given as that directory or as its model dir (latest step)."""
    path = path.rstrip("/")
    if storage.exists(storage.join(path, "shard_0")):
        return path
    steps = sorted((step, name) for name in storage.listdir(path)
                   if (step := checkpoint_format.parse_step_dir(name)) is not None)
    for _, name in reversed(steps):
        if storage.exists(storage.join(path, name, "shard_0")):
            return storage.join(path, name)
    return None


def is_mtj_v1(path: str) -> bool:
    """Whether `path` holds an original mesh-transformer-jax checkpoint (a step dir or a model dir of them)."""
    return resolve_step_dir(path) is not None


def stack_layers(read_layer: Callable[[int], np.ndarray], shape: tuple[int, ...], dtype=None) -> np.ndarray:
    """A stacked [L, ...] param filled from per-layer reads, in `dtype` (default: the layers' own)."""
    first = read_layer(0)
    out = np.empty(shape, first.dtype if dtype is None else dtype)
    out[0] = first
    for i in range(1, shape[0]):
        out[i] = read_layer(i)
    return out


def _n_members(archive: npz.Archive) -> int:
    return sum(1 for name in archive.names() if name.startswith("arr_"))


def _first_mismatch(found: list[tuple], n_shards: int) -> tuple | None:
    """The first (name, global shape, combine, piece shape, where) whose piece shape is wrong for n_shards."""
    return next((leaf for leaf in found if tuple(leaf[3]) != _piece_shape(leaf[1], leaf[2], n_shards)), None)


def _count_shards(step_dir: str, expected: int | None) -> int:
    found = sorted(int(m.group(1)) for name in storage.listdir(step_dir) if (m := _SHARD_DIR.match(name)))
    n_shards = found[-1] + 1 if found else 0
    missing = sorted(set(range(n_shards)) - set(found))
    if missing or not found:
        shard = storage.join(step_dir, f"shard_{missing[0] if missing else 0}")
        raise FileNotFoundError(f"MTJ v1 checkpoint shard directory {shard} is missing")
    if expected is not None and expected != n_shards:
        raise ConfigError(f"MTJ v1 checkpoint {step_dir} has {n_shards} shards (shard_0..shard_{n_shards - 1}), "
                          f"expected {expected}")
    return n_shards


class Reader:
    """An open MTJ v1 checkpoint: `read(path, layer)` gives one of our params, or one layer of it, as numpy.

    The shard count is the number of shard_i directories (`shards` asserts it); every param leaf's shape on shard 0
    is checked against the config before anything is read, and each shard's piece when it is read.
    """

    def __init__(self, path: str, cfg: Config, shards: int | None = None):
        step_dir = resolve_step_dir(path)
        if step_dir is None:
            raise FileNotFoundError(f"no MTJ v1 checkpoint (step_N/shard_0/0.npz) at {path}")
        check_params(cfg)
        self.path, self.cfg = step_dir, cfg
        self.n_shards = _count_shards(step_dir, shards)
        self._archives: dict[tuple[int, int], npz.Archive] = {}
        self._opening = threading.Lock()
        self._threads = checkpoint_format.Threads("mtj-v1-read")  # a leaf's shards read at once
        counts = [_n_members(self._archive(0, f)) for f in range(N_FILES)]
        self._file_starts = list(np.cumsum([0, *counts[:-1]]))
        names = param_leaf_names(cfg.layers)
        first = sum(counts) - 1 - len(names)  # params sit just before the final step leaf
        if first < 0:
            raise ConfigError(f"MTJ v1 checkpoint {step_dir} holds {sum(counts)} leaves per shard, fewer than the "
                              f"{len(names) + 1} a {cfg.layers}-layer model needs: the config does not match the "
                              f"checkpoint")
        self._leaf_index = {name: first + i for i, name in enumerate(names)}
        self._file_counts = counts
        self._shapes = {path: like.shape for path, like in table.param_paths(cfg)}
        self._check_shapes()
        step = checkpoint_format.parse_step_dir(step_dir.rstrip("/").rpartition("/")[2])
        self.step = step if step is not None else int(np.asarray(self._load(0, sum(counts) - 1)).reshape(-1)[0])
        log.info("MTJ v1 checkpoint %s: %d shards, %d leaves per shard (%d before the params)", step_dir,
                 self.n_shards, sum(counts), first)

    # ------------------------------------------------------------------------------------------------- raw leaves
    def _file(self, shard: int, file: int) -> str:
        return storage.join(self.path, f"shard_{shard}", f"{file}.npz")

    def _archive(self, shard: int, file: int) -> npz.Archive:
        with self._opening:  # shards' threads open their files at once
            if (shard, file) not in self._archives:
                try:
                    archive = npz.Archive(self._file(shard, file))
                except FileNotFoundError:
                    raise FileNotFoundError(f"MTJ v1 checkpoint file {self._file(shard, file)} is missing") from None
                if shard and _n_members(archive) != self._file_counts[file]:
                    archive.close()
                    raise ConfigError(f"MTJ v1 checkpoint file {self._file(shard, file)} holds a different number "
                                      f"of leaves than shard_0's ({self._file_counts[file]})")
                self._archives[shard, file] = archive
            return self._archives[shard, file]

    def _member(self, shard: int, leaf_index: int) -> tuple[npz.Archive, str, str]:
        file = bisect.bisect_right(self._file_starts, leaf_index) - 1
        member = f"arr_{leaf_index - self._file_starts[file]}.npy"
        return self._archive(shard, file), member, f"{self._file(shard, file)}:{member}"

    def _header(self, shard: int, leaf_index: int) -> tuple[tuple[int, ...], np.dtype, str]:
        """(shape, dtype, where) of one shard's piece of a leaf, bfloat16 as such."""
        archive, member, where = self._member(shard, leaf_index)
        stored = archive.member(member)
        return stored.shape, _BF16 if stored.dtype == _SAVED_BF16 else stored.dtype, where

    def _load(self, shard: int, leaf_index: int, out: np.ndarray | None = None) -> np.ndarray:
        """One shard's piece of a leaf, bfloat16 as such; into `out` where given (contiguous, of the piece's size)."""
        archive, member, _ = self._member(shard, leaf_index)
        array = archive.read(member, out)
        return array.view(_BF16) if array.dtype == _SAVED_BF16 else array

    def _leaves(self) -> Iterator[tuple[str, tuple[int, ...], str | int]]:
        """(original leaf name, its global shape, how shards combine) for every param leaf."""
        yield f"{_ROOT}{_EMBED}/b", (self.cfg.d_model,), SUM
        for path in param_paths():
            shape = self._shapes[path]
            for layer in range(self.cfg.layers) if path[0] == "layers" else [None]:
                name, combine = _leaf_name(path, layer)
                yield name, shape[1:] if path[0] == "layers" else shape, combine

    def _check_shapes(self) -> None:
        """Shard 0's param leaves against the config, telling a wrong shard count from a wrong config."""
        found = [(name, shape, combine, *self._header(0, self._leaf_index[name])[::2])
                 for name, shape, combine in self._leaves()]
        bad = _first_mismatch(found, self.n_shards)
        if bad is None:
            return
        name, shape, combine, got, where = bad
        axis = None if combine in (SUM, FIRST) else combine % len(shape)
        implied = shape[axis] // got[axis] if axis is not None and len(got) == len(shape) and got[axis] and \
            shape[axis] % got[axis] == 0 else None
        if implied and _first_mismatch(found, implied) is None:
            raise ConfigError(f"MTJ v1 checkpoint {self.path} was written with {implied} shards (leaf {name} holds "
                              f"1/{implied} of its array), but {self.n_shards} shard directories were found")
        self._check_piece(name, shape, combine, got, where)

    def _check_piece(self, name: str, shape: tuple[int, ...], combine: str | int, got: tuple[int, ...],
                     where: str) -> None:
        want = _piece_shape(shape, combine, self.n_shards)
        if tuple(got) != want:
            cfg = self.cfg
            raise ConfigError(f"MTJ v1 leaf {name} ({where}) has shape {tuple(got)}, the config (layers {cfg.layers}, "
                              f"d_model {cfg.d_model}, n_vocab {cfg.n_vocab}) with {self.n_shards} shards needs "
                              f"{want}: the config does not match the checkpoint")

    # --------------------------------------------------------------------------------------------------- our params
    def _piece(self, name: str, shape: tuple[int, ...], combine: str | int, shard: int,
               out: np.ndarray | None = None) -> np.ndarray:
        """One shard's piece of an original leaf, its shape checked first; read into `out` where given."""
        leaf_index = self._leaf_index[name]
        got, _, _ = self._header(shard, leaf_index)
        self._check_piece(name, shape, combine, got, f"shard_{shard}")
        return self._load(shard, leaf_index, out)

    def _pieces(self, name: str, shape: tuple[int, ...], combine: str | int) -> list[np.ndarray]:
        """Every shard's piece (shard 0's alone where they are copies), read at once, in shard order."""
        shards = range(1 if combine == FIRST else self.n_shards)
        return self._threads.map(partial(self._piece, name, shape, combine), [(shard,) for shard in shards])

    def _sum_f32(self, name: str, shape: tuple[int, ...]) -> tuple[np.ndarray, np.dtype]:
        """A per-shard bias summed over shards in f32 (in shard order), and its stored dtype."""
        total, dtype = np.zeros(shape, np.float32), np.dtype(np.float32)
        for piece in self._pieces(name, shape, SUM):
            total += piece.astype(np.float32)
            dtype = piece.dtype
        return total, dtype

    def _combined(self, name: str, shape: tuple[int, ...], combine: str | int,
                  add_f32: np.ndarray | None = None) -> np.ndarray:
        """The global array of one original leaf, in its stored dtype; sums and `add_f32` are done in f32. The
        shards' pieces are read at once, each straight into its rows of the array where they are contiguous there."""
        if combine == SUM:
            total, dtype = self._sum_f32(name, shape)
            return total.astype(dtype)
        if combine == FIRST:
            return self._piece(name, shape, combine, 0)
        out = np.empty(shape, self._header(0, self._leaf_index[name])[1])
        axis = combine % len(shape)
        size = shape[axis] // self.n_shards

        def place(shard: int) -> None:
            target = out[(slice(None),) * axis + (slice(shard * size, (shard + 1) * size),)]
            if add_f32 is None and target.flags.c_contiguous:
                self._piece(name, shape, combine, shard, target)
                return
            piece = self._piece(name, shape, combine, shard)
            target[...] = piece if add_f32 is None else (piece.astype(np.float32) + add_f32).astype(piece.dtype)

        self._threads.map(place, [(shard,) for shard in range(self.n_shards)])
        return out

    def read(self, path: tuple[str, ...], layer: int | None = None) -> np.ndarray:
        """One of our params as a global numpy array in the stored dtype (for stacked ones, layer `layer` or all)."""
        shape = self._shapes[path]
        if path[0] == "layers" and layer is None:
            return stack_layers(lambda i: self.read(path, i), shape)
        if path[0] == "layers":
            shape = shape[1:]
        name, combine = _leaf_name(path, layer)
        bias = None
        if path == ("embed", "wte"):  # HF has no embedding bias: it is the same for every id, so fold it in
            bias = self._sum_f32(f"{_ROOT}{_EMBED}/b", (self.cfg.d_model,))[0]
        return self._combined(name, shape, combine, bias)

    def close(self) -> None:
        self._threads.close()
        for archive in self._archives.values():
            archive.close()
        self._archives.clear()

    def __enter__(self) -> Reader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def iter_params(path: str, cfg: Config, shards: int | None = None) -> Iterator[tuple[tuple[str, ...], np.ndarray]]:
    """(our param path, global numpy array) for every param of an MTJ v1 checkpoint, one array at a time."""
    with Reader(path, cfg, shards) as reader:
        for param in param_paths():
            yield param, reader.read(param)
