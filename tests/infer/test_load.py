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


def test_the_int8_head_needs_int8_weights_and_a_float_dtype_reads_an_int8_config_in_floats():
    tiny = ("--config", "configs/tiny_rot_partial.json")
    with pytest.raises(config.ConfigError, match="quantize_head.*--dtype int8"):
        inference_config(parsed(*tiny, "--quantize-head"))
    assert inference_config(parsed(*tiny, "--dtype", "int8", "--quantize-head"))[0].quantize_head
    int8_config = ("--set", "weight_dtype=int8", "--set", "quantize_head=true")  # as an int8 checkpoint's may say
    cfg, _ = inference_config(parsed(*tiny, *int8_config, "--dtype", "bf16"))
    assert (cfg.weight_dtype, cfg.quantize_head) == ("compute", False)
