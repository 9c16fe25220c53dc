"""The optimizer state split over data parallel in the shard_map layout (`shard_optimizer`, ZeRO-1/2): its steps equal
the replicated optimizer's on several meshes (accumulation, clipping, LoRA), each replica holds its share of Adam's
moments, and checkpoints move between data-parallel widths and the GSPMD layout bit for bit."""
import dataclasses

import jax
import numpy as np
import pytest

from mesh_transformer import config
from mesh_transformer.aot_compile import shard_bytes
from mesh_transformer.parallel.layout import make_layout, zero_spec
from mesh_transformer.parallel.mesh import make_dp_mp
from mesh_transformer.store import checkpoint
from mesh_transformer.train import optim
from mesh_transformer.train import state as state_lib
from tests.helpers import layout_of

CFG = config.load("configs/tiny_rot_partial.json", ["remat=true", "warmup_steps=0", "gradient_accumulation_steps=2"])


def layout_for(dp: int, mp: int, shard: bool, **extra):
    cfg = dataclasses.replace(CFG, cores_per_replica=mp, per_replica_batch=8 // dp, shard_optimizer=shard, **extra)
    return make_layout(cfg, mesh=make_dp_mp(dp, mp))


def train(layout, steps: int = 3):
    """`steps` train steps from a fixed start on fixed batches of 2 x 8 sequences: (state, last metrics) on the host."""
    optimizer = optim.make_optimizer(layout.cfg)
    step = state_lib.make_train_step(layout, optimizer, optim.lr_schedule(layout.cfg))
    train_state = state_lib.init_train_state(layout, optimizer, jax.random.PRNGKey(0))
    frozen = {}
    if layout.cfg.lora_rank:  # the base: random params, held frozen where the layout keeps them
        frozen = jax.device_put(layout.init_params(jax.random.PRNGKey(5)), state_lib.frozen_shardings(layout))
    rng = np.random.default_rng(1)
    for _ in range(steps):
        tokens = rng.integers(0, CFG.n_vocab, (2, 8, CFG.seq + 1)).astype(np.int32)
        train_state, metrics = step(train_state, jax.device_put(tokens, layout.batch_sharding()), frozen)
    return jax.device_get(train_state), jax.device_get(metrics)


CASES = {"2x4": (2, 4, {}), "4x2": (4, 2, {}), "4x2-no-remat": (4, 2, {"remat": False}),
         "2x4-lora": (2, 4, {"lora_rank": 4})}


@pytest.mark.parametrize("case", CASES)
def test_sharded_optimizer_steps_equal_the_replicated_ones(case):
    dp, mp, extra = CASES[case]
    sharded, replicated = layout_for(dp, mp, True, **extra), layout_for(dp, mp, False, **extra)
    assert sharded.zero_axis == "dp" and replicated.zero_axis is None
    (got, got_metrics), (want, want_metrics) = train(sharded), train(replicated)
    assert (want_metrics["grad_norm"] > 1) == (case != "2x4-lora")  # the clip scales the full model's updates
    np.testing.assert_allclose(got_metrics["loss"], want_metrics["loss"], rtol=1e-6)
    np.testing.assert_allclose(got_metrics["grad_norm"], want_metrics["grad_norm"], rtol=1e-6)
    assert int(got["step"]) == int(want["step"]) == 3
    # Params and Adam's moments (and its count) after 3 steps, each leaf within 1e-6 of its norm: the sums over
    # replicas are taken in another order (once a step rather than once a micro-batch), an element's rounding with it.
    # LoRA's A matrices get gradients only through B, which starts at zero: sums of terms that nearly cancel.
    rtol = 1e-5 if extra.get("lora_rank") else 1e-6
    for got_leaf, want_leaf in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        error = np.linalg.norm(np.ravel(got_leaf - want_leaf))
        assert error <= rtol * np.linalg.norm(np.ravel(want_leaf)), (error, np.shape(want_leaf))


def test_each_replica_holds_its_share_of_the_moments():
    optimizer = optim.make_optimizer(CFG)
    sizes = {}
    for dp in (1, 2, 4):
        layout = layout_for(dp, 2, True)
        abstract = state_lib.abstract_train_state(layout, optimizer)
        sizes[dp] = shard_bytes(abstract["opt_state"])
        assert not any("dp" in leaf.sharding.spec for leaf in jax.tree.leaves(abstract["params"]))
        for leaf in jax.tree.leaves(abstract["opt_state"]):  # every weight matrix's moments split where dp > 1
            assert ("dp" in leaf.sharding.spec) == (dp > 1) or leaf.size <= 2 * CFG.d_ff, (leaf, dp)
    # Only a bias whose dimensions mp and the layer count leave indivisible is kept whole on each replica.
    assert sizes[1] / 2 < sizes[2] < 1.02 * sizes[1] / 2
    assert sizes[1] / 4 < sizes[4] < 1.05 * sizes[1] / 4


def test_a_moment_splits_on_its_largest_dimension_left_whole():
    assert zero_spec(jax.sharding.PartitionSpec(None, None, "mp"), (28, 4096, 512), "dp", 32) == \
        jax.sharding.PartitionSpec(None, "dp", "mp")
    assert zero_spec(jax.sharding.PartitionSpec("mp"), (50400, 4096), "dp", 4) == \
        jax.sharding.PartitionSpec("mp", "dp")
    # No dimension divisible by the replicas: kept whole on each.
    assert zero_spec(jax.sharding.PartitionSpec(), (3, 5), "dp", 4) == jax.sharding.PartitionSpec(None, None)


LAYOUTS = {"dp4-sharded": ("shard_map", 4, 2), "dp1": ("shard_map", 1, 2), "dp2-sharded": ("shard_map", 2, 4),
           "dp4-replicated": ("shard_map-replicated", 4, 2), "fsdp": ("fsdp", 1, 8, 1)}
PAIRS = [("dp4-sharded", "dp1"), ("dp4-sharded", "dp2-sharded"), ("dp4-sharded", "fsdp"),
         ("dp1", "dp4-sharded"), ("fsdp", "dp2-sharded"), ("dp4-replicated", "dp4-sharded")]


def named_layout(name):
    mode, *sizes = LAYOUTS[name]
    if mode == "shard_map-replicated":
        return layout_of(dataclasses.replace(CFG, shard_optimizer=False), ("shard_map", *sizes))
    return layout_of(CFG, (mode, *sizes))


@pytest.mark.parametrize("source,target", PAIRS, ids=[f"{a}-to-{b}" for a, b in PAIRS])
def test_a_checkpoint_moves_between_data_parallel_widths_bit_for_bit(tmp_path, source, target):
    saved_layout, restored_layout = named_layout(source), named_layout(target)
    optimizer = optim.make_optimizer(CFG)
    train_state = state_lib.init_train_state(saved_layout, optimizer, jax.random.PRNGKey(0))
    # Moments that are not zeros: one step's update of them, on the host, placed back where the layout keeps them.
    host = jax.device_get(train_state)
    rng = np.random.default_rng(2)
    host["opt_state"] = jax.tree.map(lambda x: (rng.standard_normal(x.shape) if x.ndim else x).astype(x.dtype),
                                     host["opt_state"])
    train_state = jax.tree.map(lambda h, x: jax.device_put(h, x.sharding), host, train_state)
    checkpoint.save(str(tmp_path), 1, train_state, {"config": CFG.to_dict()}, blocking=True)
    abstract = state_lib.abstract_train_state(restored_layout, optimizer)
    restored, _ = checkpoint.restore(str(tmp_path), 1, abstract)
    for got, want, like in zip(jax.tree.leaves(restored), jax.tree.leaves(host), jax.tree.leaves(abstract)):
        np.testing.assert_array_equal(np.asarray(got), want)
        assert got.sharding.is_equivalent_to(like.sharding, got.ndim)
