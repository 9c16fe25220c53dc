import dataclasses
import math

import jax
import numpy as np
import pytest

from mesh_transformer.model import table
from mesh_transformer import config
from mesh_transformer.train import optim
from mesh_transformer.parallel.mesh import make_dp_mp
from mesh_transformer.parallel.layout import make_layout
from mesh_transformer.train import state as state_lib

CFG = config.load("configs/tiny_rot_partial.json", [
    "cores_per_replica=4", "warmup_steps=10", "anneal_steps=100", "lr=0.01", "end_lr=0.001", "remat=false"])


def original_schedule(step, warmup, anneal, peak, end):
    """mesh-transformer-jax's gpt3_schedule, written out in plain Python."""
    warmup_pct = min(max(step, 0), warmup) / warmup
    anneal_pct = min(max(step - warmup, 0), anneal) / anneal
    return warmup_pct * peak - (peak - end) * (1 - math.cos(math.pi * anneal_pct)) / 2


@pytest.mark.parametrize("step", [0, 1, 5, 10, 11, 50, 109, 110, 111, 10_000])
def test_schedule_equals_the_original_formula(step):
    expected = original_schedule(step, 10, 100, 0.01, 0.001)
    assert float(optim.lr_schedule(CFG)(step)) == pytest.approx(expected, rel=1e-5, abs=1e-9)


def test_weight_decay_touches_only_weight_matrices():
    params = table.init_unsharded(CFG, jax.random.PRNGKey(0))
    mask = optim.decay_mask(params, CFG)
    decayed = {"/".join(k.key for k in path) for path, on in jax.tree_util.tree_flatten_with_path(mask)[0] if on}
    assert decayed == {"embed/wte", "layers/attn/q", "layers/attn/k", "layers/attn/v", "layers/attn/out",
                       "layers/mlp/fc_in/kernel", "layers/mlp/fc_out/kernel", "lm_head/kernel"}
    # zero gradients: only decayed leaves move, by lr * wd * value
    cfg = dataclasses.replace(CFG, warmup_steps=0, weight_decay=0.5)
    opt = optim.make_optimizer(cfg)
    updates, _ = opt.update(jax.tree.map(np.zeros_like, params), opt.init(params), params)
    for path, update in jax.tree_util.tree_flatten_with_path(updates)[0]:
        name = "/".join(k.key for k in path)
        leaf = params
        for k in path:
            leaf = leaf[k.key]
        expected = -0.01 * 0.5 * np.asarray(leaf) if name in decayed else np.zeros_like(leaf)
        np.testing.assert_allclose(update, expected, rtol=1e-5, atol=1e-8, err_msg=name)


def run_steps(cfg, tokens_GxBxT1, n_steps, dp=2):
    mesh = make_dp_mp(dp, cfg.cores_per_replica)
    opt = optim.make_optimizer(cfg)
    layout = make_layout(cfg, mesh=mesh)
    state = state_lib.init_train_state(layout, opt, jax.random.PRNGKey(0))
    step = state_lib.make_train_step(layout, opt, optim.lr_schedule(cfg))
    losses = []
    for _ in range(n_steps):
        state, metrics = step(state, tokens_GxBxT1, {})
        losses.append(float(metrics["loss"]))
    return state, losses


def test_loss_falls_on_a_repeated_batch():
    tokens = np.random.default_rng(0).integers(0, CFG.n_vocab, (1, 4, CFG.seq + 1)).astype(np.int32)
    state, losses = run_steps(CFG, tokens, 25)
    assert losses[-1] < 0.2 * losses[0]
    assert int(state["step"]) == 25


def test_gradient_accumulation_4x2_equals_1x8():
    tokens = np.random.default_rng(1).integers(0, CFG.n_vocab, (8, CFG.seq + 1)).astype(np.int32)
    accumulated, (loss_acc,) = run_steps(CFG, tokens.reshape(4, 2, -1), 1)
    full, (loss_full,) = run_steps(CFG, tokens.reshape(1, 8, -1), 1)
    assert loss_acc == pytest.approx(loss_full, rel=1e-6)
    diffs = jax.tree.map(lambda a, b: float(np.abs(np.asarray(a) - np.asarray(b)).max()),
                         accumulated["params"], full["params"])
    assert max(jax.tree.leaves(diffs)) < 1e-6
