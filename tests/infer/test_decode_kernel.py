"""The TPU decode attention kernel over the slot cache (`infer/decode_kernel.py`, in Pallas' TPU interpreter on the
CPU): against numpy on its own, and in the decode programs against XLA's attention, on one device and split over
dp 2 x mp 4."""
import dataclasses
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

from mesh_transformer import config
from mesh_transformer.infer import decode, decode_kernel
from mesh_transformer.infer import params as infer_params
from mesh_transformer.infer.sampler import Sampler
from mesh_transformer.parallel.mesh import make_dp_mp
from tests.helpers import random_params

CFG = config.load("configs/tiny_rot_partial.json", ["cores_per_replica=1", "remat=false"])  # seq 32, 8 heads


def reference(q, k_blocks, v_blocks, length, k_new, v_new) -> np.ndarray:
    """The attention in numpy (f64): each row's first length_r cached positions and its new key, softmax."""
    def f64(x):
        return np.asarray(jnp.asarray(x).astype(jnp.float32), np.float64)
    keys, values = (np.concatenate([f64(b) for b in blocks], 1) for blocks in (k_blocks, v_blocks))
    q, k_new, v_new = f64(q), f64(k_new), f64(v_new)
    group = q.shape[1] // k_new.shape[1]  # query heads per key head
    keys, values, k_new, v_new = (np.repeat(x, group, axis=-2) for x in (keys, values, k_new, v_new))
    out = np.zeros(q.shape)
    for r in range(q.shape[0]):
        k = np.concatenate([keys[r, :max(length[r], 0)], k_new[r, None]])
        v = np.concatenate([values[r, :max(length[r], 0)], v_new[r, None]])
        s = np.einsum("hk,thk->ht", q[r], k) / np.sqrt(q.shape[-1])
        p = np.exp(s - s.max(1, keepdims=True))
        out[r] = np.einsum("ht,thk->hk", p / p.sum(1, keepdims=True), v)
    return out


@pytest.mark.parametrize("grid", [{"most_rows": 4, "most_positions": 8}, {"most_rows": 2, "most_positions": 64}, {}],
                         ids=["chunks_of_8", "whole_blocks", "defaults"])
@pytest.mark.parametrize("form, heads, dtype, group", [("vpu", 4, jnp.float32, 1), ("vpu", 16, jnp.bfloat16, 1),
                                                       ("mxu", 8, jnp.float32, 1), ("mxu", 16, jnp.bfloat16, 1),
                                                       ("vpu", 4, jnp.float32, 4), ("mxu", 8, jnp.float32, 2),
                                                       ("mxu", 8, jnp.bfloat16, 4)])
def test_the_kernel_attends_over_each_rows_cached_positions_up_to_its_length(form, heads, dtype, group, grid):
    """Rows with no cached position (length 0, or -1: a row the serving engine computes but takes no token of), one,
    two, a block's less one, a whole block, most of the cache, all of it; blocks of
    24, 24 and 16 positions; groups of rows whose longest row ends early (its later chunks skipped). The slots past
    the rows read hold NaN: the kernel never reads them. The "mxu" form's probabilities enter its second product as
    the values' dtype (bf16: XLA's attention rounds them so too). `group`: query heads per key head (`heads` of
    them: grouped-query attention)."""
    rng = np.random.default_rng(0)
    rows, slots, head_dim, sizes = 8, 10, 128, (24, 24, 16)

    def normal(*shape):
        return jnp.asarray(rng.normal(size=shape), dtype)

    def cache_block(size):
        return normal(slots, size, heads, head_dim).at[rows:].set(jnp.nan)

    q = normal(rows, heads * group, head_dim)
    k_new, v_new = normal(rows, heads, head_dim), normal(rows, heads, head_dim)
    k_blocks, v_blocks = [cache_block(s) for s in sizes], [cache_block(s) for s in sizes]
    length = np.array([-1, 0, 1, 23, 24, 50, 64, 2], np.int32)
    with pltpu.force_tpu_interpret_mode():
        got = decode_kernel.attend(q, k_blocks, v_blocks, jnp.asarray(length), k_new, v_new, form=form, **grid)
    want = reference(q, k_blocks, v_blocks, length, k_new, v_new)
    atol = 5e-3 if form == "mxu" and dtype == jnp.bfloat16 else 1e-5  # measured: 1.4e-3 and 6e-7
    np.testing.assert_allclose(np.asarray(got), want, rtol=0, atol=atol)


def test_the_kernel_form_is_the_matrix_units_where_heads_fill_its_tiles():
    # bf16 chunks of 8 heads are viewed through f32 (Llama-3-8B's 8 key heads)
    assert [decode_kernel.form_for(h, jnp.bfloat16) for h in (2, 4, 8, 16, 32, 48, 64)] == \
        ["vpu", "vpu", "mxu", "mxu", "mxu", "vpu", "mxu"]
    assert [decode_kernel.form_for(h, jnp.float32) for h in (4, 8, 12, 16)] == ["vpu", "mxu", "vpu", "mxu"]


