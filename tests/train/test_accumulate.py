"""Gradient accumulation with remat adds each layer's gradient into the running sum inside the backward
(`Layout.loss_and_grad_fn(split, accumulate.into(split))`): equal to the sum of plainly computed gradients on
every kind of mesh, full fine-tune and LoRA, in one set of layer gradients' less memory."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mesh_transformer.model import table
from mesh_transformer import config
from mesh_transformer.parallel.layout import make_layout
from mesh_transformer.parallel.mesh import make_dp_mp
from mesh_transformer.model.split import FULL, LORA, split_of
from mesh_transformer.train import accumulate, optim
from mesh_transformer.train import state as state_lib
from tests.helpers import layout_of

CFG = config.load("configs/tiny_rot_partial.json", ["cores_per_replica=1", "remat=true", "warmup_steps=0"])
MESHES = [("shard_map", 1, 1), ("shard_map", 2, 4), ("fsdp", 1, 8, 1), ("fsdp_tp", 2, 2, 2)]
FAST = {"xla_backend_optimization_level": 0}


def random_like(tree, seed):
    """Host arrays of tree's shapes (numpy's generator: no program compiled per leaf shape)."""
    rng = np.random.default_rng(seed)
    return jax.tree.map(lambda x: (0.1 * rng.standard_normal(x.shape)).astype(np.float32), tree)


def assert_close(a, b, rtol=1e-5):
    jax.tree.map(lambda x, y: np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=rtol, atol=1e-6), a, b)


VARIANTS = [{"join_projections": True}, {"compute_dtype": "bfloat16"}, {"lora_rank": 4, "base_dtype": "bfloat16"}]


@pytest.mark.parametrize("extra", [{}, {"lora_rank": 4}], ids=["full", "lora"])
@pytest.mark.parametrize("spec", MESHES, ids=["-".join(map(str, m)) for m in MESHES])
def test_gradients_added_in_the_backward_equal_the_sum(spec, extra):
    check_sum(layout_of(dataclasses.replace(CFG, **extra), spec))


@pytest.mark.parametrize("extra", VARIANTS, ids=["joined", "bf16-compute", "lora-bf16-base"])
def test_gradients_added_in_the_backward_equal_the_sum_joined_and_in_bf16(extra):
    check_sum(layout_of(dataclasses.replace(CFG, **extra), ("shard_map", 2, 4)), rtol=1e-4)


def check_sum(layout, rtol=1e-5):
    """loss_and_grad with accumulate == (loss, grad_sum + the plain gradients) for a random grad_sum."""
    split = split_of(layout.cfg)
    base = layout.init_params(jax.random.PRNGKey(0))
    tokens = jax.device_put(jax.random.randint(jax.random.PRNGKey(1), (8, CFG.seq + 1), 0, CFG.n_vocab),
                            layout.batch_sharding(False))
    if split is LORA:
        base = jax.tree.map(lambda x: x.astype(table.DTYPES[layout.cfg.base_dtype]), base)
        trained = random_like(layout.init(split.init, split.trainable_axes(layout.cfg), jax.random.PRNGKey(2)), 3)
        args = (trained, base, tokens)  # B nonzero: A gets gradients too
    else:
        trained, args = base, (base, {}, tokens)
    plain, into = layout.loss_and_grad_fn(split), layout.loss_and_grad_fn(split, accumulate.into(split))
    grad_sum = random_like(trained, 4)
    loss, grads = jax.jit(plain).lower(*args).compile(compiler_options=FAST)(*args)
    loss_into, summed = jax.jit(into).lower(*args, grad_sum).compile(compiler_options=FAST)(*args, grad_sum)
    np.testing.assert_allclose(loss_into, loss, rtol=1e-6)
    assert_close(summed, jax.tree.map(lambda s, g: s + np.asarray(g), grad_sum, grads), rtol)


def test_remat_train_step_accumulating_4x2_equals_1x8():
    cfg = dataclasses.replace(CFG, cores_per_replica=4)
    layout = make_layout(cfg, mesh=make_dp_mp(2, 4))
    optimizer = optim.make_optimizer(cfg)
    step = state_lib.make_train_step(layout, optimizer, optim.lr_schedule(cfg))
    tokens = np.random.default_rng(1).integers(0, cfg.n_vocab, (8, cfg.seq + 1)).astype(np.int32)
    results = []
    for shape in ((4, 2, -1), (1, 8, -1)):
        state = state_lib.init_train_state(layout, optimizer, jax.random.PRNGKey(0))
        batch = jax.device_put(tokens.reshape(shape), layout.batch_sharding())
        results.append(jax.device_get(step(state, batch, {})))
    (accumulated, metrics_acc), (full, metrics_full) = results
    np.testing.assert_allclose(metrics_acc["loss"], metrics_full["loss"], rtol=1e-6)
    np.testing.assert_allclose(metrics_acc["grad_norm"], metrics_full["grad_norm"], rtol=1e-5)
    assert_close(accumulated["opt_state"][1].mu, full["opt_state"][1].mu)


def test_summing_in_the_backward_holds_one_set_of_layer_gradients_fewer():
    """Compiled temporaries of a 2-micro-batch step whose backward peak (activations, the sum, this micro-batch's
    gradients) is the step's peak: the sum made in the backward saves one set of layer gradients."""
    cfg = config.from_dict({"layers": 8, "d_model": 256, "n_heads": 4, "n_vocab": 256, "pe_rotary_dims": 16,
                            "seq": 512, "cores_per_replica": 1, "per_replica_batch": 8, "warmup_steps": 0})
    layout = make_layout(cfg, mesh=make_dp_mp(1, 1))
    optimizer = optim.make_optimizer(cfg)
    abstract = state_lib.abstract_train_state(layout, optimizer)
    tokens = jax.ShapeDtypeStruct((2, 8, cfg.seq + 1), jnp.int32, sharding=layout.batch_sharding())
    temps = []
    for into in (None, accumulate.into(FULL)):
        step = accumulate.accumulated_train_step(layout.grad_flow(FULL, into), optimizer, optim.lr_schedule(cfg))
        temps.append(jax.jit(step, donate_argnums=0).lower(abstract, tokens, {}).compile().memory_analysis()
                     .temp_size_in_bytes)
    layer_grad_bytes = sum(x.size * 4 for x in jax.tree.leaves(abstract["params"]["layers"]))
    assert temps[0] - temps[1] > 0.9 * layer_grad_bytes


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_a_remat_policy_keeping_more_trains_as_full_remat_does(lora):
    """remat_policy "save_qkv" and "save_mlp_hidden" (the plain sum of micro-batch gradients) take the step
    "full" (the sum made in the backward) takes: the same loss and Adam moments (on one device: what a policy keeps
    does not depend on the mesh)."""
    extra = {"lora_rank": 4} if lora else {}
    results = []
    for policy in ("full", "save_qkv", "save_mlp_hidden"):
        cfg = dataclasses.replace(CFG, remat_policy=policy, **extra)
        layout = make_layout(cfg, mesh=make_dp_mp(1, 1))
        optimizer = optim.make_optimizer(cfg)
        split = split_of(cfg)
        step = state_lib.make_train_step(layout, optimizer, optim.lr_schedule(cfg), split)
        tokens = np.random.default_rng(1).integers(0, cfg.n_vocab, (2, 4, cfg.seq + 1)).astype(np.int32)
        state = state_lib.init_train_state(layout, optimizer, jax.random.PRNGKey(2), split)
        frozen = layout.init_params(jax.random.PRNGKey(0)) if lora else {}
        results.append(jax.device_get(step(state, jax.device_put(tokens, layout.batch_sharding()), frozen)))
    (full, metrics), *others = results
    for other, other_metrics in others:
        np.testing.assert_allclose(other_metrics["loss"], metrics["loss"], rtol=1e-6)
        assert_close(other["opt_state"][1].mu, full["opt_state"][1].mu)
