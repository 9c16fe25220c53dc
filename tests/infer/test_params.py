"""Inference loading: the mesh fitted to the devices, checkpoints read straight into the decode form (one copy),
and the sampling CLI finding the config in the checkpoint itself."""
import dataclasses
import json
from functools import partial

import jax
import numpy as np
import pytest

from mesh_transformer import config
from mesh_transformer.config import ConfigError
from mesh_transformer.infer import params as infer_params
from mesh_transformer.infer.sampler import Sampler
from mesh_transformer.model import fused, table
from mesh_transformer.store import checkpoint, convert, hf, hf_export
from tests.helpers import original_shards, random_params, run_scripts, write_mtj_v1

# 2 layers, D 64, 8 heads, V 256, trained at mp 4.
CFG = config.load("configs/tiny_rot_partial.json", ["cores_per_replica=4", "remat=false"])
PROMPTS = [[5, 17, 42], [100, 3, 7, 9, 250, 11, 2]]


@pytest.mark.parametrize("n_devices, heads, vocab, cores, want", [
    (1, 16, 50400, 8, 1), (2, 16, 50400, 8, 2), (4, 16, 50400, 8, 4), (8, 16, 50400, 8, 8),
    (8, 16, 50400, 4, 4),  # the checkpoint's width divides the devices: kept
    (8, 6, 50400, 8, 2),  # 6 heads: the widest dividing 8 devices, 6 heads and the vocab
    (4, 12, 50257, 4, 1),  # an odd vocab splits nowhere
    (8, 12, 50400, 3, 4),  # 3 does not divide 8 devices
])
def test_the_mesh_width_fits_the_devices_heads_and_vocab(n_devices, heads, vocab, cores, want):
    cfg = config.from_dict({"d_model": 12 * heads, "n_heads": heads, "n_vocab": vocab, "pe_rotary_dims": 4,
                            "cores_per_replica": 1})
    cfg = dataclasses.replace(cfg, cores_per_replica=cores)  # as a checkpoint trained elsewhere may say
    assert infer_params.choose_mp(cfg, n_devices) == want


