"""Weight-only int8: the quantizer's error bound, the dequantizing matrix product, and int8 inference against the
model in its compute dtype and across meshes."""
import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mesh_transformer import config, storage
from mesh_transformer.infer import decode, params as infer_params, sampler as sampling
from mesh_transformer.infer.params import make_inference_layout
from mesh_transformer.model import gptj, quant, quant_kernel, table
from mesh_transformer.parallel.mesh import make_dp_mp
from mesh_transformer.store import checkpoint, convert
from tests.helpers import CPU_POLICY, run_script

CFG = config.load("configs/tiny_rot_partial.json", ["cores_per_replica=1", "remat=false"])  # seq 32, vocab 256
INT8 = dataclasses.replace(CFG, weight_dtype="int8")
HEAD8 = dataclasses.replace(INT8, quantize_head=True)
PROMPTS = [[5, 17, 42], [100, 3, 7, 9, 250, 11, 2], list(range(20, 32)), [1]]


def gptj_matrices() -> dict:
    """The int8 matrices of GPT-J's layers and their scale groups (no gate: a gated MLP's)."""
    return quant.matrices(path[1:] for path, _ in table.param_paths(CFG) if path[0] == "layers")


@pytest.fixture(scope="module")
def params():
    return jax.tree.map(np.asarray, table.init_unsharded(CFG, jax.random.PRNGKey(3)))


def test_columns_are_held_within_half_a_step_of_their_scale_in_numpy_and_jax():
    w = np.random.default_rng(0).standard_normal((64, 5)).astype(np.float32) * np.array([1.0, 1e-3, 0.0, 40.0, 1.0])
    for xp in (np, jnp):  # column 2 is all zeros
        scale = quant.scale_of(quant.amax(xp.asarray(w), xp), xp)
        q = quant.quantize(xp.asarray(w), scale, xp)
        assert q.dtype == np.int8 and scale.shape == (5,) and int(np.abs(np.asarray(q)).max()) == 127
        error = np.abs(quant.dequantize(q, scale) - w)
        assert (error <= np.asarray(scale) / 2 + 1e-7).all()
        assert np.asarray(scale)[2] == 1 and not np.asarray(q)[:, 2].any()


def test_attn_out_and_fc_out_share_their_scales_and_the_rest_have_their_own(params):
    layer = jax.tree.map(lambda x: x[0], params["layers"])
    held, scales = quant.quantize_layer(layer)
    out, fc_out = layer["attn"]["out"], layer["mlp"]["fc_out"]["kernel"]
    np.testing.assert_array_equal(scales["out"], np.maximum(np.abs(out).max(0), np.abs(fc_out).max(0)) / 127)
    np.testing.assert_array_equal(scales["q"], np.abs(layer["attn"]["q"]).max(0) / 127)
    for path, group in gptj_matrices().items():
        q = table.get_path(held, path)
        assert q.dtype == np.int8
        error = np.abs(quant.dequantize(q, scales[group]) - table.get_path(layer, path))
        assert (error <= scales[group] / 2 + 1e-7).all()
    np.testing.assert_array_equal(held["ln_1"]["scale"], layer["ln_1"]["scale"])  # only the matrices change


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_the_dequantizing_product_equals_the_product_with_the_dequantized_matrix(dtype):
    rng = np.random.default_rng(1)
    x, w = rng.standard_normal((2, 7, 64)).astype(np.float32), rng.standard_normal((64, 48)).astype(np.float32)
    scale = quant.scale_of(quant.amax(w))
    q = quant.quantize(w, scale)
    got = jax.jit(quant.by_rows)(jnp.asarray(x, dtype), q.T, scale)
    assert got.dtype == dtype
    expected = x @ quant.dequantize(q, scale)
    np.testing.assert_allclose(np.asarray(got, np.float32), expected, rtol=0.02 if dtype == jnp.bfloat16 else 1e-5,
                               atol=0.05 if dtype == jnp.bfloat16 else 1e-4)


def test_int8_params_are_placed_as_int8_with_scales(params):
    layout = make_inference_layout(INT8, mesh=make_dp_mp(2, 4))
    placed = infer_params.place_params(params, layout)
    fused = placed["layers"][0]["fused"]
    assert fused["in"].dtype == jnp.int8 and fused["out"].dtype == jnp.int8
    assert fused["in_scale"].shape == fused["in"].shape[:2] and fused["out_scale"].shape == fused["out"].shape[:2]
    assert placed["lm_head"]["kernel"].dtype == gptj.precision(INT8).compute  # the head stays in the compute dtype
    head = infer_params.place_params(params, make_inference_layout(HEAD8, mesh=make_dp_mp(2, 4)))["lm_head"]
    assert head["kernel"].dtype == jnp.int8 and head["scale"].shape == (CFG.n_vocab,)
    assert head["scale"].sharding.spec == head["bias"].sharding.spec  # split over the vocab as the head is


