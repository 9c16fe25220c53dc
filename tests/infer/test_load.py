"""The sampling, serving and eval tools' model flags read into a config."""
import pytest

from mesh_transformer import config, flags
from mesh_transformer.infer.load import inference_config


def parsed(*argv):
    parser = flags.Parser(prog="tool")
    flags.add_inference_args(parser)
    return parser.parse_args(list(argv))


@pytest.mark.parametrize("dtype, compute, weights", [("bf16", "bfloat16", "compute"), ("fp32", "float32", "compute"),
                                                     ("int8", "bfloat16", "int8")])
def test_dtype_flag_sets_the_compute_and_weight_dtypes(dtype, compute, weights):
    cfg, source = inference_config(parsed("--config", "configs/tiny_rot_partial.json", "--dtype", dtype))
    assert (cfg.compute_dtype, cfg.weight_dtype, source) == (compute, weights, cfg.model_path)


def test_a_bad_weight_dtype_is_a_config_error():
    with pytest.raises(config.ConfigError, match="weight_dtype"):
        inference_config(parsed("--config", "configs/tiny_rot_partial.json", "--set", "weight_dtype=int4"))
