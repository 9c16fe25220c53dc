import dataclasses
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

from mesh_transformer.model import table
from mesh_transformer import config
from mesh_transformer.model import gptj as model
from mesh_transformer.train import optim
from mesh_transformer.parallel import layout as partitioning
from mesh_transformer.config import ConfigError
from mesh_transformer.parallel.layout import make_layout
from mesh_transformer.parallel.mesh import make_mesh
from mesh_transformer.train import state as state_lib
from tests.helpers import CPU_POLICY

CFG = config.load("configs/tiny_rot_partial.json", ["cores_per_replica=1", "remat=false", "warmup_steps=0"])
MESHES = [("dp", 8, 1, 1), ("fsdp", 1, 8, 1), ("tp", 2, 1, 4), ("fsdp_tp", 1, 4, 2), ("fsdp_tp", 2, 2, 2)]
MESH_IDS = [f"{m}-data{d}-fsdp{f}-tensor{t}" for m, d, f, t in MESHES]
N_MICRO = 2
OPTIMIZER = optim.make_optimizer(CFG)
FAST = {"xla_backend_optimization_level": 0}  # these tests check numbers, not speed: skip LLVM's optimizations


def fast_jit(fn, *args):
    """jax.jit(fn) compiled for `args` without backend optimization (a third of the compile time on CPU_POLICY)."""
    return jax.jit(fn).lower(*args).compile(compiler_options=FAST)


def gspmd(mode: str) -> config.Config:
    """The tiny config with parallelism switched to a GSPMD mode (config.py does not accept it from JSON yet)."""
    return dataclasses.replace(CFG, parallelism=mode)


def max_diff(a, b) -> float:
    return max(float(np.abs(np.asarray(x) - np.asarray(y)).max()) for x, y in zip(jax.tree.leaves(a),
                                                                                  jax.tree.leaves(b)))


@pytest.fixture(scope="module")
def tokens():
    return jax.random.randint(jax.random.PRNGKey(1), (N_MICRO, 8, CFG.seq + 1), 0, CFG.n_vocab)


@pytest.fixture(scope="module")
def reference(tokens):
    """One step on one device with the unsharded model.loss_fn: start state, loss, grads, next state."""
    params = table.init_unsharded(CFG, jax.random.PRNGKey(0))
    loss_fn = partial(model.loss_fn, cfg=CFG, policy=CPU_POLICY)
    value_and_grad = fast_jit(jax.value_and_grad(loss_fn), params, tokens[0])
    losses, grads = zip(*(value_and_grad(params, tokens[i]) for i in range(N_MICRO)))
    grads = jax.tree.map(lambda *g: sum(g) / N_MICRO, *grads)
    opt_state = OPTIMIZER.init(params)
    updates, next_opt_state = fast_jit(OPTIMIZER.update, grads, opt_state, params)(grads, opt_state, params)
    return {"start": {"step": jnp.int32(0), "params": params, "opt_state": opt_state},
            "loss": sum(losses) / N_MICRO, "grads": grads,
            "next": {"step": 1, "params": jax.tree.map(jnp.add, params, updates), "opt_state": next_opt_state}}


def test_every_param_has_logical_axes_of_its_rank():
    shapes = table.param_shapes(CFG)
    axes = table.param_axes(CFG)
    assert jax.tree.structure(shapes) == jax.tree.structure(axes, is_leaf=table.is_axes)
    for s, a in zip(jax.tree.leaves(shapes), jax.tree.leaves(axes, is_leaf=table.is_axes)):
        assert len(a) == s.ndim


def test_fsdp_mappings_split_params_on_embed_but_activations_on_batch():
    mappings = partitioning.GSPMD["fsdp_tp"]
    specs = partitioning.param_specs(mappings, CFG)
    assert specs["layers"]["attn"]["q"] == P(None, "fsdp", "tensor")
    assert specs["layers"]["mlp"]["fc_out"]["kernel"] == P(None, "tensor", "fsdp")
    assert specs["embed"]["wte"] == P("tensor", "fsdp")
    rules = mappings.compute
    hidden = partitioning.logical_to_spec(partitioning.ACTIVATION_AXES["hidden"], rules)
    assert hidden == P(("data", "fsdp"), None, None)  # compute keeps embed whole: gathered weights
    assert partitioning.logical_to_spec(partitioning.ACTIVATION_AXES["logits"], rules) == P(("data", "fsdp"), None,
                                                                                            "tensor")
    assert partitioning.param_specs(partitioning.GSPMD["dp"], CFG)["layers"]["attn"]["q"] == P(None, None, None)