def prefill_logits(params, cfg, ids, policy=CPU_POLICY):
    """The logits after each row's last token [R, V] of the decode programs' prefill, with params placed for cfg."""
    placed = infer_params.place_params(params, make_inference_layout(cfg, mesh=make_dp_mp(1, 1)))
    block = jnp.zeros(decode.block_shape(len(ids), cfg.seq, cfg, policy), decode.cache_dtype(cfg, policy))
    cache = decode.KVCache(*([[block]
                              for _ in range(cfg.layers)] for _ in range(2)))
    length, slots = np.full(len(ids), ids.shape[1], np.int32), np.arange(len(ids), dtype=np.int32)
    return np.asarray(jax.jit(lambda p, c: decode.prefill_logits(p, c, ids, length, slots, cfg, policy=policy))(
        placed, cache)[0])


@pytest.mark.parametrize("weights", ["compute", "int8"])
def test_products_in_pieces_equal_whole_products(params, weights):
    cfg = dataclasses.replace(HEAD8 if weights == "int8" else CFG, compute_dtype="bfloat16")
    ids = np.random.default_rng(4).integers(0, CFG.n_vocab, (4, 12)).astype(np.int32)
    whole = prefill_logits(params, cfg, ids, dataclasses.replace(CPU_POLICY, dot_piece_bytes=0))
    # 4 KiB of f32 weights a piece: the joined input matrix in 28 pieces, the head in 16.
    pieces = prefill_logits(params, cfg, ids, dataclasses.replace(CPU_POLICY, dot_piece_bytes=4096))
    np.testing.assert_allclose(pieces, whole, rtol=0, atol=1e-5)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_the_int8_kernel_equals_xlas_dequantizing_product(monkeypatch, dtype):
    """model/quant_kernel.py in Pallas' interpreter, its grid over blocks of w's rows (128 rows of 256: 3 blocks),
    against quant.by_rows: the same products of x's dtype accumulated in f32, then scaled."""
    monkeypatch.setattr(quant_kernel, "INTERPRET", True)
    monkeypatch.setattr(quant_kernel, "BLOCK_BYTES", 128 * 256)
    rng = np.random.default_rng(4)
    x = jnp.asarray(rng.standard_normal((3, 2, 256)), dtype)
    w = quant.quantize(rng.standard_normal((256, 384)).astype(np.float32), np.full(384, 0.02, np.float32)).T
    scale = jnp.asarray(rng.uniform(0.01, 0.03, 384), jnp.float32)
    assert quant_kernel.applies(x, w) and quant_kernel._block_rows(384, 256) == 128
    got, want = jax.jit(quant_kernel.by_rows)(x, w, scale), jax.jit(quant.by_rows)(x, w, scale)
    assert got.dtype == want.dtype == dtype and got.shape == (3, 2, 384)
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=1e-6, atol=1e-6)
    too_many_rows = jnp.zeros((quant_kernel.MAX_ROWS + 1, 256), dtype)
    assert not quant_kernel.applies(too_many_rows, w) and not quant_kernel.applies(x[..., :192], w[:, :192])


@pytest.mark.parametrize("rows,cols", [((0, 128), (0, 256)), ((128, 384), (256, 512)), ((128, 384), (128, 384))],
                         ids=["first-rows", "whole-column-blocks", "column-offset"])
def test_the_int8_kernel_reads_a_range_of_rows_and_columns_in_place(monkeypatch, rows, cols):
    """A product of w's rows r0:r1 and columns c0:c1 (a side of a joined matrix) equals XLA's product of the slices,
    the column offset in whole blocks of the range or at an element offset."""
    monkeypatch.setattr(quant_kernel, "INTERPRET", True)
    monkeypatch.setattr(quant_kernel, "BLOCK_BYTES", 128 * 256)
    rng = np.random.default_rng(5)
    w = quant.quantize(rng.standard_normal((512, 384)).astype(np.float32), np.full(384, 0.02, np.float32)).T
    scale = jnp.asarray(rng.uniform(0.01, 0.03, 384), jnp.float32)
    x = jnp.asarray(rng.standard_normal((2, cols[1] - cols[0])), jnp.float32)
    assert quant_kernel.applies(x, w, rows, cols)
    got = jax.jit(quant_kernel.by_rows, static_argnums=(3, 4))(x, w, scale, rows, cols)
    want = quant.by_rows(x, w[rows[0]:rows[1], cols[0]:cols[1]], scale[rows[0]:rows[1]])
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-6)
    assert not quant_kernel.applies(x[:, :64], w, rows, (cols[0], cols[0] + 64))


