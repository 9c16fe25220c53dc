from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mesh_transformer.model import attention, families, fused, layers, rotary, table
from tests.helpers import CPU_POLICY


B, T, H, K = 3, 12, 4, 16


def qkv(dtype):
    keys = jax.random.split(jax.random.PRNGKey(0), 3)
    return [jax.random.normal(k, (B, T, H, K)).astype(dtype) for k in keys]


def reference(q, k, v, length_B=None):
    """Today's `attend` with the causal mask, and keys at or after each row's length masked."""
    mask_BxTxT = jnp.broadcast_to(attention.causal_mask(T), (B, T, T))
    if length_B is not None:
        mask_BxTxT = mask_BxTxT & (jnp.arange(T)[None] < length_B[:, None])[:, None, :]
    return attention.attend(q, k, v, mask_BxTxT)


IMPLEMENTATIONS = {"dot_product_attention": attention.dot_product_attention,
                   "blocked": partial(attention.blocked_attention, n_blocks=4),
                   "blocked_uneven": partial(attention.blocked_attention, n_blocks=5)}


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
@pytest.mark.parametrize("padded", [False, True], ids=["causal", "causal+padding"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_training_attention_equals_attend_with_its_gradients(dtype, padded, impl):
    """Each training/prefill attention (XLA's or cuDNN's dot_product_attention, and the blocked one CPU runs, with
    uneven blocks too) equals `attend` with the causal mask, and so do its gradients."""
    attention = IMPLEMENTATIONS[impl]
    q, k, v = qkv(dtype)
    length_B = jnp.array([T, 5, 1]) if padded else None
    tol = 1e-5 if dtype == jnp.float32 else 2e-2
    weights = jax.random.normal(jax.random.PRNGKey(1), (B, T, H * K))

    def loss(fn):
        return lambda q, k, v: (fn(q, k, v, length_B).astype(jnp.float32) * weights).sum()

    got = jax.jit(attention)(q, k, v, length_B)
    want = jax.jit(reference)(q, k, v, length_B)
    assert got.dtype == want.dtype == dtype and got.shape == (B, T, H * K)
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), atol=tol, rtol=tol)
    got_grads = jax.jit(jax.grad(loss(attention), (0, 1, 2)))(q, k, v)
    want_grads = jax.jit(jax.grad(loss(reference), (0, 1, 2)))(q, k, v)
    for a, b in zip(got_grads, want_grads):
        scale = float(jnp.abs(b.astype(jnp.float32)).max())
        assert float(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32)).max()) <= tol * scale


@pytest.mark.parametrize("padded", [False, True], ids=["causal", "causal+padding"])
@pytest.mark.parametrize("block, length", [(128, 256), (256, 384)], ids=["128-of-256", "at-most-256-of-384"])
def test_splash_attention_equals_xlas_with_its_gradients(monkeypatch, padded, block, length):
    """JAX's TPU splash kernel (Pallas' interpreter on the CPU), in blocks of 128 over 256 positions (the block
    above the diagonal skipped), or of at most 256 over 384 (128: the largest that divides them), against XLA's
    attention: the output at every real position and the gradients of q, k and v through them."""
    monkeypatch.setattr(attention, "SPLASH_BLOCK", block)
    monkeypatch.setattr(attention, "SPLASH_INTERPRET", True)
    rows, heads, head_dim = 2, 2, 128
    shape = (rows, length, heads, head_dim)
    q, k, v = (jax.random.normal(key, shape) for key in jax.random.split(jax.random.key(3), 3))
    length_B = jnp.array([length, 100]) if padded else None
    real_BxTx1 = (jnp.arange(length)[None] < (length_B if padded else jnp.full(rows, length))[:, None])[..., None]
    weights = jax.random.normal(jax.random.key(4), (rows, length, heads * head_dim)) * real_BxTx1

    def loss(kernel):
        return lambda q, k, v: (attention.self_attention(q, k, v, length_B, kernel=kernel) * weights).sum()

    got = jax.jit(partial(attention.self_attention, kernel="splash"))(q, k, v, length_B)
    got_grads = jax.jit(jax.grad(loss("splash"), (0, 1, 2)))(q, k, v)
    want = attention.self_attention(q, k, v, length_B, kernel="xla")
    np.testing.assert_allclose(np.asarray(got * real_BxTx1), np.asarray(want * real_BxTx1), atol=1e-5, rtol=1e-5)
    for a, b in zip(got_grads, jax.grad(loss("xla"), (0, 1, 2))(q, k, v)):
        assert float(jnp.abs(a - b).max()) <= 1e-5 * float(jnp.abs(b).max())


