import dataclasses
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mesh_transformer import config, platforms
from mesh_transformer.model import families, layers, table, gptj as model
from mesh_transformer.parallel.mesh import make_dp_mp
from mesh_transformer.parallel.layout import make_layout
from tests.helpers import CPU_POLICY

CFG = config.load("configs/tiny_rot_partial.json", ["cores_per_replica=1", "remat=false"])
MESHES = [(1, 8), (2, 4), (4, 2), (8, 1)]


@pytest.fixture(scope="module")
def params():
    return table.init_unsharded(CFG, jax.random.PRNGKey(0))


@pytest.fixture(scope="module")
def tokens():
    return jax.random.randint(jax.random.PRNGKey(1), (8, CFG.seq + 1), 0, CFG.n_vocab)


def max_diff(a, b):
    return max(float(jnp.abs(x - y).max()) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


@pytest.mark.parametrize("dp, mp", MESHES, ids=[f"dp{d}-mp{m}" for d, m in MESHES])
def test_sharded_forward_loss_and_grads_match_single_device(params, tokens, dp, mp):
    cfg = dataclasses.replace(CFG, cores_per_replica=mp)
    mesh = make_dp_mp(dp, mp)
    layout = make_layout(cfg, mesh=mesh)
    sharded = layout.init_params(jax.random.PRNGKey(0))
    assert max_diff(sharded, params) == 0.0  # same key, same numbers, whatever the layout
    assert sharded["layers"]["attn"]["q"].addressable_shards[0].data.shape[-1] == CFG.d_model // mp

    logits = layout.logits_fn()(sharded, tokens[:, :-1])
    ref_logits = jax.jit(lambda p, x: model.forward(p, x, CFG, policy=CPU_POLICY))(params, tokens[:, :-1])
    np.testing.assert_allclose(logits, ref_logits, atol=1e-5)

    loss, grads = jax.jit(layout.loss_and_grad_fn())(sharded, {}, tokens)
    value_and_grad = jax.value_and_grad(lambda p, x: model.loss_fn(p, x, CFG, policy=CPU_POLICY))
    ref_loss, ref_grads = jax.jit(value_and_grad)(params, tokens)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)
    np.testing.assert_allclose(jax.jit(layout.loss_fn())(sharded, {}, tokens), ref_loss, rtol=1e-6)
    assert max_diff(grads, ref_grads) < 1e-6


@pytest.mark.parametrize("mp", [1, 4])
def test_vocab_sharded_cross_entropy_equals_dense(mp):
    logits = jax.random.normal(jax.random.PRNGKey(2), (2, 5, 64)) * 4
    targets = jax.random.randint(jax.random.PRNGKey(3), (2, 5), 0, 64)
    dense = -jnp.take_along_axis(jax.nn.log_softmax(logits), targets[..., None], -1)[..., 0]
    mesh = make_dp_mp(1, mp)
    P = jax.sharding.PartitionSpec
    fn = jax.shard_map(lambda lg, t: layers.cross_entropy(lg, t, "mp"), mesh=mesh,
                       in_specs=(P(None, None, "mp"), P()), out_specs=P())
    np.testing.assert_allclose(fn(logits, targets), dense, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(layers.cross_entropy(logits, targets), dense, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("mp", [1, 4])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_head_cross_entropy_gradients_equal_autodiff(mp, dtype):
    """The hand-written backward through LN, LM head and CE equals autodiff of cross_entropy(head(h)), also for
    uneven per-token cotangents and with the vocab sharded over 'mp'."""
    B, T, D, V = 2, 6, 16, 64
    k = jax.random.split(jax.random.PRNGKey(4), 6)
    h = jax.random.normal(k[0], (B, T, D)).astype(dtype)
    ln_f = {"scale": 1 + 0.1 * jax.random.normal(k[1], (D,)), "bias": 0.1 * jax.random.normal(k[2], (D,))}
    lm_head = {"kernel": jax.random.normal(k[3], (D, V)).astype(dtype), "bias": jax.random.normal(k[4], (V,))}
    targets = jax.random.randint(k[5], (B, T), 0, V)
    weights = jnp.arange(B * T, dtype=jnp.float32).reshape(B, T)

    def reference(h, ln_f, lm_head):
        return (layers.cross_entropy(layers.head(h, ln_f, lm_head), targets) * weights).sum()

    P = jax.sharding.PartitionSpec
    specs = (P(), P(), {"kernel": P(None, "mp"), "bias": P("mp")})
    fused = jax.shard_map(lambda h, ln, head: (layers.head_cross_entropy(h, ln, head, targets, "mp") * weights).sum(),
                          mesh=make_dp_mp(1, mp), in_specs=specs, out_specs=P())
    ref_loss, ref_grads = jax.value_and_grad(reference, (0, 1, 2))(h, ln_f, lm_head)
    loss, grads = jax.jit(jax.value_and_grad(fused, (0, 1, 2)))(h, ln_f, lm_head)
    tol = 1e-5 if dtype == jnp.float32 else 2e-2
    np.testing.assert_allclose(loss, ref_loss, rtol=tol)
    for got, want in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads)):
        assert got.dtype == want.dtype
        scale = float(jnp.abs(want.astype(jnp.float32)).max())
        assert float(jnp.abs(got.astype(jnp.float32) - want.astype(jnp.float32)).max()) <= tol * scale


