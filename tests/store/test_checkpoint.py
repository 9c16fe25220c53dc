"""Checkpoints: round trips across meshes, subtrees, atomic commit, retention, checksums, async isolation, GCS."""
from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import sys
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, SingleDeviceSharding
from jax.sharding import PartitionSpec as P

from mesh_transformer import storage
from mesh_transformer.store import checkpoint
from tests.gcs_emulator import create_bucket, gcs_emulator

# Saved layout on a ('dp', 'mp') 2x4 mesh: leaf -> (shape, dtype, spec).
LAYOUT = {
    "params": {
        "col": ((4, 16), jnp.float32, P(None, "mp")),
        "row": ((8, 4), jnp.float32, P("mp", None)),
        "rep": ((3, 5), jnp.float32, P()),
        "half": ((8, 8), jnp.bfloat16, P("dp", "mp")),
    },
    "opt_state": {"mu": ((8, 16), jnp.float32, P("dp", "mp")), "count": ((), jnp.int32, P())},
}


def _mesh(dp: int, mp: int) -> Mesh:
    return Mesh(np.array(jax.devices()[: dp * mp]).reshape(dp, mp), ("dp", "mp"))


def _is_spec(x: object) -> bool:
    return isinstance(x, tuple) and len(x) == 3 and isinstance(x[2], P)


def _host_tree() -> dict:
    rng = np.random.default_rng(0)
    return jax.tree.map(lambda s: (rng.standard_normal(s[0]) * 100).astype(s[1]), LAYOUT, is_leaf=_is_spec)


def _device_tree(host: dict, mesh: Mesh) -> dict:
    placed = jax.tree.map(lambda h, s: jax.device_put(h, NamedSharding(mesh, s[2])), host, LAYOUT,
                          is_leaf=_is_spec)
    return {**placed, "step": 7}


def _target(sharding_for, layout: dict = LAYOUT, dtype=None) -> dict:
    return jax.tree.map(lambda s: jax.ShapeDtypeStruct(s[0], dtype or s[1], sharding=sharding_for(s[2])), layout,
                        is_leaf=_is_spec)


def _assert_tree_equal(restored: dict, host: dict) -> None:
    jax.tree.map(lambda r, h: np.testing.assert_array_equal(np.asarray(r), h), restored, host)


@pytest.fixture
def saved(tmp_path) -> tuple[str, dict]:
    """A committed step 1 of the LAYOUT tree saved from a 2x4 mesh; returns (root, host copy)."""
    root = str(tmp_path / "run")
    host = _host_tree()
    checkpoint.save(root, 1, _device_tree(host, _mesh(2, 4)), {"config": {"layers": 2}}, blocking=True)
    return root, host


TARGETS = {
    "8x1": lambda spec: NamedSharding(_mesh(8, 1), spec),
    "4x2-axes-swapped": lambda spec: NamedSharding(_mesh(4, 2), P(*({"dp": "mp", "mp": "dp"}.get(a) for a in spec))),
    "1x8": lambda spec: NamedSharding(_mesh(1, 8), spec),
    "single-device": lambda spec: SingleDeviceSharding(jax.devices()[3]),
}


@pytest.mark.parametrize("name", TARGETS)
def test_round_trip_onto_other_mesh_is_exact(saved, name):
    root, host = saved
    target = {**_target(TARGETS[name]), "step": 0}
    restored, metadata = checkpoint.restore(root, 1, target)
    assert restored["step"] == 7
    assert metadata == {"config": {"layers": 2}}
    restored.pop("step")
    _assert_tree_equal(restored, host)
    for array, like in zip(jax.tree.leaves(restored), jax.tree.leaves(target)):
        assert array.sharding.is_equivalent_to(like.sharding, array.ndim) and array.dtype == like.dtype


def test_subtree_restore_never_reads_other_leaves(saved):
    root, host = saved
    storage.remove_tree(os.path.join(checkpoint.step_dir(root, 1), "arrays", "opt_state"))
    target = _target(TARGETS["1x8"], LAYOUT["params"])
    params, _ = checkpoint.restore(root, 1, target, paths_prefix="params")
    _assert_tree_equal(params, host["params"])


