"""bench/weight_stream_ab.py compares forms of one product: each must compute what the plain bf16 product does."""
import jax
import jax.numpy as jnp
import numpy as np

from bench import weight_stream_ab as ab


def test_every_form_of_the_int8_product_computes_the_same_values(monkeypatch):
    from mesh_transformer.model import quant_kernel

    monkeypatch.setattr(quant_kernel, "INTERPRET", True)
    x = jax.random.normal(jax.random.PRNGKey(0), (8, 512)).astype(jnp.bfloat16)
    w_NxK = ab._hashed((1024, 512), jnp.int8, 3)
    s_N = jnp.linspace(0.01, 0.02, 1024, dtype=jnp.float32)
    want = ab.plain(x, w_NxK.astype(jnp.bfloat16), None, True) * s_N[None]
    forms = {"convert_nk": ab.convert(x, w_NxK, s_N, True), "convert_kn": ab.convert(x, w_NxK.T, s_N, False),
             "mixed_nk": ab.mixed(x, w_NxK, s_N, True),
             "pallas_nk": ab.pallas_int(x, w_NxK, s_N, True, "convert", 128 * 512, interpret=True),
             "pallas_kn": ab.pallas_int(x, w_NxK.T, s_N, False, "convert", 128 * 512, interpret=True),
             "pallas_tn": ab.pallas_tn(x, w_NxK, s_N, 128 * 512, interpret=True)}
    for name, got in forms.items():
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-3, err_msg=name)
    # The kernel returns x's dtype (bf16); the int8 x int8 forms quantize the rows (w8a8 to 8 bits, split16 to 16).
    np.testing.assert_allclose(np.asarray(ab._project_kernel(x, w_NxK, s_N)), np.asarray(want), rtol=1e-2, atol=0.05)
    scale = float(jnp.abs(want).max())
    assert float(jnp.abs(ab.split16(x, w_NxK, s_N, True) - want).max()) <= 1e-4 * scale
    assert float(jnp.abs(ab.split16(x, w_NxK.T, s_N, False) - want).max()) <= 1e-4 * scale
    assert float(jnp.abs(ab.w8a8(x, w_NxK, s_N, True) - want).max()) <= 0.05 * scale
    for w, nk in ((w_NxK, True), (w_NxK.T, False)):  # the Pallas int8 x int8 forms, a grid of 4 blocks
        split = ab.pallas_int(x, w, s_N, nk, "split16", 128 * 512, interpret=True)
        assert float(jnp.abs(split - want).max()) <= 1e-4 * scale
        w8a8 = ab.pallas_int(x, w, s_N, nk, "w8a8", 128 * 512, interpret=True)
        assert float(jnp.abs(w8a8 - want).max()) <= 0.05 * scale
    assert int(jnp.abs(w_NxK.astype(jnp.int32)).max()) == 127 and len(np.unique(np.asarray(w_NxK))) > 200
    # The int8s packed four to a word (negative ones included) and unpacked by shifts in the kernel; one row on the
    # vector unit over [K, N].
    packed = ab.pallas_packed(x, ab.pack4(w_NxK), s_N, 128 * 512, interpret=True)
    np.testing.assert_allclose(np.asarray(packed), np.asarray(want), rtol=1e-5, atol=1e-3)
    vpu = ab.pallas_vpu(x[:1], w_NxK.T, s_N, 256, interpret=True)
    np.testing.assert_allclose(np.asarray(vpu), np.asarray(want[:1]), rtol=1e-2, atol=1e-2)