@pytest.mark.parametrize("d_in, d_out", [(8, 24), (24, 8), (16, 16)])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_dense_gradients_equal_autodiff_of_the_product(d_in, d_out, dtype):
    """`layers.dense`'s hand-written backward (either form of the weight's gradient) equals autodiff of x @ w, in
    the input's dtype, also with the weight's columns sharded over 'mp' and the batch over 'dp'."""
    k = jax.random.split(jax.random.PRNGKey(5), 3)
    x = jax.random.normal(k[0], (4, 6, d_in)).astype(dtype)
    w = jax.random.normal(k[1], (d_in, d_out)).astype(dtype)
    g = jax.random.normal(k[2], (4, 6, d_out))

    def loss(dense):
        return lambda x, w: (dense(x, w).astype(jnp.float32) * g).sum()

    want = jax.grad(loss(lambda x, w: x @ w), (0, 1))(x, w)
    P = jax.sharding.PartitionSpec
    def dense_loss(x, w, g):
        return (layers.dense(x, w, CPU_POLICY).astype(jnp.float32) * g).sum(keepdims=True)

    sharded = jax.shard_map(dense_loss,
                            mesh=make_dp_mp(2, 2), in_specs=(P("dp"), P(None, "mp"), P("dp", None, "mp")),
                            out_specs=P(("dp", "mp")))
    tol = 1e-6 if dtype == jnp.float32 else 1e-2
    for got in (jax.jit(jax.grad(loss(partial(layers.dense, policy=CPU_POLICY)), (0, 1)))(x, w),
                jax.jit(jax.grad(lambda x, w: sharded(x, w, g).sum(), (0, 1)))(x, w)):
        for a, b in zip(got, want):
            assert a.dtype == b.dtype == dtype
            scale = float(jnp.abs(b.astype(jnp.float32)).max())
            assert float(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32)).max()) <= tol * scale


def test_changing_a_token_changes_no_earlier_logit(params, tokens):
    ids = tokens[:2, :-1]
    t = 10
    changed = ids.at[:, t].set((ids[:, t] + 1) % CFG.n_vocab)
    fwd = jax.jit(lambda p, x: model.forward(p, x, CFG, policy=CPU_POLICY))
    a, b = fwd(params, ids), fwd(params, changed)
    np.testing.assert_array_equal(a[:, :t], b[:, :t])
    assert float(jnp.abs(a[:, t:] - b[:, t:]).max()) > 1e-3


def test_remat_gives_equal_gradients(params, tokens):
    def grads(remat, remat_policy="full"):
        cfg = dataclasses.replace(CFG, remat=remat, remat_policy=remat_policy)
        return jax.jit(jax.grad(lambda p, x: model.loss_fn(p, x, cfg, policy=CPU_POLICY)))(params, tokens)

    plain = grads(False)
    for policy in ("full", "save_qkv", "save_mlp_hidden"):
        assert max_diff(grads(True, policy), plain) < 1e-6, policy


def test_bf16_compute_stays_close_to_f32(params, tokens):
    f32 = jax.jit(lambda p, x: model.forward(p, x, CFG, policy=CPU_POLICY))(params, tokens[:, :-1])
    bf16_cfg = dataclasses.replace(CFG, compute_dtype="bfloat16")
    bf16 = jax.jit(lambda p, x: model.forward(p, x, bf16_cfg, policy=CPU_POLICY))(params, tokens[:, :-1])
    assert bf16.dtype == jnp.float32  # logits stay f32
    assert float(jnp.abs(bf16 - f32).max()) < 0.05 * float(jnp.abs(f32).max())
    loss32 = model.loss_fn(params, tokens, CFG, policy=CPU_POLICY)
    loss16 = model.loss_fn(params, tokens, bf16_cfg, policy=CPU_POLICY)
    assert abs(float(loss16) - float(loss32)) < 0.01 * float(loss32)


