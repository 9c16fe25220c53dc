"""The paged KV cache computes what the slot cache does: the same logits for prompts, decode steps and prompt tails
after a prefix whose pages are shared, on one device and split over dp 2 x mp 4."""
import dataclasses
import re
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mesh_transformer import config
from mesh_transformer.infer import decode, paged
from mesh_transformer.infer import params as infer_params
from mesh_transformer.infer.choose import fill_sampling
from mesh_transformer.infer.programs import Programs
from mesh_transformer.infer.sampler import Sampler
from mesh_transformer.parallel.mesh import DP, make_dp_mp
from tests.helpers import random_params

CFG = config.load("configs/tiny_rot_partial.json", ["cores_per_replica=1", "remat=false"])  # seq 32, vocab 256
PAGE = 4
PROMPTS = [[5, 17, 42, 9, 1], [100, 3, 7, 9, 250, 11, 2, 8, 8, 30, 31], [1, 2, 3]]


@pytest.fixture(scope="module")
def placed():
    layout = infer_params.make_inference_layout(CFG, mesh=make_dp_mp(1, 1))
    return layout, infer_params.place_params(random_params(CFG, 0), layout)


def padded(prompts, width):
    ids = np.zeros((len(prompts), width), np.int32)
    for i, p in enumerate(prompts):
        ids[i, :len(p)] = p
    return ids, np.array([len(p) for p in prompts], np.int32)


def random_tables(rows: int, per_row: int, n_pages: int, seed: int) -> np.ndarray:
    """Distinct pages for each row, in a shuffled order (a request's pages need not be consecutive)."""
    return np.random.default_rng(seed).permutation(n_pages)[:rows * per_row].reshape(rows, per_row).astype(np.int32)