def test_splash_attention_in_bf16_runs_its_kernels_at_the_default_precision_under_highest(monkeypatch):
    """bf16 products are exact at any precision, and Mosaic refuses them at "highest": splash's forward and backward
    are traced at the default whatever the caller set, with the same values and gradients as without the setting."""
    monkeypatch.setattr(attention, "SPLASH_BLOCK", 128)
    monkeypatch.setattr(attention, "SPLASH_INTERPRET", True)
    shape = (1, 256, 2, 128)
    q, k, v = (jax.random.normal(key, shape).astype(jnp.bfloat16) for key in jax.random.split(jax.random.key(5), 3))
    weights = jax.random.normal(jax.random.key(6), (1, 256, 256)).astype(jnp.bfloat16)

    def loss(q, k, v):
        return (attention.self_attention(q, k, v, kernel="splash") * weights).astype(jnp.float32).sum()

    precisions = []
    monkeypatch.setattr(attention, "_splash_kernel", lambda *a, made=attention._splash_kernel: (
        lambda *x: precisions.append(jax.config.jax_default_matmul_precision) or made(*a)(*x)))
    want, want_grads = jax.jit(jax.value_and_grad(loss, (0, 1, 2)))(q, k, v)
    with jax.default_matmul_precision("highest"):
        got, got_grads = jax.jit(jax.value_and_grad(loss, (0, 1, 2)))(q, k, v)
    assert precisions and set(precisions) == {"default"}  # the kernel traced at the default both times
    assert float(got) == float(want)
    for a, b in zip(got_grads, want_grads):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


def test_splash_attention_runs_under_gspmd_and_is_refused_under_shard_map():
    """A Pallas call is not partitioned by GSPMD, and under shard_map splash's output carries no mesh typing for
    check_vma: splash goes with a GSPMD layout, on several devices per device over its rows and heads."""
    import dataclasses

    from jax.sharding import PartitionSpec as P

    from mesh_transformer import config
    from mesh_transformer.parallel.layout import make_layout

    megatron = make_layout(config.load("configs/tiny_rot_partial.json", ["cores_per_replica=2"]), jax.devices()[:4])
    with pytest.raises(ValueError, match="splash attention runs under a GSPMD layout"):
        dataclasses.replace(megatron, policy=dataclasses.replace(megatron.policy, attention="splash"))
    assert megatron.with_attention("splash").policy.attention == "xla"
    one = make_layout(config.load("configs/tiny_rot_partial.json", ["parallelism=fsdp"]), jax.devices()[:1])
    assert one.with_attention("splash").policy.attention_shards is None
    fsdp_tp = config.load("configs/tiny_rot_partial.json", ["parallelism=fsdp_tp", "mesh_fsdp=2", "mesh_tensor=2"])
    split = make_layout(fsdp_tp, jax.devices()[:8]).with_attention("splash").policy
    assert split.attention == "splash" and split.attention_shards[1] == P(("data", "fsdp"), None, "tensor", None)


def test_splash_attention_over_a_gspmd_mesh_equals_one_devices_training_step(monkeypatch):
    """The loss and gradients of a GSPMD layout on data 2 x fsdp 2 x tensor 2 with splash (Pallas' interpreter, each
    device its rows and heads) equal one device's with XLA's attention."""
    import dataclasses

    from mesh_transformer import config
    from mesh_transformer.parallel.layout import make_layout
    from mesh_transformer.parallel.mesh import make_mesh

    monkeypatch.setattr(attention, "SPLASH_BLOCK", 128)
    monkeypatch.setattr(attention, "SPLASH_INTERPRET", True)
    cfg = config.from_dict({"layers": 1, "d_model": 256, "n_heads": 2, "n_vocab": 256, "pe_rotary_dims": 16,
                            "seq": 256, "parallelism": "fsdp_tp", "mesh_fsdp": 2, "mesh_tensor": 2, "remat": False})
    tokens = np.random.default_rng(0).integers(0, cfg.n_vocab, (4, cfg.seq + 1)).astype(np.int32)
    one = make_layout(dataclasses.replace(cfg, parallelism="dp", mesh_fsdp=1, mesh_tensor=1),
                      jax.devices()[:1]).with_attention("xla")
    split = make_layout(cfg, mesh=make_mesh({"data": 2, "fsdp": 2, "tensor": 2})).with_attention("splash")
    assert split.policy.attention == "splash" and split.policy.attention_shards is not None
    params = table.init_params(cfg, jax.random.PRNGKey(0))
    (want_loss, want_grads), (loss, grads) = (
        jax.jit(layout.loss_and_grad_fn())(jax.device_put(params, layout.param_shardings()), {}, tokens)
        for layout in (one, split))
    np.testing.assert_allclose(float(loss), float(want_loss), rtol=1e-5)
    for got, want in zip(jax.tree.leaves(grads), jax.tree.leaves(want_grads), strict=True):
        got, want = np.asarray(got), np.asarray(want)
        assert np.abs(got - want).max() <= 1e-4 * np.abs(want).max()


