"""The sampling, serving and eval tools' model flags read into a config, and their params read from every format:
ahead of their placing and in parallel, with a LoRA run's adapters merged where the layers are placed."""
import dataclasses

import jax
import numpy as np
import pytest

from mesh_transformer import config, flags
from mesh_transformer.infer import params as infer_params
from mesh_transformer.infer.load import inference_config
from mesh_transformer.model import lora, table
from mesh_transformer.parallel.mesh import make_dp_mp
from mesh_transformer.store import checkpoint, checkpoint_format, convert, hf_export
from tests.helpers import BF16, MTJ_CFG, make_checkpoint


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


# ---- reading: every format read ahead and in parallel, LoRA merged where the layers are placed ----

# 2 layers, D 64, 8 heads, V 256, written as the original's 4 shards in bf16; a LoRA run of rank 4 over it.
LORA_CFG = dataclasses.replace(MTJ_CFG, lora_rank=4, lora_alpha=8)


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """The same bf16 model in the original layout, ours and an HF directory, and a LoRA run over it."""
    tmp = tmp_path_factory.mktemp("formats")
    original, _ = make_checkpoint(tmp, 4, BF16, full=False)
    rng = np.random.default_rng(3)
    adapters = jax.tree.map(lambda s: (rng.normal(size=s.shape) * 0.1).astype(np.float32), lora.lora_shapes(LORA_CFG))
    run = str(tmp / "run")
    checkpoint.save(run, 5, {"step": np.int32(5), "params": adapters},
                    {"config": LORA_CFG.to_dict(), "lora_base": {"path": original}}, blocking=True)
    ours = convert.write_checkpoint(original, MTJ_CFG, str(tmp / "ours"), slim=True)
    hf_export.write_hf(original, MTJ_CFG, str(tmp / "hf"), dtype="bf16")
    return {"original": original, "ours": ours, "hf": str(tmp / "hf"), "run": run}


def _layout(weights: str, mesh: tuple[int, int], host_loading: bool):
    cfg = dataclasses.replace(MTJ_CFG, **WEIGHTS[weights])
    layout = infer_params.make_inference_layout(cfg, mesh=make_dp_mp(*mesh))
    return dataclasses.replace(layout, policy=dataclasses.replace(layout.policy, host_loading=host_loading))


WEIGHTS = {"fp32": config.INFERENCE_DTYPES["fp32"], "bf16": config.INFERENCE_DTYPES["bf16"],
           "int8": config.INFERENCE_DTYPES["int8"]}


def _reference(layout, source: str, lora_run: str | None) -> dict:
    """The params as the reader without read-ahead gives them, merged on the host in f32 (numpy), then placed."""
    with convert.open_params(source, layout.cfg, lora=lora_run) as reader:
        params: dict = {}
        for path, like in table.param_paths(layout.cfg):
            table.set_path(params, path, convert.read_array(reader, path, like.shape))
    return infer_params.place_params(params, layout)


def _assert_same(got: dict, want: dict, weights: str, exact: bool) -> None:
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for (keys, a), b in zip(jax.tree_util.tree_flatten_with_path(got)[0], jax.tree.leaves(want)):
        assert a.dtype == b.dtype and a.sharding.is_equivalent_to(b.sharding, a.ndim), keys
        a, b = np.asarray(a), np.asarray(b)
        if exact:
            np.testing.assert_array_equal(a, b, err_msg=str(keys))
        elif a.dtype == np.int8:  # a merge rounded differently may move a value across a rounding boundary
            assert np.abs(a.astype(int) - b).max() <= 1 and np.mean(a != b) < 0.01, keys
        else:  # numpy's f32 products against XLA's: a last bit apart, in f32 or once rounded to bf16
            rtol = 1e-6 if weights == "fp32" else 2 ** -8
            np.testing.assert_allclose(a.astype(np.float32), b.astype(np.float32), rtol=rtol, atol=1e-6,
                                       err_msg=str(keys))


@pytest.mark.parametrize("source, weights, mesh", [
    ("original", "fp32", (1, 1)), ("original", "bf16", (1, 2)), ("original", "int8", (2, 4)),
    ("ours", "bf16", (2, 4)), ("hf", "int8", (1, 2))])
def test_read_ahead_and_in_parallel_every_format_gives_the_params_of_a_plain_read(sources, source, weights, mesh,
                                                                                monkeypatch):
    monkeypatch.setattr(checkpoint_format, "READ_THREADS", 3)  # fewer threads than shards: some wait their turn
    want = _reference(_layout(weights, mesh, True), sources[source], None)
    for host_loading in (True, False):
        _assert_same(infer_params.read_params(_layout(weights, mesh, host_loading), sources[source]), want, weights,
                     exact=True)


@pytest.mark.parametrize("source, weights, mesh", [
    ("original", "fp32", (1, 1)), ("original", "fp32", (1, 2)), ("original", "bf16", (2, 4)),
    ("original", "int8", (2, 4)), ("ours", "fp32", (2, 4)), ("hf", "bf16", (1, 2))])
def test_lora_merged_on_the_devices_equals_the_merge_on_the_host(sources, source, weights, mesh):
    want = _reference(_layout(weights, mesh, True), sources[source], sources["run"])
    got = {host: infer_params.read_params(_layout(weights, mesh, host), sources[source], lora=sources["run"])
           for host in (True, False)}
    _assert_same(got[False], got[True], weights, exact=True)  # both paths merge by the one program
    _assert_same(got[False], want, weights, exact=False)
    if source == "original" and weights == "fp32":  # a LoRA run read as itself reads its base the same way
        _assert_same(infer_params.read_params(_layout(weights, mesh, False), sources["run"]), got[False], weights,
                     exact=True)
