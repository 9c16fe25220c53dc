"""Large arrays put on the devices a block of leading rows at a time (a stacked param one layer at a time): the host
holds one block, the devices the array and one block, and the block's conversion to the array's dtype runs on the
devices. Loading a fine-tune's base, resuming a train state and restoring a checkpoint go through here."""
from __future__ import annotations

import functools
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Sharding

ROWS_BYTES = 256 << 20  # arrays larger than this (per device) whose rows are not split go a block at a time


def by_rows(shape: tuple[int, ...], dtype, sharding: Sharding) -> bool:
    """Whether an array of `shape` placed by `sharding` is put a block of rows at a time: larger than ROWS_BYTES
    on a device, and its leading axis whole on every device."""
    per_device = math.prod(sharding.shard_shape(shape)) * np.dtype(dtype).itemsize
    return len(shape) >= 2 and rows_whole(shape, sharding) and per_device > ROWS_BYTES


def rows_whole(shape: tuple[int, ...], sharding: Sharding) -> bool:
    """Whether every device holds whole rows: the leading axis is not split."""
    return bool(shape) and sharding.shard_shape(shape)[0] == shape[0]


def put(shape: tuple[int, ...], dtype, sharding: Sharding, read: Callable[[tuple], np.ndarray]) -> jax.Array:
    """The global array of `shape` and `dtype` placed by `sharding`, each device's slice read by `read(index)` (a
    tuple of slices of the global array): `jax.make_array_from_callback`, but where `by_rows` says so, in blocks of
    rows (`rows_per_block`), each block converted on the devices and written into the array in place."""
    if not by_rows(shape, dtype, sharding):
        return jax.make_array_from_callback(shape, sharding, lambda index: _cast(read(index), dtype))
    out = _zeros(shape, np.dtype(dtype), sharding)
    rows = rows_per_block(shape, dtype, sharding)
    for start in range(0, shape[0], rows):
        stop = min(shape[0], start + rows)
        block = jax.make_array_from_callback(
            (stop - start, *shape[1:]), sharding,
            lambda index, start=start, stop=stop: read((slice(start, stop), *index[1:])))
        out = write_rows(out, block, start)
    return out


def put_host(x: np.ndarray, sharding: Sharding) -> jax.Array:
    """A global host array on the devices by `sharding`, each device given only its slice (on every process)."""
    return put(x.shape, x.dtype, sharding, lambda index: x[index])


def put_layers(shape: tuple[int, ...], dtype, sharding: Sharding, read_layer: Callable[[int], np.ndarray]) -> jax.Array:
    """A stacked [L, ...] array placed one layer at a time from `read_layer(i)` (a whole layer on the host, in any
    dtype), converted to `dtype` on the devices. Where the layers are split over devices, the layers are stacked on
    the host first."""
    if not rows_whole(shape, sharding):
        host = np.stack([_cast(read_layer(i), dtype) for i in range(shape[0])])
        return jax.make_array_from_callback(shape, sharding, lambda index: host[index])
    out = _zeros(shape, np.dtype(dtype), sharding)
    for i in range(shape[0]):
        layer = read_layer(i)
        block = jax.make_array_from_callback((1, *shape[1:]), sharding, lambda index, x=layer: x[index[1:]][None])
        out = write_rows(out, block, i)
        del layer, block
    return out


def rows_per_block(shape: tuple[int, ...], dtype, sharding: Sharding) -> int:
    """Rows per block: as many as fit in ROWS_BYTES on a device, at least one."""
    row_bytes = math.prod(sharding.shard_shape(shape)[1:]) * np.dtype(dtype).itemsize
    return max(1, ROWS_BYTES // max(1, row_bytes))


def programs(like: jax.ShapeDtypeStruct, block_dtype=np.float32) -> list[tuple[Callable, tuple]]:
    """The programs `put` and `put_layers` run for an array like `like` (a sharded ShapeDtypeStruct) with blocks of
    one row in `block_dtype`, each with its abstract arguments: what the fit check compiles for a target."""
    if like.ndim < 2 or not rows_whole(like.shape, like.sharding):
        return []
    block = jax.ShapeDtypeStruct((1, *like.shape[1:]), block_dtype, sharding=like.sharding)
    return [(zeros_fn(tuple(like.shape), np.dtype(like.dtype), like.sharding), ()), (write_rows, (like, block, 0))]


def _cast(x: np.ndarray, dtype) -> np.ndarray:
    return x if x.dtype == np.dtype(dtype) else x.astype(dtype)


@functools.cache
def zeros_fn(shape: tuple[int, ...], dtype: np.dtype, sharding: Sharding):
    return jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=sharding)


def _zeros(shape: tuple[int, ...], dtype: np.dtype, sharding: Sharding) -> jax.Array:
    return zeros_fn(tuple(shape), dtype, sharding)()


@functools.partial(jax.jit, donate_argnums=0)
def write_rows(out: jax.Array, block: jax.Array, start) -> jax.Array:
    """out[start:start + len(block)] = block in out's dtype, in place (out is donated); one program per shape."""
    return lax.dynamic_update_slice_in_dim(out, block.astype(out.dtype), start, 0)