def layer_params(keys, D):
    return {"ln_1": {"scale": jnp.ones(D), "bias": jnp.zeros(D)},
            "attn": {name: jax.random.normal(key, (D, D)) / D ** 0.5 for name, key in zip("qkv", keys)}
            | {"out": jax.random.normal(keys[3], (D, D)) / D ** 0.5},
            "mlp": {"fc_in": {"kernel": jax.random.normal(keys[4], (D, 4 * D)) / D ** 0.5,
                              "bias": jax.random.normal(keys[7], (4 * D,))},
                    "fc_out": {"kernel": jax.random.normal(keys[5], (4 * D, D)) / D ** 0.5, "bias": jnp.ones(D)}}}


def test_block_without_a_mask_is_causal_attention_as_before():
    """`block` with mask None (the training and prefill path) equals the same block given the causal mask (the
    block-cache path, `attend`)."""
    D = H * K
    keys = jax.random.split(jax.random.PRNGKey(2), 8)
    p = layer_params(keys, D)
    h = jax.random.normal(keys[6], (B, T, D))
    sincos = rotary.rotary_sincos(jnp.arange(T)[None], 8)
    arch = families.named("gptj").block
    got, (k, v) = jax.jit(lambda h: layers.block(h, p, K, sincos, arch=arch, policy=CPU_POLICY))(h)
    want, (k_ref, v_ref) = jax.jit(lambda h: layers.block(h, p, K, sincos, arch=arch,
                                                          mask_BxTxT=attention.causal_mask(T), policy=CPU_POLICY))(h)
    np.testing.assert_allclose(got, want, atol=1e-5)
    np.testing.assert_array_equal(k, k_ref)


def test_block_is_gptj_s_layer_whichever_way_its_weights_are_applied():
    """The one block body over each `projections` form (the param tree's six products, joined inside the
    computation, `fuse_layer`'s matrices) equals GPT-J's layer written out: h + out(Attn(LN h)) + fc_out(gelu(fc_in
    (LN h))), with the keys it returns rotated."""
    D = H * K
    keys = jax.random.split(jax.random.PRNGKey(3), 8)
    p = layer_params(keys, D)
    h = jax.random.normal(keys[6], (B, T, D))
    sincos = rotary.rotary_sincos(jnp.arange(T)[None], 8)

    def written_out(h):
        n = layers.layer_norm(h, p["ln_1"])
        q, k, v = (rotary.apply_rotary((n @ p["attn"][x]).reshape(B, T, H, K), *sincos) if x != "v"
                   else (n @ p["attn"][x]).reshape(B, T, H, K) for x in "qkv")
        attn = attention.attend(q, k, v, jnp.broadcast_to(attention.causal_mask(T), (B, T, T))) @ p["attn"]["out"]
        mlp = jax.nn.gelu(n @ p["mlp"]["fc_in"]["kernel"] + layers.lead(p["mlp"]["fc_in"]["bias"], 3),
                          approximate=True)
        return h + attn + mlp @ p["mlp"]["fc_out"]["kernel"] + layers.lead(p["mlp"]["fc_out"]["bias"], 3), k

    want, k_want = jax.jit(written_out)(h)
    forms = {"separate": (p, False), "joined": (p, True), "fused": (fused.fuse_layer(p, 1), False)}
    for name, (layer, join) in forms.items():
        got, (k, _) = jax.jit(partial(layers.block, head_dim=K, sincos=sincos, arch=families.named("gptj").block,
                                      join=join, policy=CPU_POLICY))(h, layer)
        np.testing.assert_allclose(got, want, atol=1e-4, err_msg=name)
        np.testing.assert_allclose(k, k_want, atol=1e-5, err_msg=name)

