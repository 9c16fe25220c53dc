"""Weight-only int8: the quantizer's error bound, the dequantizing matrix product, and int8 inference against the
model in its compute dtype and across meshes."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mesh_transformer import config
from mesh_transformer.infer import decode, params as infer_params, sampler as sampling
from mesh_transformer.infer.params import make_inference_layout
from mesh_transformer.model import gptj, quant, table
from mesh_transformer.parallel.mesh import make_dp_mp
from tests.helpers import CPU_POLICY

CFG = config.load("configs/tiny_rot_partial.json", ["cores_per_replica=1", "remat=false"])  # seq 32, vocab 256
INT8 = dataclasses.replace(CFG, weight_dtype="int8")
PROMPTS = [[5, 17, 42], [100, 3, 7, 9, 250, 11, 2], list(range(20, 32)), [1]]


@pytest.fixture(scope="module")
def params():
    return jax.tree.map(np.asarray, table.init_unsharded(CFG, jax.random.PRNGKey(3)))


def test_rows_are_held_within_half_a_step_of_their_scale_in_numpy_and_jax():
    w = np.random.default_rng(0).standard_normal((3, 5, 64)).astype(np.float32) * [[[1.0]], [[1e-3]], [[40.0]]]
    w[0, 2] = 0.0  # an all-zero row
    for xp in (np, jnp):
        q, scale = quant.quantize_rows(xp.asarray(w), xp)
        assert q.dtype == np.int8 and scale.shape == (3, 5) and int(np.abs(np.asarray(q)).max()) <= 127
        error = np.abs(quant.dequantize_rows(np.asarray(q), np.asarray(scale)) - w)
        assert (error <= np.asarray(scale)[..., None] / 2 + 1e-7).all()
        assert np.asarray(scale)[0, 2] == 1 and not np.asarray(q)[0, 2].any()


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_the_dequantizing_product_equals_the_product_with_the_dequantized_matrix(dtype):
    rng = np.random.default_rng(1)
    x, w = rng.standard_normal((2, 7, 64)).astype(np.float32), rng.standard_normal((48, 64)).astype(np.float32)
    q, scale = quant.quantize_rows(w, np)
    got = jax.jit(quant.by_rows)(jnp.asarray(x, dtype), q, scale)
    assert got.dtype == dtype
    expected = x @ quant.dequantize_rows(q, scale).T
    np.testing.assert_allclose(np.asarray(got, np.float32), expected, rtol=0.02 if dtype == jnp.bfloat16 else 1e-5,
                               atol=0.05 if dtype == jnp.bfloat16 else 1e-4)


def test_int8_params_are_placed_as_int8_with_scales(params):
    layout = make_inference_layout(INT8, mesh=make_dp_mp(2, 4))
    placed = infer_params.place_params(params, layout)
    fused = placed["layers"][0]["fused"]
    assert fused["in"].dtype == jnp.int8 and fused["out"].dtype == jnp.int8
    assert fused["in_scale"].shape == fused["in"].shape[:2] and fused["out_scale"].shape == fused["out"].shape[:2]
    assert placed["lm_head"]["kernel"].dtype == gptj.compute_dtype(INT8)  # the head stays in the compute dtype


def prefill_logits(params, cfg, ids):
    """The logits after each row's last token [R, V] of the decode programs' prefill, with params placed for cfg."""
    placed = infer_params.place_params(params, make_inference_layout(cfg, mesh=make_dp_mp(1, 1)))
    cache = decode.KVCache(*([[jnp.zeros(decode.block_shape(len(ids), cfg.seq, cfg, CPU_POLICY), jnp.float32)]
                              for _ in range(cfg.layers)] for _ in range(2)))
    length, slots = np.full(len(ids), ids.shape[1], np.int32), np.arange(len(ids), dtype=np.int32)
    return np.asarray(jax.jit(lambda p, c: decode.prefill_logits(p, c, ids, length, slots, cfg, policy=CPU_POLICY))(
        placed, cache)[0])


def test_int8_logits_stay_close_to_the_compute_dtype_ones(params):
    ids = np.random.default_rng(2).integers(0, CFG.n_vocab, (16, 12)).astype(np.int32)
    ref, ours = prefill_logits(params, CFG, ids), prefill_logits(params, INT8, ids)
    relative_rms = np.sqrt(np.mean((ours - ref) ** 2)) / ref.std()
    assert relative_rms < 0.05, relative_rms
    assert np.mean(ours.argmax(-1) == ref.argmax(-1)) >= 0.9


def test_int8_on_dp2_mp4_equals_int8_on_one_device(params):
    one = sampling.Sampler(make_inference_layout(INT8, mesh=make_dp_mp(1, 1)), params)
    sharded = sampling.Sampler(make_inference_layout(INT8, mesh=make_dp_mp(2, 4)), params)
    expected = one.generate(PROMPTS, 8, temperature=0.0, return_logprobs=True)
    for ours, ref in zip(sharded.generate(PROMPTS, 8, temperature=0.0, return_logprobs=True), expected):
        assert ours.tokens == ref.tokens
        np.testing.assert_allclose(ours.logprobs, ref.logprobs, atol=1e-4)