def test_restore_casts_to_target_dtype(saved):
    root, host = saved
    target = _target(TARGETS["8x1"], LAYOUT["params"], jnp.float32)
    params, _ = checkpoint.restore(root, 1, target, paths_prefix="params")
    assert params["half"].dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(params["half"]), host["params"]["half"].astype(np.float32))


def test_shape_mismatch_names_the_leaf(saved):
    root, _ = saved
    target = {"params": {"col": jax.ShapeDtypeStruct((4, 8), jnp.float32, sharding=TARGETS["8x1"](P()))}}
    with pytest.raises(ValueError, match="params/col.*shape"):
        checkpoint.restore(root, 1, target)


def test_missing_piece_names_the_file(saved):
    root, _ = saved
    piece = next(storage.walk_files(os.path.join(checkpoint.step_dir(root, 1), "arrays", "params", "row")))
    os.remove(piece)
    with pytest.raises(checkpoint.MissingPieceError, match=piece):
        checkpoint.restore(root, 1, _target(TARGETS["1x8"]))


def test_half_written_step_is_ignored_then_cleaned_up(saved):
    root, host = saved
    tree = _device_tree(host, _mesh(2, 4))
    checkpoint.save(root, 2, tree, blocking=True)
    os.remove(os.path.join(checkpoint.step_dir(root, 2), checkpoint.COMMIT_NAME))  # a crash before the commit
    assert checkpoint.latest_step(root) == 1 and checkpoint.list_steps(root) == [1]
    checkpoint.save(root, 3, tree, blocking=True)
    assert not os.path.exists(checkpoint.step_dir(root, 2))
    assert checkpoint.list_steps(root) == [1, 3]


def test_retention_keeps_last_and_every(tmp_path):
    root = str(tmp_path / "run")
    tree = {"w": jnp.arange(4.0)}
    checkpointer = checkpoint.Checkpointer(root, keep_last=2, keep_every=3)
    for step in range(1, 8):
        checkpointer.save(step, tree)
    checkpointer.wait()
    assert checkpoint.list_steps(root) == [3, 6, 7]
    assert sorted(os.listdir(root)) == ["step_3", "step_6", "step_7"]


def test_flipped_byte_is_a_checksum_error_and_restore_falls_back(saved, caplog):
    root, host = saved
    changed = jax.tree.map(lambda h: h + 1, host)
    checkpoint.save(root, 2, _device_tree(changed, _mesh(2, 4)), blocking=True)
    piece = next(storage.walk_files(os.path.join(checkpoint.step_dir(root, 2), "arrays", "params", "col")))
    with open(piece, "r+b") as f:  # the last byte is array data, not the .npy header
        f.seek(-1, os.SEEK_END)
        last = f.read(1)
        f.seek(-1, os.SEEK_END)
        f.write(bytes([last[0] ^ 0xFF]))
    target = _target(TARGETS["8x1"])
    with pytest.raises(checkpoint.ChecksumError, match=piece):
        checkpoint.restore(root, 2, target)
    with caplog.at_level(logging.WARNING, logger=checkpoint.__name__):
        step, restored, _ = checkpoint.restore_latest_valid(root, target)
    assert step == 1 and "falling back" in caplog.text
    _assert_tree_equal(restored, host)


def test_async_save_keeps_the_values_at_call_time(tmp_path, monkeypatch):
    root = str(tmp_path / "run")
    host = _host_tree()
    tree = _device_tree(host, _mesh(2, 4))
    donated = threading.Event()
    real_open = storage.open_file

    def open_after_donation(path, mode="rb"):
        assert donated.wait(timeout=30)  # the writer thread may only start once the source buffers are reused
        return real_open(path, mode)

    monkeypatch.setattr(storage, "open_file", open_after_donation)
    handle = checkpoint.Checkpointer(root).save(1, tree)
    overwrite = jax.jit(lambda t: jax.tree.map(lambda x: x * 0 + 1, t), donate_argnums=0)
    overwritten = overwrite({k: v for k, v in tree.items() if k != "step"})
    jax.block_until_ready(overwritten)
    donated.set()
    handle.wait()
    restored, _ = checkpoint.restore(root, 1, _target(TARGETS["1x8"]))
    _assert_tree_equal(restored, host)


