"""Original mesh-transformer-jax checkpoints (built by tests/helpers.py from the layout facts), read as the
equivalent HF model."""
from __future__ import annotations

import os
import shutil

import numpy as np
import pytest
import torch
from transformers import GPTJConfig, GPTJForCausalLM

from mesh_transformer import storage
from mesh_transformer.store import checkpoint, convert, hf, mtj_v1
from mesh_transformer import config
from mesh_transformer.parallel import mesh
from mesh_transformer.parallel.layout import make_layout
from mesh_transformer.parallel.layout import MEGATRON, param_specs
from tests.gcs_emulator import create_bucket, gcs_emulator
from tests.helpers import BF16, MTJ_ROOT, make_checkpoint, run_script
from tests.helpers import MTJ_CFG as CFG


def hf_logits(params: dict, ids: np.ndarray) -> np.ndarray:
    hf_config = GPTJConfig(**hf.hf_config(CFG))
    hf_config._attn_implementation = "eager"
    hf_model = GPTJForCausalLM(hf_config).eval()
    state = {k: torch.from_numpy(v.copy()) for k, v in hf.params_to_hf(params, CFG).items()}
    hf_model.load_state_dict(state, strict=False)
    with torch.no_grad():
        return hf_model(torch.tensor(ids)).logits.numpy()


def our_logits(params: dict, cfg: config.Config, ids: np.ndarray) -> np.ndarray:
    return np.asarray(make_layout(cfg, mesh=mesh.make_dp_mp(1, cfg.cores_per_replica)).logits_fn()(params, ids))


IDS = np.random.default_rng(1).integers(0, CFG.n_vocab, (1, CFG.seq))


def test_leaf_order_is_sorted_haiku_names():
    names = mtj_v1.param_leaf_names(11)
    assert names.index(MTJ_ROOT + "layer_10/~/linear/w") < names.index(MTJ_ROOT + "layer_2/~/linear/w")
    assert names[:2] == [MTJ_ROOT + "embedding_shard/~/linear/b", MTJ_ROOT + "embedding_shard/~/linear/w"]
    assert names[-1] == MTJ_ROOT + "projection_shard/~/replicated_layer_norm/scale" and len(names) == 6 + 10 * 11


def test_slim_bf16_8_shards_resharded_to_1_gives_hf_logits(tmp_path):
    step_dir, expected = make_checkpoint(tmp_path, 8, BF16, full=False)
    assert mtj_v1.is_mtj_v1(str(tmp_path / "model")) and convert.detect_format(step_dir) == convert.MTJ_V1
    out = str(tmp_path / "mp1")
    result = run_script("resharding_example.py", "--input-ckpt", step_dir, "--config", "configs/tiny_rot_partial.json",
                        "--set", "cores_per_replica=8", "--output-ckpt", out, "--cores-per-replica", "1")
    assert result.returncode == 0 and "wrote" in result.stdout, result.stderr[-3000:]
    assert checkpoint.list_steps(out) == [383500]
    assert config.load(os.path.join(out, "config.json")).cores_per_replica == 1
    leaves = checkpoint.read_metadata(out, 383500)
    assert leaves["converted_from"]["format"] == "mtj_v1"
    params = convert.load_params(make_layout(CFG, mesh=mesh.make_dp_mp(1, 1)), out, "fp32")
    assert params["embed"]["wte"].dtype == np.float32
    np.testing.assert_allclose(our_logits(params, CFG, IDS), hf_logits(expected, IDS), atol=1e-4, rtol=0)
    stored = dict(convert.iter_params(out, CFG))
    assert stored[("embed", "wte")].dtype == BF16  # the stored dtype is kept unless --dtype says otherwise


def test_full_checkpoint_with_optimizer_state_loads_onto_mesh(tmp_path):
    step_dir, expected = make_checkpoint(tmp_path, 4, np.dtype(np.float32), full=True)
    cfg4 = config.load("configs/tiny_rot_partial.json", ["cores_per_replica=4"])
    layout = make_layout(cfg4, mesh=mesh.make_dp_mp(1, 4))
    params = convert.load_params(layout, str(tmp_path / "model"))  # the model dir: its latest step
    assert params["layers"]["attn"]["q"].sharding.spec == param_specs(MEGATRON, cfg4)["layers"]["attn"]["q"]
    np.testing.assert_allclose(our_logits(params, cfg4, IDS), hf_logits(expected, IDS), atol=1e-4, rtol=0)
    with mtj_v1.Reader(step_dir, CFG) as reader:
        assert reader.n_shards == 4 and reader.step == 383500


@pytest.fixture(scope="module")
def slim4(tmp_path_factory) -> str:
    return make_checkpoint(tmp_path_factory.mktemp("slim4"), 4, np.dtype(np.float32), full=False, step=7)[0]


def _copy(step_dir: str, tmp_path) -> str:
    copy = str(tmp_path / "step_7")
    shutil.copytree(step_dir, copy)
    return copy


def test_missing_shard_file_is_named(slim4, tmp_path):
    step_dir = _copy(slim4, tmp_path)
    os.remove(f"{step_dir}/shard_2/9.npz")
    with pytest.raises(FileNotFoundError, match="shard_2/9.npz is missing"):
        list(mtj_v1.iter_params(step_dir, CFG))


def test_missing_shard_directory_is_named(slim4, tmp_path):
    step_dir = _copy(slim4, tmp_path)
    shutil.rmtree(f"{step_dir}/shard_1")
    with pytest.raises(FileNotFoundError, match="shard_1 is missing"):
        mtj_v1.Reader(step_dir, CFG)


def test_wrong_shard_count_is_clear(slim4, tmp_path):
    step_dir = _copy(slim4, tmp_path)
    for i in (2, 3):  # only the first half of the shards was copied
        shutil.rmtree(f"{step_dir}/shard_{i}")
    with pytest.raises(config.ConfigError, match="written with 4 shards .* but 2 shard directories were found"):
        mtj_v1.Reader(step_dir, CFG)
    with pytest.raises(config.ConfigError, match="has 4 shards .*expected 8"):
        mtj_v1.Reader(slim4, CFG, shards=8)


@pytest.mark.parametrize("override", ["layers=3", "d_model=32", "n_vocab=512"])
def test_config_not_matching_checkpoint_is_clear(slim4, override):
    cfg = config.load("configs/tiny_rot_partial.json", ["cores_per_replica=1", override])
    with pytest.raises(config.ConfigError, match="does not match the checkpoint"):
        mtj_v1.Reader(slim4, cfg)
    result = run_script("resharding_example.py", "--input-ckpt", slim4, "--config", "configs/tiny_rot_partial.json",
                        "--set", override, "--output-ckpt", "/nonexistent/out")
    err = result.stderr
    assert result.returncode == 2 and err.startswith("error: ") and err.count("\n") == 1


def test_reads_from_gcs(slim4):
    local = dict(mtj_v1.iter_params(slim4, CFG))
    with gcs_emulator() as url:
        create_bucket(url, "old")
        for path in storage.walk_files(slim4):
            with open(path, "rb") as f:
                storage.write_bytes_atomic("gs://old/model/step_7/" + os.path.relpath(path, slim4), f.read())
        assert mtj_v1.resolve_step_dir("gs://old/model") == "gs://old/model/step_7"
        remote = dict(mtj_v1.iter_params("gs://old/model", CFG))
    assert remote.keys() == local.keys()
    for key in local:
        np.testing.assert_array_equal(remote[key], local[key])