def test_init_follows_the_original_scales(params):
    D, V, L = CFG.d_model, CFG.n_vocab, CFG.layers
    assert float(params["embed"]["wte"].std()) == pytest.approx(0.88 / V ** 0.5, rel=0.1)
    assert float(params["layers"]["attn"]["q"].std()) == pytest.approx(0.88 / D ** 0.5, rel=0.1)
    assert float(params["layers"]["mlp"]["fc_out"]["kernel"].std()) == pytest.approx(0.88 * 2 / L / D ** 0.5, rel=0.1)
    assert float(jnp.abs(params["layers"]["attn"]["q"]).max()) <= 2 / D ** 0.5
    np.testing.assert_array_equal(params["layers"]["ln_1"]["scale"], 1.0)
    np.testing.assert_array_equal(params["lm_head"]["bias"], 0.0)


def test_auto_compute_dtype_is_bf16_on_accelerators_and_f32_on_cpu():
    auto = dataclasses.replace(CFG, compute_dtype="auto")
    assert config.Config().compute_dtype == "auto"
    gpu, tpu = platforms.for_platform("gpu"), platforms.for_platform("tpu")
    assert model.precision(auto, gpu).compute == jnp.bfloat16 and model.precision(auto, tpu).compute == jnp.bfloat16
    assert model.precision(auto, CPU_POLICY).compute == jnp.float32 and model.precision(auto).compute == jnp.float32
    assert model.precision(dataclasses.replace(CFG, compute_dtype="bfloat16"), CPU_POLICY).compute == jnp.bfloat16
    # A Layout resolves "auto" for its devices (the tests': CPU_POLICY).
    assert make_layout(auto, jax.devices()[:1]).cfg.compute_dtype == "float32"


@pytest.mark.parametrize("parallelism, dp, mp", [("shard_map", 1, 1), ("shard_map", 2, 4), ("fsdp", 8, 1)],
                         ids=["single", "dp2-mp4", "fsdp8"])
def test_train_step_with_joined_projections_equals_the_unjoined_step(tokens, parallelism, dp, mp):
    """Joining q, k, v, fc_in and out, fc_out inside the step changes neither the loss nor the gradients (f32) on
    each layout; and (on one device: the wiring does not depend on the mesh) the train step's loss and gradient norm
    with them."""
    from mesh_transformer.parallel.mesh import make_mesh
    from mesh_transformer.train import optim, state as state_lib

    def one_step(join):
        cfg = dataclasses.replace(CFG, cores_per_replica=mp, remat=True, join_projections=join, warmup_steps=0,
                                  parallelism=parallelism, mesh_fsdp=dp if parallelism == "fsdp" else 1)
        mesh = make_dp_mp(dp, mp) if parallelism == "shard_map" else make_mesh({"data": 1, "fsdp": dp, "tensor": 1})
        layout = make_layout(cfg, mesh=mesh)
        opt = optim.make_optimizer(cfg)
        state = state_lib.init_train_state(layout, opt, jax.random.PRNGKey(0))
        grads = jax.jit(layout.loss_and_grad_fn())(state["params"], {}, tokens)[1]
        if dp * mp > 1:
            return grads, None
        batch = jax.device_put(tokens[None], layout.batch_sharding())
        return grads, state_lib.make_train_step(layout, opt, optim.lr_schedule(cfg))(state, batch, {})[1]

    (joined_grads, joined), (plain_grads, plain) = one_step(True), one_step(False)
    assert max_diff(joined_grads, plain_grads) < 1e-6
    if joined is not None:
        np.testing.assert_allclose(joined["loss"], plain["loss"], rtol=1e-6)
        np.testing.assert_allclose(joined["grad_norm"], plain["grad_norm"], rtol=1e-5)


def test_the_one_forward_on_unstacked_layers_and_chosen_columns_equals_the_stacked_forward(params, tokens):
    """`run` on a list of layers (the inference form) at chosen positions gives the stacked forward's logits there."""
    ids = tokens[:2, :-1]
    full = model.forward(params, ids, CFG, policy=CPU_POLICY)
    columns = jnp.array([[0, 5], [3, CFG.seq - 1]])
    picked, states = model.run(table.unstack_layers(params), ids, model.positions(ids), CFG, policy=CPU_POLICY,
                               columns_BxC=columns)
    np.testing.assert_allclose(picked, jnp.take_along_axis(full, columns[..., None], axis=1), atol=1e-5)
    assert states == [None] * CFG.layers


@pytest.mark.parametrize("name", families.names())
def test_each_familys_param_table_names_every_lora_target_and_hf_weight_once(name):
    cfg = dataclasses.replace(CFG, family=name)
    targets = set(table.lora_targets(cfg))  # every family's six, a gated MLP's "gate" too
    assert set(config.LORA_TARGETS) - {"gate"} <= targets <= set(config.LORA_TARGETS)
    rows = table.params_table(cfg)
    names = [(row.hf, row.hf_part) for row in rows.values()]
    assert len(names) == len(set(names))
    for path, row in rows.items():
        assert (path[0] == "layers") == (row.axes[0] == "layers")
        assert row.lora is None or (row.decayed and len(row.axes) == 3)