LLAMA_KERNEL = {"family": "llama", "n_heads": 8, "n_kv_heads": 4, "intermediate_size": 1024, "pe_rotary_dims": 64}


@pytest.mark.parametrize("family", [{}, LLAMA_KERNEL], ids=["gptj", "llama"])
def test_int8_kernel_programs_on_dp2_mp4_give_one_devices_greedy_tokens(monkeypatch, family):
    """The policy's int8_dot "kernel" (the interpreter) in every decode program, each device's slice of the joined
    int8 matrices whole lanes (d_model 512, mp 4), against XLA's products on one device. Llama's attention and MLP
    read their own norms: each side's rows of "in" and columns of "out" (at an element offset) read in place
    (8 heads, 4 key heads: a device's q 128 wide, its k and v 64 each)."""
    monkeypatch.setattr(quant_kernel, "INTERPRET", True)
    cfg = config.from_dict({"layers": 2, "d_model": 512, "n_heads": 4, "n_vocab": 256, "pe_rotary_dims": 16,
                            "seq": 32, "cores_per_replica": 1, "weight_dtype": "int8", **family})
    weights = jax.tree.map(np.asarray, table.init_unsharded(cfg, jax.random.PRNGKey(5)))
    one = sampling.Sampler(make_inference_layout(cfg, mesh=make_dp_mp(1, 1)), weights)
    layout = make_inference_layout(dataclasses.replace(cfg, cores_per_replica=4), mesh=make_dp_mp(2, 4))
    layout = dataclasses.replace(layout, policy=dataclasses.replace(layout.policy, int8_dot="kernel"))
    kernel = sampling.Sampler(layout, weights)
    calls = []
    traced = quant_kernel.by_rows
    monkeypatch.setattr(quant_kernel, "by_rows", lambda *args: calls.append(args[3:]) or traced(*args))
    expected = one.generate(PROMPTS, 8, temperature=0.0, return_logprobs=True)
    for ours, ref in zip(kernel.generate(PROMPTS, 8, temperature=0.0, return_logprobs=True), expected):
        assert ours.tokens == ref.tokens
        np.testing.assert_allclose(ours.logprobs, ref.logprobs, atol=1e-4)
    assert calls  # the programs traced the kernel
    if family:  # each side's range, none copied out: qkv's rows (128 + 2 x 64), the MLP's (2 x 256), out's columns
        assert {(0, 256), None} <= {c[0] for c in calls} and {(256, 768)} <= {c[0] for c in calls}
        assert {(0, 128), (128, 384)} <= {c[1] for c in calls if len(c) > 1}


@pytest.mark.parametrize("cfg", [INT8, HEAD8], ids=["layers", "with_head"])
def test_int8_logits_stay_close_to_the_compute_dtype_ones(params, cfg):
    ids = np.random.default_rng(2).integers(0, CFG.n_vocab, (16, 12)).astype(np.int32)
    ref, ours = prefill_logits(params, CFG, ids), prefill_logits(params, cfg, ids)
    relative_rms = np.sqrt(np.mean((ours - ref) ** 2)) / ref.std()
    assert relative_rms < 0.05, relative_rms
    assert np.mean(ours.argmax(-1) == ref.argmax(-1)) >= 0.9


def test_int8_with_its_head_on_dp2_mp4_equals_it_on_one_device(params):
    one = sampling.Sampler(make_inference_layout(HEAD8, mesh=make_dp_mp(1, 1)), params)
    sharded = sampling.Sampler(make_inference_layout(HEAD8, mesh=make_dp_mp(2, 4)), params)
    expected = one.generate(PROMPTS, 8, temperature=0.0, return_logprobs=True)
    for ours, ref in zip(sharded.generate(PROMPTS, 8, temperature=0.0, return_logprobs=True), expected):
        assert ours.tokens == ref.tokens
        np.testing.assert_allclose(ours.logprobs, ref.logprobs, atol=1e-4)