def test_write_error_is_raised_by_wait_and_nothing_is_committed(tmp_path, monkeypatch):
    root = str(tmp_path / "run")

    def broken_open(path, mode="rb"):
        raise OSError(f"disk full writing {path}")

    monkeypatch.setattr(storage, "open_file", broken_open)
    checkpointer = checkpoint.Checkpointer(root)
    handle = checkpointer.save(1, {"w": jnp.ones(3)})
    with pytest.raises(OSError, match="disk full"):
        handle.wait()
    checkpointer.wait()  # already reported through the handle: not raised twice
    assert checkpoint.latest_step(root) is None


def test_index_records_paths_shapes_dtypes_and_checksums(saved):
    root, _ = saved
    with open(os.path.join(checkpoint.step_dir(root, 1), "index_p0.json")) as f:
        index = json.load(f)
    half = index["leaves"]["params/half"]
    assert half["shape"] == [8, 8] and half["dtype"] == "bfloat16" and len(half["pieces"]) == 8
    assert all(len(p["sha256"]) == 64 for p in half["pieces"])
    assert len(index["leaves"]["params/rep"]["pieces"]) == 1  # replicas are written once
    assert index["leaves"]["step"] == {"value": 7}
    assert checkpoint.read_metadata(root, 1) == {"config": {"layers": 2}}


_TWO_PROCESS_SAVE = """
import sys
import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from mesh_transformer.store import checkpoint
process, port, root = int(sys.argv[1]), sys.argv[2], sys.argv[3]
jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=process)
mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("dp", "mp"))  # dp rows are processes
full = np.arange(128, dtype=np.float32).reshape(8, 16)
specs = {"both": P("dp", "mp"), "cols": P(None, "mp"), "rep": P()}
tree = {k: jax.make_array_from_callback(full.shape, NamedSharding(mesh, s), lambda i: full[i])
        for k, s in specs.items()}
checkpoint.save(root, 1, tree, {"processes": 2}, blocking=True)
jax.distributed.shutdown()
"""


def test_two_processes_write_their_own_pieces_under_one_commit(tmp_path):
    root = str(tmp_path / "run")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    env = {**os.environ, "JAX_PLATFORMS": "cpu",
           "XLA_FLAGS": "--xla_force_host_platform_device_count=4 --xla_backend_optimization_level=0",
           "PYTHONPATH": os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))}
    workers = [subprocess.Popen([sys.executable, "-c", _TWO_PROCESS_SAVE, str(k), port, root], env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT) for k in range(2)]
    for worker in workers:
        output = worker.communicate(timeout=120)[0].decode(errors="replace")
        assert worker.returncode == 0, output[-3000:]
    indexes = [json.loads(storage.read_bytes(os.path.join(root, "step_1", f"index_p{k}.json"))) for k in range(2)]
    pieces = {leaf: [len(index["leaves"][leaf]["pieces"]) for index in indexes] for leaf in ("both", "cols", "rep")}
    assert pieces == {"both": [4, 4], "cols": [4, 0], "rep": [1, 0]}
    target = jax.ShapeDtypeStruct((8, 16), jnp.float32, sharding=TARGETS["1x8"](P("mp")))
    restored, metadata = checkpoint.restore(root, 1, {"both": target, "cols": target, "rep": target})
    assert metadata == {"processes": 2}
    for array in restored.values():
        np.testing.assert_array_equal(np.asarray(array), np.arange(128, dtype=np.float32).reshape(8, 16))


@pytest.fixture(scope="module")
def gcs_bucket() -> str:
    with gcs_emulator() as url:
        create_bucket(url, "bucket")
        yield "bucket"


def test_round_trip_through_gcs_emulator(gcs_bucket):
    root = f"gs://{gcs_bucket}/run"
    host = _host_tree()
    tree = _device_tree(host, _mesh(2, 4))
    checkpointer = checkpoint.Checkpointer(root, keep_last=2)
    for step in (1, 2, 3):
        checkpointer.save(step, tree, {"data": {"position": step}})
    checkpointer.wait()
    assert checkpoint.list_steps(root) == [2, 3]
    restored, metadata = checkpoint.restore(root, 3, {**_target(TARGETS["4x2-axes-swapped"]), "step": 0})
    assert metadata == {"data": {"position": 3}} and restored.pop("step") == 7
    _assert_tree_equal(restored, host)


