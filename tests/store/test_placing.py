"""Large arrays placed a block of rows at a time: equal to placing them whole, on several meshes, with the host
asked for one block at a time."""
import jax
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from mesh_transformer.parallel.mesh import make_mesh
from mesh_transformer.store import placing

MESHES = [({"dp": 1, "mp": 1}, P(None, None, "mp")), ({"dp": 2, "mp": 4}, P(None, None, "mp")),
          ({"dp": 2, "mp": 4}, P(None, "mp", None)), ({"dp": 8, "mp": 1}, P(None, "dp"))]


@pytest.mark.parametrize("shape, spec", MESHES)
def test_an_array_put_a_block_of_rows_at_a_time_equals_it_put_whole(monkeypatch, shape, spec):
    sharding = NamedSharding(make_mesh(shape), spec)
    host = np.random.default_rng(0).normal(size=(6, 8, 16)).astype(np.float32)
    monkeypatch.setattr(placing, "ROWS_BYTES", 2 * 8 * 16 * 2)  # two rows of bf16 per device, at most
    rows_read = []

    def read(index):
        rows_read.append(len(range(*index[0].indices(6))))
        return host[index]

    dtype = np.dtype(ml_dtypes.bfloat16)
    assert placing.by_rows(host.shape, dtype, sharding) == (spec == P(None, None, "mp") and shape["mp"] == 1)
    placed = placing.put(host.shape, dtype, sharding, read)
    assert placed.sharding == sharding and placed.dtype == dtype
    np.testing.assert_array_equal(np.asarray(placed), host.astype(dtype))  # converted on the devices, as on the host
    if placing.by_rows(host.shape, dtype, sharding):
        assert max(rows_read) == placing.rows_per_block(host.shape, dtype, sharding) == 2


@pytest.mark.parametrize("shape, spec", MESHES)
def test_a_stacked_param_put_a_layer_at_a_time_equals_it_put_whole(shape, spec):
    sharding = NamedSharding(make_mesh(shape), spec)
    layers = np.random.default_rng(1).normal(size=(3, 8, 16)).astype(np.float32)
    asked = []
    placed = placing.put_layers(layers.shape, ml_dtypes.bfloat16, sharding, lambda i: asked.append(i) or layers[i])
    np.testing.assert_array_equal(np.asarray(placed), layers.astype(ml_dtypes.bfloat16))
    assert placed.sharding == sharding and asked == [0, 1, 2]


def test_layers_split_over_devices_are_stacked_on_the_host_first():
    sharding = NamedSharding(make_mesh({"dp": 2, "mp": 4}), P("dp", None))
    layers = np.arange(4 * 8, dtype=np.float32).reshape(4, 8)
    assert not placing.rows_whole(layers.shape, sharding)
    np.testing.assert_array_equal(np.asarray(placing.put_layers(layers.shape, np.float32, sharding,
                                                                lambda i: layers[i])), layers)


def test_a_block_is_written_in_place():
    sharding = NamedSharding(make_mesh({"dp": 1, "mp": 1}), P())
    out = placing.zeros_fn((4, 8), np.dtype(np.float32), sharding)()
    block = jax.device_put(np.ones((1, 8), np.float32), sharding)
    assert placing.write_rows.lower(out, block, 1).compile().memory_analysis().alias_size_in_bytes == out.nbytes


def test_a_checkpoint_restored_a_block_of_layers_at_a_time_equals_it_restored_whole(tmp_path, monkeypatch):
    from mesh_transformer.store import checkpoint

    mesh = make_mesh({"dp": 2, "mp": 4})
    host = {"stacked": np.random.default_rng(2).normal(size=(5, 8, 16)).astype(np.float32),
            "flat": np.arange(16, dtype=np.float32)}
    specs = {"stacked": P(None, None, "mp"), "flat": P("mp")}
    tree = {k: jax.device_put(v, NamedSharding(mesh, specs[k])) for k, v in host.items()}
    checkpoint.save(str(tmp_path), 1, tree, blocking=True)
    target = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=NamedSharding(make_mesh({"dp": 1, "mp": 1}), P()))
              for k, v in host.items()}
    whole, _ = checkpoint.restore(str(tmp_path), 1, target)
    monkeypatch.setattr(placing, "ROWS_BYTES", 8 * 16 * 4)  # one layer per block
    blocks, _ = checkpoint.restore(str(tmp_path), 1, target)
    for key in host:
        np.testing.assert_array_equal(np.asarray(blocks[key]), host[key])
        np.testing.assert_array_equal(np.asarray(whole[key]), host[key])