@pytest.fixture(scope="module")
def int8_checkpoint(params, tmp_path_factory) -> tuple[str, str]:
    """(an f32 checkpoint of `params`, the int8 one slim_model.py writes from it for cores_per_replica 4)."""
    root = tmp_path_factory.mktemp("int8")
    f32, int8 = str(root / "f32"), str(root / "int8")
    checkpoint.save(f32, 5, {"params": params}, {"config": CFG.to_dict()})
    result = run_script("slim_model.py", "--input-ckpt", f32, "--config", "configs/tiny_rot_partial.json",
                        "--set", "cores_per_replica=4", "--output-ckpt", int8, "--dtype", "int8")
    assert result.returncode == 0, result.stderr[-3000:]
    return f32, int8


def test_an_int8_checkpoint_holds_int8_matrices_with_scales_and_says_so(int8_checkpoint):
    _, int8 = int8_checkpoint
    index = json.loads(storage.read_bytes(os.path.join(checkpoint.step_dir(int8, 5), "index_p0.json")))["leaves"]
    matrices = {"/".join(("params", "layers", *path)) for path in gptj_matrices()}
    assert {leaf for leaf, entry in index.items() if entry.get("dtype") == "int8"} == matrices
    assert {leaf for leaf in index if leaf.startswith(convert.SCALES)} == {
        convert.SCALES + leaf.removeprefix("params/") for leaf in matrices}
    assert {entry["dtype"] for leaf, entry in index.items() if leaf.startswith("params/") and leaf not in matrices} \
        == {"bfloat16"}
    saved = json.loads(storage.read_bytes(os.path.join(int8, "config.json")))
    assert (saved["weight_dtype"], saved["compute_dtype"], saved["cores_per_replica"]) == ("int8", "bfloat16", 4)


def test_an_int8_checkpoint_reads_as_the_numbers_quantizing_while_loading_gives(int8_checkpoint):
    f32, int8 = int8_checkpoint
    layout = make_inference_layout(dataclasses.replace(INT8, compute_dtype="bfloat16"), mesh=make_dp_mp(2, 4))
    from_int8, quantized = infer_params.read_params(layout, int8), infer_params.read_params(layout, f32)
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), from_int8, quantized)
    assert from_int8["layers"][0]["fused"]["in"].dtype == jnp.int8


def test_an_int8_checkpoint_reads_dequantized_in_a_float_dtype(params, int8_checkpoint):
    _, int8 = int8_checkpoint
    layout = make_inference_layout(CFG, mesh=make_dp_mp(1, 4))
    loaded = jax.tree.map(np.asarray, convert.load_params(layout, int8, "fp32"))
    layer = jax.tree.map(lambda x: x[0], params["layers"])
    scales = quant.group_scales(jax.tree.map(lambda x: x.astype(jnp.bfloat16), layer))
    for path, group in gptj_matrices().items():
        got, want = table.get_path(loaded["layers"], path)[0], table.get_path(layer, path)
        assert (np.abs(got - want) <= scales[group] * 0.51 + np.abs(want) / 128).all()  # half a step, bf16's rounding
    np.testing.assert_allclose(loaded["embed"]["wte"], params["embed"]["wte"], rtol=1 / 128)


def test_int8_is_written_slim_only_and_the_int8_head_needs_int8_weights(int8_checkpoint, tmp_path):
    f32, _ = int8_checkpoint
    with pytest.raises(config.ConfigError, match="--slim"):
        convert.write_checkpoint(f32, CFG, str(tmp_path / "full"), dtype="int8")
    with pytest.raises(config.ConfigError, match="quantize_head"):
        config.from_dict({**CFG.to_dict(), "quantize_head": True})


def test_the_int8_kernels_bf16_products_are_at_the_default_precision_under_a_callers_highest():
    """Mosaic refuses bf16 products at "highest" (found on a v5e with splash): the kernel's are at the default
    whatever the caller set (exact either way); an f32 one follows the caller."""
    w, scale = jnp.zeros((256, 256), jnp.int8), jnp.ones((256,), jnp.float32)
    with jax.default_matmul_precision("highest"):
        bf16, f32 = (str(jax.make_jaxpr(quant_kernel.by_rows)(jnp.zeros((2, 256), dtype), w, scale))
                     for dtype in (jnp.bfloat16, jnp.float32))
    assert "precision=(Precision.DEFAULT, Precision.DEFAULT)" in bf16 and "HIGHEST" not in bf16
    assert "precision=(Precision.HIGHEST, Precision.HIGHEST)" in f32
