"""The LoRA train step: equal on every Layout, only the adapters trained, far less memory than a full fine-tune."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mesh_transformer.model import table
from mesh_transformer import config
from mesh_transformer.config import ConfigError
from mesh_transformer.parallel.layout import make_layout
from mesh_transformer.model.split import split_of
from mesh_transformer.train import optim
from mesh_transformer.train import state as state_lib
from tests.helpers import int8_base, layout_of

CFG = config.load("configs/tiny_rot_partial.json", ["cores_per_replica=1", "remat=false", "warmup_steps=0",
                                                    "lora_rank=4", "lora_alpha=8"])
MESHES = [("shard_map", 2, 4), ("shard_map", 1, 8), ("dp", 8, 1, 1), ("fsdp", 1, 8, 1), ("tp", 2, 1, 4),
          ("fsdp_tp", 1, 4, 2)]
N_MICRO = 2
FAST = {"xla_backend_optimization_level": 0}


def assert_same_step(next_state, ref_state):
    """Equal gradients (Adam's first moment after one step is 0.1 x the clipped gradient) and updates; an update is
    about lr x sign(gradient), so where a gradient is near Adam's eps it may differ by a fraction of lr."""
    mu, ref_mu = next_state["opt_state"][1].mu, ref_state["opt_state"][1].mu
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-8, rtol=1e-4), mu, ref_mu)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=0.25 * CFG.lr, rtol=0), next_state["params"],
                 ref_state["params"])


def one_step(layout, base, tokens):
    """(start loss, state after one LoRA step, its metrics) on `layout`, base and adapters placed there."""
    optimizer = optim.make_optimizer(layout.cfg)
    train_state = state_lib.init_train_state(layout, optimizer, jax.random.PRNGKey(1))
    train_state["params"] = jax.device_put(_nonzero_b(train_state["params"]),
                                           state_lib.shardings_of(state_lib.abstract_train_state(
                                               layout, optimizer)["params"]))
    base = jax.device_put(base, state_lib.frozen_shardings(layout))
    tokens = jax.device_put(tokens, layout.batch_sharding())
    start = state_lib.make_eval_step(layout)(train_state["params"], tokens[0], base)
    step = state_lib.make_train_step(layout, optimizer, optim.lr_schedule(layout.cfg))
    compiled = step.lower(train_state, tokens, base).compile(compiler_options=FAST)
    next_state, metrics = compiled(train_state, tokens, base)
    return start, jax.device_get(next_state), jax.device_get(metrics)


def _nonzero_b(adapters):
    """B made nonzero so that A's gradient is too (at B = 0 only B learns in the first step)."""
    return {t: {"a": ab["a"], "b": jnp.full(ab["b"].shape, 0.05)} for t, ab in adapters.items()}


@pytest.fixture(scope="module")
def setup():
    cfg = dataclasses.replace(CFG, gradient_accumulation_steps=N_MICRO)
    base = table.init_unsharded(cfg, jax.random.PRNGKey(0))
    tokens = jax.random.randint(jax.random.PRNGKey(2), (N_MICRO, 8, cfg.seq + 1), 0, cfg.n_vocab)
    return cfg, base, tokens, one_step(layout_of(cfg, ("shard_map", 1, 1)), base, tokens)


@pytest.mark.parametrize("spec", MESHES, ids=["-".join(map(str, m)) for m in MESHES])
def test_lora_step_on_every_layout_equals_one_device(setup, spec):
    cfg, base, tokens, (ref_start, ref_state, ref_metrics) = setup
    start, next_state, metrics = one_step(layout_of(cfg, spec), base, tokens)
    np.testing.assert_allclose(start, ref_start, rtol=1e-6)
    np.testing.assert_allclose(metrics["loss"], ref_metrics["loss"], rtol=1e-6)
    np.testing.assert_allclose(metrics["grad_norm"], ref_metrics["grad_norm"], rtol=1e-5)
    assert_same_step(next_state, ref_state)


def test_only_adapters_have_gradients_and_optimizer_state(setup):
    cfg, base, tokens, (_, ref_state, _) = setup
    abstract = state_lib.abstract_train_state(layout_of(cfg, ("shard_map", 1, 1)), optim.make_optimizer(cfg))
    n_adapter = sum(x.size for x in jax.tree.leaves(abstract["params"]))
    n_opt = sum(x.size for x in jax.tree.leaves(abstract["opt_state"]))
    assert set(abstract["params"]) == set(config.LORA_TARGETS) - {"gate"}  # GPT-J's: every target but a gated MLP's
    assert n_opt <= 2 * n_adapter + 8  # two Adam moments of the adapters and counters, nothing of the base
    assert all(np.abs(ab["a"]).max() > 0 for ab in ref_state["params"].values())