@pytest.mark.parametrize("mode, data, fsdp, tensor", MESHES, ids=MESH_IDS)
def test_train_step_matches_single_device(reference, tokens, mode, data, fsdp, tensor):
    """Loss, gradients and the updated params and optimizer state equal the unsharded model.loss_fn's.

    After one Adam step the first moment is 0.1 x the clipped gradient, so with equal gradient norms, equal
    moments are equal gradients.
    """
    cfg = gspmd(mode)
    layout = make_layout(cfg, mesh=make_mesh({"data": data, "fsdp": fsdp, "tensor": tensor}))
    abstract = state_lib.abstract_train_state(layout, OPTIMIZER)
    # From host copies: the step donates its state, and the reference start must survive for the other modes.
    start = jax.tree.map(np.asarray, reference["start"])
    state = jax.device_put(start, jax.tree.map(lambda s: s.sharding, abstract))
    step = state_lib.make_train_step(layout, OPTIMIZER, optim.lr_schedule(cfg))
    tokens = jax.device_put(tokens, layout.batch_sharding())
    state, metrics = step.lower(state, tokens, {}).compile(compiler_options=FAST)(state, tokens, {})

    q = state["params"]["layers"]["attn"]["q"]
    assert q.addressable_shards[0].data.shape == (CFG.layers, CFG.d_model // fsdp, CFG.d_model // tensor)
    assert state["opt_state"][1].mu["layers"]["attn"]["q"].sharding == q.sharding  # moments follow params
    np.testing.assert_allclose(metrics["loss"], reference["loss"], rtol=1e-6)
    np.testing.assert_allclose(metrics["grad_norm"], optax.global_norm(reference["grads"]), rtol=1e-5)
    assert max_diff(state["opt_state"][1].mu, reference["next"]["opt_state"][1].mu) < 1e-8
    assert max_diff(state, reference["next"]) < 1e-6


@pytest.fixture(scope="module")
def fsdp8_state():
    layout = make_layout(gspmd("fsdp"), mesh=make_mesh({"data": 1, "fsdp": 8, "tensor": 1}))
    return state_lib.init_train_state(layout, OPTIMIZER, jax.random.PRNGKey(0))


def test_init_gives_the_same_numbers_as_the_unsharded_init(fsdp8_state, reference):
    assert max_diff(fsdp8_state["params"], reference["start"]["params"]) == 0.0
    assert max_diff(fsdp8_state["opt_state"], reference["start"]["opt_state"]) == 0.0


def test_fsdp8_keeps_an_eighth_of_params_and_optimizer_state_per_device(fsdp8_state):
    leaves = jax.tree.leaves({"params": fsdp8_state["params"], "opt_state": fsdp8_state["opt_state"]})
    total = sum(x.nbytes for x in leaves)
    per_device = {}
    for x in leaves:
        for shard in x.addressable_shards:
            per_device[shard.device] = per_device.get(shard.device, 0) + shard.data.nbytes
    # Only leaves without an 'embed' axis stay whole: the fc_in and lm_head biases and the step counters.
    whole = sum(x.nbytes for x in leaves if x.sharding.is_fully_replicated)
    assert len(per_device) == 8 and whole < 0.05 * total / 8
    assert max(per_device.values()) <= total / 8 + whole


def test_eval_step_matches_single_device(fsdp8_state, reference, tokens):
    layout = make_layout(gspmd("fsdp"), mesh=make_mesh({"data": 1, "fsdp": 8, "tensor": 1}))
    loss = state_lib.make_eval_step(layout)(fsdp8_state["params"], tokens[0], {})
    expected = model.loss_fn(reference["start"]["params"], tokens[0], CFG, policy=CPU_POLICY)
    np.testing.assert_allclose(loss, expected, rtol=1e-6)


@pytest.mark.parametrize("mode, sizes, message", [
    ("fsdp", (1, 8, 1), "d_model (60) must be divisible by the fsdp mesh size (8)"),
    ("tp", (1, 1, 8), "n_heads (6) must be divisible by the tensor mesh size (8)"),
    ("dp", (4, 1, 2), "does not use mesh axis 'tensor'"),
    ("shard_map", (8, 1, 1), "must be one of dp, fsdp, tp, fsdp_tp"),
])
def test_layout_mistakes_are_named(mode, sizes, message):
    cfg = dataclasses.replace(gspmd(mode), d_model=60, n_heads=6)
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        make_layout(cfg, mesh=make_mesh(dict(zip(("data", "fsdp", "tensor"), sizes))))


def _trimmed(spec: P) -> tuple:
    """A spec without its trailing Nones (P() and P(None, None) place an array alike)."""
    entries = tuple(spec)
    while entries and entries[-1] is None:
        entries = entries[:-1]
    return entries


def test_megatron_specs_derived_from_the_rules_equal_the_original_hand_written_ones():
    cols, rows, whole = P(None, None, "mp"), P(None, "mp", None), P()
    hand_written = {
        "embed": {"wte": P("mp", None)},
        "layers": {
            "ln_1": {"scale": whole, "bias": whole},
            "attn": {"q": cols, "k": cols, "v": cols, "out": rows},
            "mlp": {"fc_in": {"kernel": cols, "bias": P(None, "mp")}, "fc_out": {"kernel": rows, "bias": whole}},
        },
        "ln_f": {"scale": whole, "bias": whole},
        "lm_head": {"kernel": P(None, "mp"), "bias": P("mp")},
    }
    derived = partitioning.param_specs(partitioning.MEGATRON, CFG)
    is_spec = lambda x: isinstance(x, P)  # noqa: E731
    assert jax.tree.structure(derived, is_leaf=is_spec) == jax.tree.structure(hand_written, is_leaf=is_spec)
    for got, want in zip(jax.tree.leaves(derived, is_leaf=is_spec), jax.tree.leaves(hand_written, is_leaf=is_spec)):
        assert _trimmed(got) == _trimmed(want)