def with_attention(layout, attention: str):
    """The layout with the TPU's cache (values, slots first) and the decode attention named."""
    policy = dataclasses.replace(layout.policy, cache_bits=False, cache_order=(0, 1, 2, 3), decode_attention=attention)
    return dataclasses.replace(layout, policy=policy)


def teacher_forced(layout, params, attention: str) -> np.ndarray:
    """Logits [1 + steps, R, V]: 3 prompts prefilled into slots 0-2 of a 4-slot cache in blocks of 8, then fed
    tokens decoded, each step reading the blocks its furthest row needs."""
    layout = with_attention(layout, attention)
    cfg, policy = layout.cfg, layout.policy
    placed = infer_params.place_params(params, layout)
    blocks = decode.block_sizes(cfg.seq, 8)
    cache = decode.KVCache(*([[jnp.zeros(decode.block_shape(4, n, cfg, policy), jnp.float32) for n in blocks]
                              for _ in range(cfg.layers)] for _ in range(2)))
    prompts = np.zeros((3, 11), np.int32)
    length = np.array([5, 11, 3], np.int32)
    for r, n in enumerate(length):
        prompts[r, :n] = np.arange(1, n + 1) * (r + 7) % cfg.n_vocab
    logits, cache = jax.jit(partial(decode.prefill_logits, cfg=cfg, policy=policy))(
        placed, cache, prompts, length, np.arange(3, dtype=np.int32))
    out, steps = [logits], {}
    for i in range(6):
        position = length + i
        n_blocks = int(position.max()) // 8 + 1
        if n_blocks not in steps:
            steps[n_blocks] = jax.jit(partial(decode.decode_logits, cfg=cfg, n_blocks=n_blocks, policy=policy))
        logits, cache = steps[n_blocks](placed, cache, np.array([3, 5, 7], np.int32) * (i + 1), position)
        out.append(logits)
    return np.stack([np.asarray(x) for x in out])


NEOX = config.load("configs/tiny_neox.json", ["cores_per_replica=1"])  # GPT-NeoX: 8 heads of 8


@pytest.mark.parametrize("cfg, form", [(CFG, "vpu"), (CFG, "mxu"), (NEOX, "mxu")], ids=["gptj-vpu", "gptj-mxu",
                                                                                        "gptneox-mxu"])
def test_decode_steps_through_the_kernel_give_xlas_logits(monkeypatch, cfg, form):
    """Prefill, then decode steps whose rows (3 of 4 slots) read 2 and then 3 of the cache's 4 blocks: the same
    logits through the kernel as through XLA's attention (f32), for GPT-J and GPT-NeoX."""
    monkeypatch.setattr(decode_kernel, "form_for", lambda heads, dtype: form)
    traced, attend = [], decode_kernel.attend
    monkeypatch.setattr(decode_kernel, "attend", lambda *a, **k: traced.append(1) or attend(*a, **k))
    layout = infer_params.make_inference_layout(cfg, mesh=make_dp_mp(1, 1))
    params = random_params(cfg, 0)
    with pltpu.force_tpu_interpret_mode():
        kernel = teacher_forced(layout, params, "kernel")
    assert len(traced) == 2 * cfg.layers  # each layer of the two step programs (2 and 3 blocks)
    xla = teacher_forced(layout, params, "xla")
    assert len(traced) == 2 * cfg.layers
    np.testing.assert_allclose(kernel, xla, rtol=0, atol=1e-5 * np.abs(xla).max())


def test_greedy_tokens_through_the_kernel_split_over_dp_and_mp_are_one_devices_through_xla():
    """The sampler's programs (prefill, then its decode loop) with the kernel on dp 2 x mp 4 (each device its rows
    and 2 of the 8 heads) make the tokens XLA's attention makes on one device; one row is the kernel's least, so a
    batch of 4 prompts (2 rows a dp group) runs it."""
    params = random_params(CFG, 3)
    prompts = [[5, 17, 42, 9, 1], [100, 3, 7, 9, 250, 11, 2, 8], [1, 2, 3], [9, 9, 8]]
    runs = {}
    for attention, mesh in (("xla", make_dp_mp(1, 1)), ("kernel", make_dp_mp(2, 4))):
        layout = with_attention(infer_params.make_inference_layout(CFG, mesh=mesh), attention)
        with pltpu.force_tpu_interpret_mode():
            results = Sampler(layout, params).generate(prompts, 12, temperature=0.0, stop_token_ids=[],
                                                      return_logprobs=True)
        runs[attention] = ([r.tokens for r in results], np.array([r.logprobs for r in results]))
    assert runs["kernel"][0] == runs["xla"][0]
    np.testing.assert_allclose(runs["kernel"][1], runs["xla"][1], rtol=0, atol=1e-4)


def test_one_row_attends_by_xla_and_more_by_the_kernel():
    policy = with_attention(infer_params.make_inference_layout(CFG, mesh=make_dp_mp(1, 1)), "kernel").policy
    assert [decode_kernel.runs(policy, rows) for rows in (1, 2, 32)] == [False, True, True]
    assert not decode_kernel.runs(dataclasses.replace(policy, decode_attention="xla"), 32)
