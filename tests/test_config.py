import json
from pathlib import Path

import pytest

from mesh_transformer import config
from mesh_transformer.config import ConfigError


def write(tmp_path, raw):
    path = tmp_path / "c.json"
    path.write_text(json.dumps(raw))
    return str(path)


def test_original_configs_load_unchanged():
    cfg = config.load("configs/6B_roto_256.json")
    assert (cfg.layers, cfg.d_model, cfg.n_heads, cfg.n_vocab, cfg.pe_rotary_dims) == (28, 4096, 16, 50400, 64)
    assert cfg.val_set["pile"] == "pile.val.index"
    assert cfg.model_path == "gs://neo-models/mesh_jax_pile_6B_rotary"
    example = config.load("configs/example_config.json")
    assert example.total_steps == 72 and example.head_dim == 256


def test_every_shipped_config_loads():
    recipes = {p.name: config.load(str(p)) for p in sorted(Path("configs").glob("*.json"))}
    assert recipes["6B_lora_v5litepod-1.json"].lora_rank == 16
    assert recipes["6B_lora_v5litepod-1.json"].cores_per_replica == 1


def test_defaults_fill_missing_keys_and_config_is_frozen(tmp_path):
    cfg = config.load(write(tmp_path, {"layers": 2}))
    assert cfg.layers == 2 and cfg.compute_dtype == "auto" and cfg.remat is True
    with pytest.raises(AttributeError):
        cfg.layers = 3


def test_overrides_are_parsed_and_checked(tmp_path):
    path = write(tmp_path, {})
    cfg = config.load(path, ["lr=3e-4", "model_dir=runs/a", "remat=false", "name=123"])
    assert cfg.lr == 3e-4 and cfg.model_dir == "runs/a" and cfg.remat is False and cfg.name == "123"
    with pytest.raises(ConfigError, match="'layers' must be an integer"):
        config.load(path, ["layers=many"])
    # null unsets an optional key (a recipe's bucket: checkpoints written locally); a required one refuses it
    bucketed = write(tmp_path, {"bucket": "your-bucket", "model_dir": "runs/b"})
    assert config.load(bucketed).model_path == "gs://your-bucket/runs/b"
    unset = config.load(bucketed, ["bucket=null"])
    assert unset.bucket is None and unset.model_path == "runs/b"
    assert config.load(path, ["name=null"]).name == "null"
    with pytest.raises(ConfigError, match="key=value"):
        config.load(path, ["layers"])


@pytest.mark.parametrize("raw, message", [
    ({"n_layers": 2}, "unknown config key 'n_layers'; did you mean 'layers'"),
    ({"lr": "fast"}, "'lr' must be a number, got 'fast'"),
    ({"remat": 1}, "'remat' must be true or false"),
    ({"d_model": 100, "n_heads": 16, "cores_per_replica": 1}, "'d_model' .* divisible by n_heads"),
    ({"d_model": 768, "n_heads": 12, "cores_per_replica": 8}, "'n_heads' .* divisible by cores_per_replica"),
    ({"n_vocab": 50257, "cores_per_replica": 8}, "'n_vocab' .* divisible by cores_per_replica"),
    ({"pe_rotary_dims": 63}, "'pe_rotary_dims' .* even"),
    ({"pe_rotary_dims": 512}, "'pe_rotary_dims' .* at most the head dimension"),
    ({"compute_dtype": "int8"}, "'compute_dtype' must be one of"),
    ({"layers": 0}, "'layers' must be at least 1"),
    ({"remat_policy": "dots"}, "'remat_policy' must be one of"),
    ({"remat": False, "remat_policy": "save_qkv"}, "'remat_policy' .* with remat true"),
])
def test_bad_config_is_one_line_error_naming_the_key(tmp_path, raw, message):
    with pytest.raises(ConfigError, match=message) as err:
        config.load(write(tmp_path, raw))
    assert "\n" not in str(err.value)


def test_device_count_must_split_into_model_parallel_groups():
    cfg = config.from_dict({"cores_per_replica": 8})
    config.check_devices(cfg, 16)
    with pytest.raises(ConfigError, match=r"'cores_per_replica' .* device count \(12\); --set cores_per_replica=4 "):
        config.check_devices(cfg, 12)
    with pytest.raises(ConfigError, match="--set cores_per_replica=1 "):  # n_heads 16 and 3 devices: only 1 fits
        config.check_devices(cfg, 3)


def test_missing_or_invalid_file(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        config.load(str(tmp_path / "nope.json"))
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        config.load(str(bad))