def n_read(position_R) -> int:
    """Pages holding every row's keys before its position."""
    return max(1, -(-int(np.max(position_R)) // PAGE))


def slot_run(layout, params, prompts, steps):
    """Logits of the prompts' prefill and of `steps` greedy decode steps through the slot cache."""
    policy, ids = layout.policy, padded(prompts, max(12, *map(len, prompts)))
    block = jnp.zeros(decode.block_shape(len(prompts), CFG.seq, CFG, policy), decode.cache_dtype(CFG, policy))
    cache = decode.KVCache([[block] for _ in range(CFG.layers)], [[block] for _ in range(CFG.layers)])
    prefill = jax.jit(lambda p, c, i, n, s: decode.prefill_logits(p, c, i, n, s, CFG, policy=policy))
    step = jax.jit(lambda p, c, t, pos: decode.decode_logits(p, c, t, pos, CFG, 1, policy=policy))
    logits, cache = prefill(params, cache, ids[0], ids[1], np.arange(len(prompts), dtype=np.int32))
    out, position = [np.asarray(logits)], ids[1].copy()
    for _ in range(steps):
        logits, cache = step(params, cache, np.asarray(logits).argmax(-1).astype(np.int32), position)
        out.append(np.asarray(logits))
        position = position + 1  # a new array: the step may still read the old one
    return out


def paged_run(layout, params, prompts, steps, table):
    """The same through the paged cache, each row's pages those of its table."""
    policy, ids = layout.policy, padded(prompts, max(12, *map(len, prompts)))
    cache = paged.zero_cache(40, PAGE, CFG, policy)
    run = jax.jit(lambda p, c, i, s, n, t, read: paged.paged_logits(p, c, i, s, n, t, CFG, read, policy=policy),
                  static_argnums=6)
    logits, cache = run(params, cache, ids[0], np.zeros(len(prompts), np.int32), ids[1], table, 0)
    out, position = [np.asarray(logits)], ids[1].copy()
    for _ in range(steps):
        token = np.asarray(logits).argmax(-1).astype(np.int32)[:, None]
        logits, cache = run(params, cache, token, position, np.ones_like(position), table, n_read(position))
        out.append(np.asarray(logits))
        position = position + 1  # a new array: the step may still read the old one
    return out, cache


def test_prompts_and_decode_steps_over_pages_give_the_slot_caches_logits(placed):
    layout, params = placed
    want = slot_run(layout, params, PROMPTS, 6)
    got, _ = paged_run(layout, params, PROMPTS, 6, random_tables(3, CFG.seq // PAGE, 40, seed=1))
    for step, (a, b) in enumerate(zip(got, want)):
        np.testing.assert_allclose(a, b, rtol=0, atol=2e-5, err_msg=f"step {step}")


def test_a_prompt_tail_after_shared_prefix_pages_gives_the_whole_prompts_logits(placed):
    layout, params = placed
    first = [7, 8, 9, 10, 11, 12, 13, 14, 15, 16]
    second = first[:8] + [200, 201, 202, 203, 204]  # shares first's two full pages
    table = random_tables(2, CFG.seq // PAGE, 40, seed=2)
    table[1, :2] = table[0, :2]  # second's table names first's pages: no copy
    _, cache = paged_run(layout, params, [first], 0, table[:1])
    tail, length = padded([second[8:]], 8)
    logits, cache = jax.jit(lambda p, c: paged.paged_logits(p, c, tail, np.array([8], np.int32), length, table[1:],
                                                            CFG, 2, policy=layout.policy))(params, cache)
    whole = slot_run(layout, params, [second], 0)[0]
    np.testing.assert_allclose(np.asarray(logits), whole, rtol=0, atol=2e-5)
    # first's pages hold what they held: its next step is unchanged by second's writes
    after = jax.jit(lambda p, c: paged.paged_logits(p, c, np.array([[5]], np.int32), np.array([10], np.int32),
                                                    np.ones(1, np.int32), table[:1], CFG, 3, policy=layout.policy))
    _, untouched = paged_run(layout, params, [first], 0, table[:1])
    np.testing.assert_allclose(np.asarray(after(params, cache)[0]), np.asarray(after(params, untouched)[0]),
                               rtol=0, atol=1e-6)


@pytest.mark.parametrize("kv_dtype", ["compute", "int8"])
def test_a_prompt_tail_over_the_kernels_page_layout_reads_what_the_gather_layout_does(placed, kv_dtype):
    """Prefix reuse where pages are laid out for the TPU kernel ([P, H, page, K], scales [P, page, H]): a prompt
    tail's read of shared pages (the gather, over the kernel's layout) and the next decode step (the kernel, in
    Pallas' TPU interpreter) give the logits they give over the CPU's layout (the tail's exactly)."""
    from jax.experimental.pallas import tpu as pltpu

    layout, params = placed
    cfg = dataclasses.replace(CFG, kv_cache_dtype=kv_dtype)
    first = [7, 8, 9, 10, 11, 12, 13, 14, 15, 16]
    second = first[:8] + [200, 201, 202, 203, 204]  # shares first's two full pages
    table = random_tables(2, CFG.seq // PAGE, 40, seed=4)
    table[1, :2] = table[0, :2]
    runs = {}
    for name in ("gather", "kernel"):
        policy = dataclasses.replace(layout.policy, paged_attention=name, cache_bits=False)
        run = jax.jit(lambda p, c, i, s, n, t, read, policy=policy: paged.paged_logits(p, c, i, s, n, t, cfg, read,
                                                                                     policy=policy), static_argnums=6)
        cache, one = paged.zero_cache(40, PAGE, cfg, policy), np.ones(1, np.int32)
        with pltpu.force_tpu_interpret_mode():
            ids, length = padded([first], 12)
            _, cache = run(params, cache, ids, 0 * one, length, table[:1], 0)
            tail, length = padded([second[8:]], 8)
            at_tail, cache = run(params, cache, tail, 8 * one, length, table[1:], 2)
            at_step, cache = run(params, cache, np.array([[5]], np.int32), 13 * one, one, table[1:], 4)
        runs[name] = np.stack([np.asarray(at_tail), np.asarray(at_step)])
    np.testing.assert_array_equal(runs["kernel"][0], runs["gather"][0])
    # int8: the kernel reads the step's own key and value back from the pages, quantized; the gather path takes them
    # as computed (measured: 4e-4 of the logits' spread)
    atol = 1e-2 * runs["gather"].std() if kv_dtype == "int8" else 1e-5 * np.abs(runs["gather"]).max()
    np.testing.assert_allclose(runs["kernel"][1], runs["gather"][1], rtol=0, atol=atol)


def greedy_programs(layout, params, prompts, steps, page_seed):
    """Greedy tokens through Programs' paged programs: prompts prefilled into slots 0.. of each dp group, then
    `steps` decode steps; tables of distinct shuffled pages local to each group."""
    programs, dp = Programs(layout), layout.mesh.shape[DP]
    n_slots, n_pages = len(prompts), 40 * dp
    cache, slots = programs.new_pages(n_pages, PAGE), programs.new_slots(n_slots)
    local = n_slots // dp
    table = np.concatenate([random_tables(local, CFG.seq // PAGE, n_pages // dp, seed=page_seed + g)
                            for g in range(dp)])
    ids, length = padded(prompts, 12)
    sampling = fill_sampling(n_slots, [])
    slot = np.tile(np.arange(local, dtype=np.int32), dp)
    token, _, slots, cache = programs.paged_prefill(params, cache, slots, ids, np.zeros(n_slots, np.int32), length,
                                                    table, slot, sampling, np.zeros(n_slots, np.int32), n_read=0)
    steps_N = decode.Steps(length.copy(), np.ones(n_slots, np.int32), sampling)
    tokens = [np.asarray(token)]
    for _ in range(steps):
        token, _, slots, steps_N, cache = programs.paged_decode(params, cache, slots, steps_N, table, rows=local,
                                                                n_read=n_read(np.asarray(steps_N.position)))
        tokens.append(np.asarray(token))
    return np.stack(tokens, 1)


def test_paged_programs_on_one_device_and_dp2_mp4_give_the_slot_samplers_greedy_tokens():
    params = random_params(CFG, 3)
    prompts = PROMPTS + [[9, 9, 4, 200]]
    tokens = []
    for dp, mp in [(1, 1), (2, 4)]:
        layout = infer_params.make_inference_layout(CFG, mesh=make_dp_mp(dp, mp))
        tokens.append(greedy_programs(layout, infer_params.place_params(params, layout), prompts, 5, page_seed=dp))
    np.testing.assert_array_equal(tokens[1], tokens[0])
    sampler = Sampler(infer_params.make_inference_layout(CFG, mesh=make_dp_mp(1, 1)), params)
    for row, completion in enumerate(sampler.generate(prompts, 6, temperature=0.0)):
        assert list(tokens[0][row]) == list(completion.tokens)


def test_int8_pages_hold_each_token_and_head_within_half_a_scale_step():
    x = jax.random.normal(jax.random.PRNGKey(0), (3, 5, 8, 16)) * jnp.arange(1, 9)[None, None, :, None]
    x = x.at[0, 0, 0].set(0)
    values, scale = paged.quantize(x)
    assert values.dtype == jnp.int8 and scale.shape == (3, 5, 8) and float(scale[0, 0, 0]) == 1.0
    assert float(jnp.max(jnp.abs(values.astype(jnp.float32) * scale[..., None] - x) / scale[..., None])) <= 0.5


def test_an_int8_cache_keeps_the_greedy_choices_of_the_compute_dtype_cache():
    """Trained weights are where top-1 agreement means something (the device suite and bench measure it); on a
    random tiny model the logits stay close and the tokens mostly agree."""
    cfg8 = config.load("configs/tiny_rot_partial.json", ["cores_per_replica=1", "remat=false", "kv_cache_dtype=int8"])
    params = random_params(CFG, 0)
    logits, table = {}, random_tables(3, CFG.seq // PAGE, 40, seed=5)
    for cfg in (CFG, cfg8):
        layout = infer_params.make_inference_layout(cfg, mesh=make_dp_mp(1, 1))
        placed = infer_params.place_params(params, layout)
        cache = paged.zero_cache(40, PAGE, cfg, layout.policy)
        assert cache.k[0].dtype == (jnp.int8 if cfg is cfg8 else decode.cache_dtype(CFG, layout.policy))
        ids, length = padded(PROMPTS, 12)
        run = jax.jit(lambda p, c, i, s, n, read, cfg=cfg, layout=layout: paged.paged_logits(
            p, c, i, s, n, table, cfg, read, policy=layout.policy), static_argnums=5)
        _, cache = run(placed, cache, ids, np.zeros(3, np.int32), length, 0)
        logits[cfg.kv_cache_dtype] = np.asarray(run(placed, cache, np.array([[3], [4], [5]], np.int32), length,
                                                    np.ones(3, np.int32), 3)[0])
    ref, ours = logits["compute"], logits["int8"]
    assert np.sqrt(np.mean((ours - ref) ** 2)) / ref.std() < 0.02
    assert np.mean(ours.argmax(-1) == ref.argmax(-1)) >= 2 / 3


def test_int8_paged_programs_on_dp2_mp4_give_one_devices_greedy_tokens():
    cfg8 = config.load("configs/tiny_rot_partial.json", ["cores_per_replica=1", "remat=false", "kv_cache_dtype=int8"])
    params = random_params(CFG, 3)
    tokens = []
    for dp, mp in [(1, 1), (2, 4)]:
        layout = infer_params.make_inference_layout(cfg8, mesh=make_dp_mp(dp, mp))
        tokens.append(greedy_programs(layout, infer_params.place_params(params, layout), PROMPTS + [[7]], 4, dp))
    np.testing.assert_array_equal(tokens[1], tokens[0])


@pytest.mark.parametrize("kv_dtype", ["compute", "int8"])
def test_decode_through_the_tpu_paged_attention_kernel_gives_the_gather_paths_tokens(kv_dtype):
    """The kernel (run by Pallas' TPU interpreter on the CPU) over its own page layout against the pure-JAX gather
    over the usual ones, for prompts and decode steps. The interpreter rounds the kernel's dot operands to bf16 as
    the TPU's default precision does, so the logits agree to that and the greedy tokens exactly."""
    from jax.experimental.pallas import tpu as pltpu

    cfg = config.load("configs/tiny_rot_partial.json", ["cores_per_replica=1", "remat=false",
                                                         f"kv_cache_dtype={kv_dtype}"])
    layout = infer_params.make_inference_layout(cfg, mesh=make_dp_mp(1, 1))
    params = infer_params.place_params(random_params(CFG, 0), layout)
    table = random_tables(3, CFG.seq // PAGE, 40, seed=7)
    runs = {}
    for name in ("gather", "kernel"):
        policy = dataclasses.replace(layout.policy, paged_attention=name, cache_bits=False)
        cache = paged.zero_cache(40, PAGE, cfg, policy)
        by_page = (40, cfg.n_heads, PAGE, cfg.head_dim)  # the kernel's; the gather's is the CPU's cache order
        assert cache.k[0].shape == (by_page if name == "kernel" else paged.page_shape(40, PAGE, cfg, policy))
        run = jax.jit(lambda p, c, i, s, n, read, policy=policy: paged.paged_logits(p, c, i, s, n, table, cfg, read,
                                                                                  policy=policy), static_argnums=5)
        ids, length = padded(PROMPTS, 12)
        with pltpu.force_tpu_interpret_mode():
            logits, cache = run(params, cache, ids, np.zeros(3, np.int32), length, 0)
            steps, position = [np.asarray(logits)], length.copy()
            for _ in range(5):
                token = np.asarray(logits).argmax(-1).astype(np.int32)[:, None]
                logits, cache = run(params, cache, token, position, np.ones(3, np.int32), n_read(position + 1))
                steps.append(np.asarray(logits))
                position = position + 1  # a new array: the step may still read the old one
        runs[name] = np.stack(steps)
    np.testing.assert_array_equal(runs["kernel"].argmax(-1), runs["gather"].argmax(-1))
    np.testing.assert_allclose(runs["kernel"], runs["gather"], rtol=0, atol=0.05 * runs["gather"].std())


def random_pages(rng, shape: tuple, int8: bool, dtype) -> tuple:
    """Keys and values [P, H, page, K] for the kernel: int8 with per-token scales [P, page, H], or normal values of
    `dtype` and no scales."""
    n_pages, heads, page, head_dim = shape
    if int8:
        k, v = (rng.integers(-127, 128, shape).astype(np.int8) for _ in range(2))
        return k, v, *(rng.uniform(1e-3, 2e-2, (n_pages, page, heads)).astype(np.float32) for _ in range(2))
    return *(rng.standard_normal(shape).astype(dtype) for _ in range(2)), None, None


def kernel_reference(q_RxHxK, k_pages, v_pages, k_scales, v_scales, length_R, table_RxM) -> np.ndarray:
    """`paged_decode_attention` in numpy (f64): each row's pages joined by its table, dequantized, softmax over its
    first length_r positions."""
    out = np.zeros(q_RxHxK.shape)
    for r, (pages, length) in enumerate(zip(table_RxM, length_R)):
        if not length:  # a row of no position: 0
            continue

        def joined(x, scales, pages=pages):
            x = np.concatenate([x[p].transpose(1, 0, 2) for p in pages]).astype(np.float64)  # [M * page, H, K]
            return x if scales is None else x * np.concatenate([scales[p] for p in pages])[..., None]
        k, v = joined(k_pages, k_scales)[:length], joined(v_pages, v_scales)[:length]
        group = q_RxHxK.shape[1] // k.shape[1]  # query heads per key head
        k, v = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)
        s = np.einsum("hk,thk->ht", q_RxHxK[r], k)
        p = np.exp(s - s.max(1, keepdims=True))
        out[r] = np.einsum("ht,thk->hk", p / p.sum(1, keepdims=True), v)
    return out


@pytest.mark.parametrize("form", ["dense", "mxu"])
@pytest.mark.parametrize("per_block, group", [(1, 1), (2, 1), (6, 1), (2, 2), (6, 4)])
@pytest.mark.parametrize("int8", [True, False], ids=["int8", "bf16"])
def test_the_paged_kernel_attends_over_each_rows_pages_up_to_its_length(int8, per_block, group, form):
    """The TPU kernel (Pallas' TPU interpreter on the CPU) against numpy: rows of one position, of a page and a bit,
    of a whole table, and of none (0: first, two together, last; what a step computes but takes no token of); blocks
    of one page, of two, of the whole table (its last block past the table's width); int8 pages with per-token
    scales and bf16 pages; `group` query heads per key head (grouped-query attention); each form of a block's
    computation (`paged_kernel.FORMS`)."""
    from jax.experimental.pallas import tpu as pltpu

    from mesh_transformer.infer.paged_kernel import paged_decode_attention

    rng = np.random.default_rng(per_block)
    rows, heads, head_dim, n_pages, page, width = 8, 4, 128, 40, 8, 5
    q = (rng.standard_normal((rows, heads * group, head_dim)) / np.sqrt(head_dim)).astype(np.float32)
    table = rng.permutation(n_pages)[:rows * width].reshape(rows, width).astype(np.int32)
    length = np.array([0, 1, 11, 0, 0, 40, 23, 0], np.int32)
    k, v, k_scales, v_scales = random_pages(rng, (n_pages, heads, page, head_dim), int8, jnp.bfloat16)
    with pltpu.force_tpu_interpret_mode():
        got = paged_decode_attention(q, k, v, k_scales, v_scales, length, table, pages_per_block=per_block,
                                     form=form)
    want = kernel_reference(q, k, v, k_scales, v_scales, length, table)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


@pytest.mark.parametrize("int8", [True, False], ids=["int8", "bf16"])
def test_the_paged_kernel_copies_no_page_past_a_rows_length(int8):
    """The pages a row's table names past its length (its last block's rest, the table's padding) hold NaN: the
    kernel copies only the pages the row reads, so its output is finite and as numpy's. Blocks of 4 pages over
    tables of 5: a row of 11 positions reads 2 pages of its first block, one of 33 all 4 and 1 of the next."""
    from jax.experimental.pallas import tpu as pltpu

    from mesh_transformer.infer.paged_kernel import paged_decode_attention

    rng = np.random.default_rng(3)
    rows, heads, head_dim, n_pages, page, width = 3, 4, 128, 20, 8, 5
    q = (rng.standard_normal((rows, heads, head_dim)) / np.sqrt(head_dim)).astype(np.float32)
    table = rng.permutation(n_pages)[:rows * width].reshape(rows, width).astype(np.int32)
    length = np.array([11, 33, 1], np.int32)
    k, v, k_scales, v_scales = random_pages(rng, (n_pages, heads, page, head_dim), int8, np.float32)
    unread = np.ones(n_pages, bool)
    for r in range(rows):
        unread[table[r, :-(-length[r] // page)]] = False
    for x in (k_scales, v_scales) if int8 else (k, v):
        x[unread] = np.nan
    if not int8:
        k, v = k.astype(jnp.bfloat16), v.astype(jnp.bfloat16)
    with pltpu.force_tpu_interpret_mode():
        got = np.asarray(paged_decode_attention(q, k, v, k_scales, v_scales, length, table, pages_per_block=4))
    want = kernel_reference(q, k, v, k_scales, v_scales, length, table)
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


@pytest.mark.parametrize("int8", [True, False], ids=["int8", "bf16"])
def test_the_paged_kernels_bf16_products_are_at_the_default_precision_under_a_callers_highest(int8):
    """Mosaic refuses bf16 products at "highest" (found on a v5e with splash): the kernel's bf16 query products are
    at the default whatever the caller set (exact either way); its f32 transpose of the scales stays at HIGHEST."""
    from mesh_transformer.infer.paged_kernel import paged_decode_attention

    q = jnp.zeros((2, 4, 128), jnp.bfloat16)
    pages = jnp.zeros((6, 4, 8, 128), jnp.int8 if int8 else jnp.bfloat16)
    scales = jnp.ones((6, 8, 4), jnp.float32) if int8 else None
    with jax.default_matmul_precision("highest"):
        jaxpr = str(jax.make_jaxpr(partial(paged_decode_attention, pages_per_block=1))(
            q, pages, pages, scales, scales, jnp.array([3, 9]), jnp.array([[0, 1], [2, 3]], jnp.int32)))
    precisions = re.findall(r"precision=\((Precision\.\w+), Precision\.\w+\)", jaxpr)
    heads = q.shape[1]  # per head: the scores and the weighted values
    assert precisions.count("Precision.DEFAULT") == 2 * heads
    assert set(precisions) <= {"Precision.DEFAULT", "Precision.HIGHEST"}
    assert precisions.count("Precision.HIGHEST") == (2 if int8 else 0)


def test_kernel_decode_programs_on_dp2_mp4_give_the_gather_programs_greedy_tokens():
    """The kernel under the layout's shard_map (each device's heads of its dp group's pages), by Pallas' TPU
    interpreter on the CPU, against the gather path on one device. The kernel fetches whole blocks of pages, a
    table's padding included: padding must name a page of the group (an out-of-range one halts a TPU core)."""
    from jax.experimental.pallas import tpu as pltpu

    params = random_params(CFG, 3)
    tokens = []
    for (dp, mp), attention in (((1, 1), "gather"), ((2, 4), "kernel")):
        layout = infer_params.make_inference_layout(CFG, mesh=make_dp_mp(dp, mp))
        layout = dataclasses.replace(layout, policy=dataclasses.replace(layout.policy, paged_attention=attention,
                                                                        cache_bits=False))
        with pltpu.force_tpu_interpret_mode():
            tokens.append(greedy_programs(layout, infer_params.place_params(params, layout), PROMPTS + [[7]], 4, dp))
    np.testing.assert_array_equal(tokens[1], tokens[0])


@pytest.mark.parametrize("order", [(0, 1, 2, 3), (0, 2, 1, 3), (0, 2, 3, 1)], ids=["tpu", "gpu", "cpu"])
@pytest.mark.parametrize("kv_dtype", ["compute", "int8"])
def test_every_platforms_page_layout_holds_and_reads_the_same_keys(placed, order, kv_dtype):
    """Pages in each platform's axis order (`page_order`: the policy's cache order) give the same logits: the
    gather joins and the writes place tokens alike whatever the order."""
    layout, params = placed
    cfg = config.load("configs/tiny_rot_partial.json", ["cores_per_replica=1", "remat=false",
                                                         f"kv_cache_dtype={kv_dtype}"])
    table = random_tables(3, CFG.seq // PAGE, 40, seed=9)
    runs = []
    for cache_order in ((0, 1, 2, 3), order):
        policy = dataclasses.replace(layout.policy, cache_order=cache_order, cache_bits=False)
        cache = paged.zero_cache(40, PAGE, cfg, policy)
        run = jax.jit(lambda p, c, i, s, n, read, policy=policy: paged.paged_logits(p, c, i, s, n, table, cfg, read,
                                                                                  policy=policy), static_argnums=5)
        ids, length = padded(PROMPTS, 12)
        logits, cache = run(params, cache, ids, np.zeros(3, np.int32), length, 0)
        steps, position = [np.asarray(logits)], length.copy()
        for _ in range(3):
            token = np.asarray(logits).argmax(-1).astype(np.int32)[:, None]
            logits, cache = run(params, cache, token, position, np.ones(3, np.int32), n_read(position))
            steps.append(np.asarray(logits))
            position = position + 1
        runs.append(np.stack(steps))
    np.testing.assert_allclose(runs[1], runs[0], rtol=0, atol=1e-5)


def test_a_key_at_a_negative_position_or_past_the_table_is_written_nowhere():
    """Where a step's row takes no token (position -1) or a token lies past its table, its key's page is out of
    range (dropped by the scatter), whatever the table names; padding tokens too."""
    table = np.array([[3, 5], [7, 2]], np.int32)
    position = np.array([[-1, 9], [16, 3]], np.int32)
    real = np.array([[True, True], [True, False]])
    page, offset = paged.write_positions(table, position, real, n_pages=9, page=8)
    # -1: none; 9: page 5 at 1; 16: past the table's 2 pages of 8; 3: padding
    np.testing.assert_array_equal(np.asarray(page), [[9, 5], [9, 9]])
    assert int(np.asarray(offset)[0, 1]) == 1