def test_an_impossible_mp_is_a_clear_error():
    with pytest.raises(ConfigError, match=r"--mp 3 must be at least 1 and divide the device count \(8\)"):
        infer_params.choose_mp(CFG, 8, 3)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Random params saved as our checkpoint (with its config), trained at mp 4."""
    root = str(tmp_path_factory.mktemp("ckpt"))
    params = random_params(CFG, seed=0)
    checkpoint.save(root, 2, {"step": np.int32(2), "params": params}, {"config": CFG.to_dict()}, blocking=True)
    return root, params


def test_read_params_holds_one_copy_of_the_fused_model(saved):
    root, _ = saved
    before = {id(x) for x in jax.live_arrays()}
    placed = infer_params.read_params(infer_params.make_inference_layout(CFG, jax.devices()[:1]), root)
    fused_bytes = sum(x.nbytes for x in jax.tree.leaves(placed))
    new_bytes = sum(x.nbytes for x in jax.live_arrays() if id(x) not in before)
    assert fused_bytes <= new_bytes <= 1.1 * fused_bytes
    assert infer_params.is_placed(placed) and placed["layers"][0]["fused"]["in"].dtype == np.float32


@pytest.mark.parametrize("dtype", [np.float32, np.int8, "bfloat16"])
def test_an_aligned_host_array_is_placed_on_the_cpu_without_a_copy(dtype):
    host = infer_params.aligned_empty((3, 40, 24), jax.numpy.dtype(dtype))
    host[...] = 7
    placed = jax.device_put(host, jax.devices()[0])
    assert host.ctypes.data % 64 == 0 and placed.unsafe_buffer_pointer() == host.ctypes.data
    np.testing.assert_array_equal(np.asarray(placed), host)


@pytest.mark.parametrize("host_transpose", [True, False])
@pytest.mark.parametrize("dtype", [np.float32, jax.numpy.bfloat16, np.int8])
def test_a_layer_joined_on_the_host_into_given_arrays_equals_the_join_under_jit(dtype, host_transpose, monkeypatch):
    """`fuse_inputs`/`fuse_outputs` with numpy and `join_on_host` (the loader's way: each transposed part copied in
    chunks of rows, by XLA's transpose on the CPU device or by numpy) give what jax.numpy's concatenate gives, for
    every tensor-parallel width."""
    d = 64
    monkeypatch.setattr(infer_params, "COPY_CHUNK_BYTES", 5 * d * np.dtype(dtype).itemsize)  # 5 rows: uneven chunks
    if not host_transpose:
        monkeypatch.setattr(infer_params, "_host_transpose", lambda: None)
    keys = iter(jax.random.split(jax.random.PRNGKey(5), 6))
    shapes = {("attn", "q"): (d, d), ("attn", "k"): (d, d), ("attn", "v"): (d, d), ("attn", "out"): (d, d),
              ("mlp", "fc_in", "kernel"): (d, 4 * d), ("mlp", "fc_in", "bias"): (4 * d,),
              ("mlp", "fc_out", "kernel"): (4 * d, d), ("mlp", "fc_out", "bias"): (d,)}
    p: dict = {}
    for path, shape in shapes.items():
        x = np.asarray(jax.random.normal(next(keys) if len(shape) == 2 else jax.random.PRNGKey(7), shape)) * 40
        table.set_path(p, path, x.astype(dtype))
    for tp in (1, 2, 4):
        for fuse in (fused.fuse_inputs, fused.fuse_outputs):
            host = fuse(p, tp, np, concatenate=infer_params.join_on_host)
            want = jax.jit(partial(fuse, tp_size=tp, xp=jax.numpy))(p)
            for name in want:
                np.testing.assert_array_equal(np.asarray(host[name]), np.asarray(want[name]), err_msg=f"{tp} {name}")
                assert host[name].dtype == want[name].dtype


def _mapped_file(address: int) -> str | None:
    """The file whose mapping in this process holds `address`, if any."""
    for line in open("/proc/self/maps"):
        span, *rest = line.split()
        low, high = (int(x, 16) for x in span.split("-"))
        if low <= address < high:
            return rest[4] if len(rest) > 4 else None
    return None


def test_an_embedding_in_one_local_piece_is_placed_on_the_cpu_as_the_files_own_mapping(tmp_path):
    params = jax.device_get(random_params(CFG, seed=3))
    root = str(tmp_path / "ckpt")
    checkpoint.save(root, 1, {"step": np.int32(1), "params": params}, {"config": CFG.to_dict()}, blocking=True)
    placed = infer_params.read_params(infer_params.make_inference_layout(CFG, jax.devices()[:1]), root)
    for path in (("embed", "wte"), ("lm_head", "kernel")):
        x = placed[path[0]][path[1]]
        file = _mapped_file(x.unsafe_buffer_pointer())
        assert file is not None and file.startswith(root) and file.endswith(".npy"), (path, file)
        np.testing.assert_array_equal(np.asarray(x), params[path[0]][path[1]])
    layer_file = _mapped_file(placed["layers"][0]["fused"]["in"].unsafe_buffer_pointer())
    assert layer_file is None or not layer_file.startswith(root)  # joined on the host: its own memory


def test_a_checkpoint_trained_at_mp4_samples_the_same_on_1_and_on_8_devices(saved):
    root, params = saved
    expected = Sampler(infer_params.make_inference_layout(CFG, jax.devices()[:1]), params).generate(
        PROMPTS, 8, temperature=0.0)
    for devices in (jax.devices()[:1], jax.devices()):
        layout = infer_params.make_inference_layout(CFG, devices)
        assert layout.mesh.shape["mp"] == (1 if len(devices) == 1 else 4)
        results = Sampler(layout, infer_params.read_params(layout, root)).generate(PROMPTS, 8, temperature=0.0)
        assert [r.tokens for r in results] == [r.tokens for r in expected]


BIG = config.from_dict({"layers": 1, "d_model": 32, "n_heads": 4, "n_vocab": 50304, "pe_rotary_dims": 4, "seq": 64,
                        "cores_per_replica": 4})


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """The same random GPT-2-vocabulary model as ours (config in its metadata), an HF export and an original-layout
    step directory with a config.json beside it."""
    tmp = tmp_path_factory.mktemp("sources")
    params = random_params(BIG, seed=1)
    ours = str(tmp / "ours")
    checkpoint.save(ours, 1, {"step": np.int32(1), "params": params}, {"config": BIG.to_dict()}, blocking=True)
    hf_dir = str(tmp / "hf")
    hf_export.write_hf(ours, BIG, hf_dir, dtype="fp32")
    original = tmp / "original"
    write_mtj_v1(str(original / "step_1"), original_shards(params, BIG, 4, np.random.default_rng(0)), 1, full=False)
    (original / "config.json").write_text(json.dumps(BIG.to_dict()))
    assert hf.config_from_hf(json.loads((tmp / "hf" / "config.json").read_text())).n_vocab == BIG.n_vocab
    return {"ours": ours, "hf": hf_dir, "original": str(original / "step_1")}


def _sample_call(*flags):
    return "device_sample.py", *flags, "--prompt", "Hello world", "--max-new-tokens", "6", "--temperature", "0"


def test_sampling_needs_no_config_where_the_checkpoint_carries_one(sources):
    calls = {**{name: ("--ckpt", path) for name, path in sources.items()}, "--hf": ("--hf", sources["hf"]),
             "--mp 1 --dtype bf16": ("--ckpt", sources["ours"], "--mp", "1", "--dtype", "bf16")}
    outputs = dict(zip(calls, run_scripts(*(_sample_call(*flags) for flags in calls.values()))))
    for name, result in outputs.items():
        assert result.returncode == 0, (name, result.stderr)
    texts = {name: result.stdout for name, result in outputs.items()}
    assert len(set(texts.values()) - {texts["--mp 1 --dtype bf16"]}) == 1, texts
    assert "inference mesh: dp 2 x mp 4 over 8 cpu devices" in outputs["ours"].stderr


def test_a_checkpoint_without_a_config_or_a_mismatched_one_is_a_one_line_error(sources, tmp_path):
    bare = tmp_path / "bare"
    write_mtj_v1(str(bare / "step_1"), original_shards(random_params(BIG, seed=1), BIG, 4,
                                                       np.random.default_rng(0)), 1, full=False)
    bare_result, mismatched, no_source = run_scripts(
        _sample_call("--ckpt", str(bare / "step_1")), _sample_call("--ckpt", sources["ours"], "--set", "n_vocab=50432"),
        _sample_call("--prompt", "x"))
    assert bare_result.returncode == 2 and bare_result.stderr.strip().endswith(
        "carries no config (no config.json beside or above it): give --config")
    errors = [line for line in mismatched.stderr.strip().splitlines() if not line.startswith("inference mesh:")]
    assert mismatched.returncode == 2 and len(errors) == 1, mismatched.stderr
    assert "n_vocab=50304 (the config says 50432)" in mismatched.stderr
    assert no_source.returncode == 2 and "give --ckpt (or --hf)" in no_source.stderr


def _with_loading(layout, on_host: bool):
    return dataclasses.replace(layout, policy=dataclasses.replace(layout.policy, host_loading=on_host))


@pytest.mark.parametrize("source", ["ours", "hf", "original", "int8"])
@pytest.mark.parametrize("weights, n_devices", [("bfloat16", 1), ("bfloat16", 8), ("int8", 1), ("int8", 8),
                                                ("int8_head", 8)])
def test_a_layer_joined_on_the_devices_equals_it_joined_on_the_host_bit_for_bit(sources, tmp_path_factory, source,
                                                                              weights, n_devices):
    # The accelerators' path (the host reads, the devices convert, quantize and join), forced on the CPU.
    if source == "int8":  # slim_model.py --dtype int8: int8 matrices and their scales as stored
        path = str(tmp_path_factory.mktemp("int8") / "ckpt")
        convert.write_checkpoint(sources["ours"], BIG, path, dtype="int8", slim=True)
    else:
        path = sources[source]
    overrides = {"bfloat16": {"compute_dtype": "bfloat16"},
                 "int8": config.INFERENCE_DTYPES["int8"],
                 "int8_head": {**config.INFERENCE_DTYPES["int8"], "quantize_head": True}}[weights]
    if source == "int8" and weights == "bfloat16":
        overrides = {**overrides, "weight_dtype": "compute"}
    layout = infer_params.make_inference_layout(dataclasses.replace(BIG, **overrides), jax.devices()[:n_devices])
    on_host = infer_params.read_params(_with_loading(layout, True), path)
    on_devices = infer_params.read_params(_with_loading(layout, False), path)
    assert jax.tree.structure(on_host) == jax.tree.structure(on_devices)
    for a, b in zip(jax.tree.leaves(on_host), jax.tree.leaves(on_devices)):
        assert a.dtype == b.dtype and a.sharding.is_equivalent_to(b.sharding, a.ndim)
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("n_devices", [1, 8])
def test_int8_params_placed_from_memory_equal_those_read_from_a_checkpoint(saved, n_devices):
    # Both take their scales' reciprocals from numpy: a device's own division rounds differently (the chip's did).
    root, params = saved
    cfg = dataclasses.replace(CFG, **config.INFERENCE_DTYPES["int8"], quantize_head=True)
    layout = infer_params.make_inference_layout(cfg, jax.devices()[:n_devices])
    placed = infer_params.place_params(jax.tree.map(np.asarray, params), layout)
    for host in (True, False):
        read = infer_params.read_params(_with_loading(layout, host), root)
        for a, b in zip(jax.tree.leaves(placed), jax.tree.leaves(read)):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