# A checkpoint written by the first version of the format (tests/store/data/checkpoint_v1, committed with the
# code that wrote it): every later version must still restore it bit for bit.
V1_ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "checkpoint_v1")
V1_METADATA = {"config": {"layers": 2, "d_model": 8}, "data_state": {"position": 12}}


def _v1_tree(mesh: Mesh) -> dict:
    """The tree saved as step 3 of V1_ROOT from a 2x4 mesh (so its leaves are split into several pieces)."""
    kernel = np.arange(32, dtype=np.float32).reshape(4, 8) / 7  # thirds and sevenths: every bit counts
    bias = np.linspace(-1, 1, 8, dtype=np.float32) / 3
    half = (np.arange(16, dtype=np.float32).reshape(4, 4) / 9).astype(jnp.bfloat16)
    params = {"kernel": jax.device_put(kernel, NamedSharding(mesh, P(None, "mp"))),
              "bias": jax.device_put(bias, NamedSharding(mesh, P())),
              "half": jax.device_put(half, NamedSharding(mesh, P("dp", None)))}
    opt_state = {"count": jax.device_put(np.int32(3), NamedSharding(mesh, P())),
                 "mu": {"kernel": jax.device_put(kernel * -2, NamedSharding(mesh, P("dp", "mp")))},
                 "schedule": "cosine"}
    return {"step": jax.device_put(np.int32(3), NamedSharding(mesh, P())), "params": params, "opt_state": opt_state}


def test_checkpoint_written_by_format_v1_restores_bitwise_with_its_metadata():
    expected = _v1_tree(_mesh(2, 4))
    assert checkpoint.list_steps(V1_ROOT) == [3]
    target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=TARGETS["1x8"](P()))
                          if isinstance(x, jax.Array) else x, expected)
    restored, metadata = checkpoint.restore(V1_ROOT, 3, target)
    assert metadata == V1_METADATA and checkpoint.read_metadata(V1_ROOT, 3) == V1_METADATA
    assert restored["opt_state"]["schedule"] == "cosine"
    for got, want in zip(jax.tree.leaves(restored), jax.tree.leaves(expected)):
        if isinstance(want, jax.Array):
            got, want = np.asarray(got), np.asarray(want)
            assert got.dtype == want.dtype and got.shape == want.shape
            np.testing.assert_array_equal(got.reshape(-1).view(np.uint8), want.reshape(-1).view(np.uint8))


def test_files_written_atomically_get_the_permissions_of_plain_files(tmp_path):
    plain, atomic = tmp_path / "plain", tmp_path / "atomic"
    plain.write_bytes(b"x")
    storage.write_bytes_atomic(str(atomic), b"x")
    assert (atomic.stat().st_mode & 0o777) == (plain.stat().st_mode & 0o777)


def test_slices_read_one_after_another_hash_each_piece_file_once(saved, monkeypatch):
    from mesh_transformer.store import checkpoint_format

    root, host = saved
    hashed = []
    real = checkpoint_format._sha256_file
    monkeypatch.setattr(checkpoint_format, "_sha256_file", lambda path: hashed.append(path) or real(path))
    leaves, _ = checkpoint_format.read_index(root, 1)
    reader = checkpoint_format.PieceReader(checkpoint.step_dir(root, 1))
    leaf = next(name for name, entry in leaves.items() if len(entry.get("shape", ())) >= 2)
    entry = leaves[leaf]
    rest = (slice(None),) * (len(entry["shape"]) - 1)
    rows = [reader.read_slice(leaf, entry, (slice(i, i + 1), *rest), np.dtype(entry["dtype"])) for i in
            range(entry["shape"][0])]
    reader.forget()  # as after each layer
    again = reader.read_slice(leaf, entry, None, np.dtype(entry["dtype"]))
    np.testing.assert_array_equal(np.concatenate(rows), again)
    assert len(hashed) == len(set(hashed)) == len({p["file"] for p in entry["pieces"]})