def test_remat_lora_step_equals_the_plain_one(setup):
    cfg, base, tokens, (_, ref_state, ref_metrics) = setup
    _, next_state, metrics = one_step(layout_of(dataclasses.replace(cfg, remat=True), ("shard_map", 2, 4)), base,
                                      tokens)
    np.testing.assert_allclose(metrics["loss"], ref_metrics["loss"], rtol=1e-6)
    assert_same_step(next_state, ref_state)


@pytest.mark.parametrize("spec", [("shard_map", 1, 1), ("shard_map", 2, 4), ("fsdp", 1, 8, 1), ("fsdp_tp", 1, 4, 2)],
                         ids=["one", "shard_map-2-4", "fsdp-8", "fsdp_tp-4-2"])
def test_an_int8_base_steps_as_the_float_base_it_stands_for(setup, spec):
    """base_dtype int8 (QLoRA's memory: the layers' matrices int8 with a scale per output column, made the compute
    dtype one layer at a time in the step) gives the loss, gradients and update of the float base int8 x scale, on
    one device and sharded."""
    cfg, base, tokens, _ = setup
    int8, floats = int8_base(cfg, base)
    assert {x.dtype for x in jax.tree.leaves(int8["layers"]["attn"])} == {np.dtype(np.int8)}
    ref_start, ref_state, ref_metrics = one_step(layout_of(cfg, ("shard_map", 1, 1)), floats, tokens)
    start, next_state, metrics = one_step(layout_of(dataclasses.replace(cfg, base_dtype="int8"), spec), int8, tokens)
    np.testing.assert_allclose(start, ref_start, rtol=1e-6)
    np.testing.assert_allclose(metrics["loss"], ref_metrics["loss"], rtol=1e-6)
    np.testing.assert_allclose(metrics["grad_norm"], ref_metrics["grad_norm"], rtol=1e-5)
    assert_same_step(next_state, ref_state)


@pytest.mark.parametrize("overrides, message", [
    ({"lora_rank": -1}, "'lora_rank' must be at least 0"),
    ({"lora_rank": "8"}, "'lora_rank' must be an integer"),
    ({"lora_rank": 1.5}, "'lora_rank' must be an integer"),
    ({"lora_rank": 4, "lora_targets": ["q", "wte"]}, "'lora_targets' must list distinct names"),
    ({"lora_rank": 4, "lora_targets": ["q", "gate"]}, "'gate' is not a LoRA target of the gptj family"),
    ({"lora_rank": 4, "lora_alpha": 0}, "'lora_alpha' must be greater than 0"),
    ({"lora_rank": 4, "lora_alpha": -2.0}, "'lora_alpha' must be greater than 0"),
    ({"base_dtype": "float16"}, "'base_dtype' must be one of float32, bfloat16, int8"),
    ({"lora_rank": 4, "base_dtype": "int8", "eval_harness_tasks": ["lambada"]}, "'base_dtype' int8 holds the LoRA"),
])
def test_bad_lora_config_is_a_one_line_error(overrides, message):
    with pytest.raises(ConfigError, match=message) as e:
        config.from_dict({"layers": 2, "d_model": 32, "n_heads": 4, "n_vocab": 64, "cores_per_replica": 1,
                          "pe_rotary_dims": 4, **overrides})
    assert "\n" not in str(e.value)


def test_lora_step_needs_under_half_the_memory_of_a_full_fine_tune():
    """The bench config's model at batch 1 x 128 tokens, where the model state outweighs the activations (as for
    GPT-J-6B at batch 1): at its own batch 4 x 256 the [B, T, V] logits, alike in both steps, dominate."""
    cfg = config.load("configs/bench.json", ["lora_rank=8", "per_replica_batch=1", "seq=128"])

    def compiled_bytes(cfg):
        layout = make_layout(cfg, jax.devices()[:1])
        optimizer = optim.make_optimizer(cfg)
        abstract = state_lib.abstract_train_state(layout, optimizer)
        tokens = jax.ShapeDtypeStruct((1, layout.global_batch, cfg.seq + 1), jnp.int32,
                                      sharding=layout.batch_sharding())
        frozen = layout.abstract(split_of(cfg).frozen_axes(cfg))
        step = state_lib.make_train_step(layout, optimizer, optim.lr_schedule(cfg))
        mem = step.lower(abstract, tokens, frozen).compile(compiler_options=FAST).memory_analysis()
        return mem.argument_size_in_bytes + mem.output_size_in_bytes + mem.temp_size_in_bytes - mem.alias_size_in_bytes

    full, adapted = compiled_bytes(dataclasses.replace(cfg, lora_rank=0)), compiled_bytes(cfg)
    assert adapted < full / 2, (adapted, full)
