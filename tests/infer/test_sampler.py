import concurrent.futures
import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from mesh_transformer.model import table
from mesh_transformer.store import checkpoint, hf
from mesh_transformer import config, platforms
from mesh_transformer.model import gptj as model
from mesh_transformer.infer import choose, decode, programs as infer_programs, sampler as sampling
from mesh_transformer.infer import params as infer_params
from mesh_transformer.infer.params import make_inference_layout
from mesh_transformer.parallel.mesh import make_dp_mp
from mesh_transformer.tokenizer import load_tokenizer
from tests.helpers import CPU_POLICY, left_pad, random_hf_model, run_script, run_scripts, state_dict_numpy

CFG = config.load("configs/tiny_rot_partial.json", ["cores_per_replica=1", "remat=false"])  # seq 32, vocab 256
PROMPTS = [[5, 17, 42], [100, 3, 7, 9, 250, 11, 2], list(range(20, 32))]  # lengths 3, 7, 12: one bucket (16)
MIXED = {"temperature": [0.0, 0.8, 1.0], "top_k": [0, 0, 20], "top_p": [1.0, 0.9, 1.0], "seed": [0, 1, 2]}
# GPT-2's vocabulary (padded to divide 8 shards), so that text round-trips through the real tokenizer.
BIG = config.from_dict({"layers": 1, "d_model": 32, "n_heads": 4, "n_vocab": 50304, "pe_rotary_dims": 4, "seq": 64,
                        "cores_per_replica": 1})


def cache_order(platform: str):
    """The CPU policy with its cache blocks' axes in the order of this platform's policy."""
    return dataclasses.replace(CPU_POLICY, cache_order=platforms.for_platform(platform).cache_order)


@pytest.fixture(scope="module")
def hf_model():
    return random_hf_model(CFG)


@pytest.fixture(scope="module")
def params(hf_model):
    return hf.hf_to_params(state_dict_numpy(hf_model), CFG)


@pytest.fixture(scope="module")
def sampler(params):
    return sampling.Sampler(make_inference_layout(CFG, mesh=make_dp_mp(1, 1)), params)


@pytest.fixture(scope="module")
def greedy(sampler):
    return sampler.generate(PROMPTS, 10, temperature=0.0, return_logprobs=True)


def right_pad(rows):
    return np.array([row + [0] * (max(map(len, rows)) - len(row)) for row in rows])


def test_greedy_equals_hf_generate_with_left_padding(hf_model, greedy):
    ids, mask = left_pad(PROMPTS)
    with torch.no_grad():
        out = hf_model.generate(torch.tensor(ids), attention_mask=torch.tensor(mask), max_new_tokens=10,
                                do_sample=False, pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    hf_tokens = out.sequences[:, ids.shape[1]:].numpy()
    hf_logprobs = torch.log_softmax(torch.stack(out.logits, 1), -1).numpy()
    for row, result in enumerate(greedy):
        assert result.tokens == hf_tokens[row].tolist() and result.finish_reason == "length"
        np.testing.assert_allclose(result.logprobs, hf_logprobs[row, np.arange(10), hf_tokens[row]], atol=1e-4)


@pytest.mark.parametrize("dtype, atol", [("float32", 1e-5), ("bfloat16", 2e-2)])
@pytest.mark.parametrize("cache_platform", ["cpu", "tpu", "gpu"])
def test_kv_cache_logits_equal_full_forward_at_every_step(params, dtype, atol, cache_platform):
    cfg, policy = dataclasses.replace(CFG, compute_dtype=dtype), cache_order(cache_platform)
    prompts, fed = [[7, 8, 9], [1, 2, 3, 4, 5, 6]], np.array([[11, 12, 13], [21, 22, 23]])
    width = 8  # the prompt bucket; the cache holds 8 + 4 positions in two blocks
    ids = right_pad(prompts + [[0] * width])[:2]
    length = np.array([len(p) for p in prompts], np.int32)
    decode_params = infer_params.place_params(params, make_inference_layout(cfg, mesh=make_dp_mp(1, 1)))
    cache = decode.KVCache(*([[jnp.zeros(decode.block_shape(2, size, cfg, policy), decode.cache_dtype(cfg, policy))
                               for size in (8, 4)]
                              for _ in range(cfg.layers)] for _ in range(2)))
    prefill = jax.jit(lambda p, c: decode.prefill_logits(p, c, ids, length, np.arange(2, dtype=np.int32), cfg,
                                                              policy=policy))
    step = jax.jit(lambda p, c, token, position: decode.decode_logits(p, c, token, position, cfg, n_blocks=2,
                                                                                   policy=policy))
    # Right-padded rows in one causal forward: padding after a position does not change its logits.
    rows = [p + f.tolist() for p, f in zip(prompts, fed)]
    full = np.asarray(jax.jit(lambda p, x: model.forward(p, x, cfg, policy=policy))(params, right_pad(rows)))
    expected = [full[row, len(p) - 1:] for row, p in enumerate(prompts)]

    logits, cache = prefill(decode_params, cache)
    for i in range(fed.shape[1] + 1):
        for row in range(2):
            np.testing.assert_allclose(logits[row], expected[row][i], atol=atol)
        if i < fed.shape[1]:
            logits, cache = step(decode_params, cache, fed[:, i].astype(np.int32), length + i)


@pytest.mark.parametrize("dtype, atol", [("float32", 1e-5), ("bfloat16", 2e-2)])
@pytest.mark.parametrize("cache_platform", ["cpu", "tpu", "gpu"])
def test_prefill_after_a_cached_prefix_equals_the_full_forward_in_its_own_slot_and_copied(params, dtype, atol,
                                                                                         cache_platform):
    cfg, policy = dataclasses.replace(CFG, compute_dtype=dtype), cache_order(cache_platform)
    cached = list(range(40, 50))  # prefilled into slot 0; its first 8 tokens are the prefix both rows reuse
    own, copied = cached[:8] + [3, 4, 5], cached[:8] + [7, 9, 11, 13]  # row 0: in slot 0 itself; row 1: into slot 2
    decode_params = infer_params.place_params(params, make_inference_layout(cfg, mesh=make_dp_mp(1, 1)))
    cache = decode.KVCache(*([[jnp.zeros(decode.block_shape(3, size, cfg, policy), decode.cache_dtype(cfg, policy))
                               for size in (8, 8, 16)]
                              for _ in range(cfg.layers)] for _ in range(2)))
    _, cache = jax.jit(lambda p, c: decode.prefill_logits(p, c, right_pad([cached]), np.array([10], np.int32),
                                                          np.array([0], np.int32), cfg, policy=policy))(
        decode_params, cache)
    tails = right_pad([own[8:], copied[8:]]).astype(np.int32)
    extend = jax.jit(lambda p, c: decode.extend_logits(
        p, c, tails, np.array([8, 8], np.int32), np.array([3, 4], np.int32), np.array([0, 2], np.int32),
        np.array([0, 0], np.int32), cfg, policy=policy))
    logits, cache = extend(decode_params, cache)
    step = jax.jit(lambda p, c: decode.decode_logits(p, c, np.array([21, 22, 23], np.int32),
                                                     np.array([11, 0, 12], np.int32), cfg, n_blocks=3,
                                                     policy=policy))
    next_logits, _ = step(decode_params, cache)  # slot 2's copied prefix and written tail are what it reads
    rows = [own + [21], copied + [23]]
    full = np.asarray(jax.jit(lambda p, x: model.forward(p, x, cfg, policy=policy))(params, right_pad(rows)))
    for row, tokens in enumerate(rows):
        np.testing.assert_allclose(logits[row], full[row, len(tokens) - 2], atol=atol)
    np.testing.assert_allclose(next_logits[0], full[0, len(own)], atol=atol)
    np.testing.assert_allclose(next_logits[2], full[1, len(copied)], atol=atol)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_the_cache_scatter_on_bits_equals_a_plain_scatter(dtype):
    cfg = dataclasses.replace(CFG, compute_dtype=dtype)
    block = jax.random.normal(jax.random.PRNGKey(0), (3, 2, 4, 8)).astype(dtype)
    values = jax.random.normal(jax.random.PRNGKey(1), (3, 2, 4)).astype(dtype)
    index = (jnp.array([2, 0, 3]), slice(None), slice(None), jnp.array([5, 7, 1]))  # row 3: out of range, dropped
    bits = jax.lax.bitcast_convert_type(block, decode.cache_dtype(cfg, CPU_POLICY))
    dtype = model.precision(cfg).compute
    written = jax.jit(lambda b, v: decode.cached(decode.scatter(b, index, v), dtype))(bits, values)
    np.testing.assert_array_equal(written, block.at[index].set(values, mode="drop"))


@pytest.mark.parametrize("dp, mp", [(2, 4), (1, 8)], ids=["dp2-mp4", "dp1-mp8"])
def test_sharded_results_equal_single_device(params, sampler, greedy, dp, mp):
    kwargs = {**MIXED, "return_logprobs": True, "stop_token_ids": [greedy[0].tokens[3]]}  # row 0 ends early
    expected = sampler.generate(PROMPTS, 10, **kwargs)
    assert expected[0].finish_reason == "stop"
    sharded = sampling.Sampler(make_inference_layout(CFG, mesh=make_dp_mp(dp, mp)), params)
    fused_in = sharded.params["layers"][0]["fused"]["in"]  # each device: its heads' q, k, v and its fc_in columns
    assert fused_in.addressable_shards[0].data.shape == (1, (3 * CFG.d_model + CFG.d_ff) // mp, CFG.d_model)
    for ours, ref in zip(sharded.generate(PROMPTS, 10, **kwargs), expected):
        assert ours.tokens == ref.tokens and ours.finish_reason == ref.finish_reason
        np.testing.assert_allclose(ours.logprobs, ref.logprobs, atol=1e-5)


def test_the_device_loop_equals_decode_steps_and_ends_once_every_live_row_has_stopped(params):
    layout = make_inference_layout(CFG, mesh=make_dp_mp(2, 4))
    programs, placed = infer_programs.Programs(layout), infer_params.place_params(params, layout)
    ids = right_pad(PROMPTS + [[1]])  # 4 slots, 2 per dp group; the last a padding row, not live
    length, slots = np.array([len(p) for p in PROMPTS] + [1], np.int32), np.array([0, 1, 0, -1], np.int32)
    sampling = jax.device_put(choose.fill_sampling(4, []), programs.row_sharding)

    def prefilled():
        cache = programs.new_cache(4, [32])
        first, _, last, cache = programs.prefill(placed, cache, programs.new_slots(4), ids, length, slots,
                                                 sampling)
        steps = jax.device_put(decode.Steps(length, np.ones(4, np.int32), sampling), programs.row_sharding)
        return np.asarray(first), (cache, last, steps)

    first, (cache, last, steps) = prefilled()
    stepped = []
    for _ in range(9):
        token, _, last, steps, cache = programs.decode(placed, cache, last, steps, rows=2, n_blocks=1)
        stepped.append(np.asarray(token))
    stepped = np.stack(stepped, 1)
    live = jax.device_put(np.array([True, True, True, False]), programs.row_sharding)
    stops = sorted({*stepped[:3, 2]})
    # Each live row stops at its first stop token (the prefill's counts); the loop, when the last of them has.
    made = np.concatenate([first[:, None], stepped], 1)[:3]
    last_stop = max(int(np.argmax(np.isin(row, stops))) for row in made)
    for stop, ran in [([], 9), (stops, last_stop)]:
        stop_S = np.array(stop + [-1] * (4 - len(stop)), np.int32)
        tokens, _, _ = programs.generate(placed, *prefilled()[1], live, stop_S, np.int32(9), rows=2, n_blocks=1,
                                         out_len=16)
        tokens = np.asarray(tokens)
        np.testing.assert_array_equal(tokens[:3, :ran], stepped[:3, :ran])
        assert (tokens[:, ran:] == 0).all()  # the loop ran no further


def test_top_k_1_equals_greedy(sampler, greedy):
    results = sampler.generate(PROMPTS, 10, temperature=1.0, top_k=1, seed=[3, 4, 5])
    assert [r.tokens for r in results] == [r.tokens for r in greedy]


def test_top_p_keeps_smallest_set_reaching_p():
    probs = np.array([0.1, 0.5, 0.05, 0.3, 0.05])
    logits = jnp.log(jnp.asarray(np.tile(probs, (5, 1)), jnp.float32))
    top_p = jnp.array([0.45, 0.55, 0.85, 1.0, 1.0])
    top_k = jnp.array([0, 0, 0, 0, 2])
    kept = np.isfinite(np.asarray(jax.jit(choose.filter_logits)(logits, top_k, top_p)))
    assert [set(np.flatnonzero(row)) for row in kept] == [{1}, {1, 3}, {0, 1, 3}, {0, 1, 2, 3, 4}, {1, 3}]
    keys = jax.random.split(jax.random.PRNGKey(0), 256)
    drawn = jax.jit(choose.sample)(jnp.tile(logits[:1], (256, 1)), jnp.ones(256), jnp.zeros(256, jnp.int32),
                            jnp.full(256, 0.55), keys)
    assert set(np.asarray(drawn).tolist()) == {1, 3}


def test_same_seed_same_tokens_other_seed_others(sampler):
    prompt = PROMPTS[1]
    first = sampler.generate([prompt, prompt, prompt], 10, temperature=1.0, seed=[7, 7, 8])
    assert first[0].tokens == first[1].tokens != first[2].tokens
    again = sampler.generate([PROMPTS[0], prompt, prompt], 10, temperature=1.0, seed=[1, 7, 9])
    assert again[1].tokens == first[0].tokens  # a row's draw depends on its seed, not on its place in the batch


def test_stop_token_ends_row_on_device(sampler, greedy):
    stop = greedy[0].tokens[3]
    for result, full in zip(sampler.generate(PROMPTS, 10, temperature=0.0, stop_token_ids=[stop]), greedy):
        cut = full.tokens.index(stop) if stop in full.tokens else None
        assert result.tokens == full.tokens[:cut]
        assert result.finish_reason == ("length" if cut is None else "stop")


def test_new_lengths_inside_the_buckets_do_not_compile_again(sampler, greedy):
    compiled = sampler.compile_count
    assert compiled >= 1
    results = sampler.generate([[1, 2], list(range(40, 56)), [9] * 5], 13, temperature=0.0, return_logprobs=True)
    assert [len(r.tokens) for r in results] == [13, 13, 13]
    assert sampler.compile_count == compiled


@pytest.mark.parametrize("dp, mp, max_new", [(1, 1, 10), (2, 4, 10), (2, 4, 1)])
def test_compiled_ahead_from_shapes_the_sampler_compiles_nothing_more(params, sampler, greedy, dp, mp, max_new):
    programs = infer_programs.Programs(make_inference_layout(CFG, mesh=make_dp_mp(dp, mp)))
    sampling.compile_ahead(programs, len(PROMPTS), max(map(len, PROMPTS)), max_new)  # before any weights exist
    assert programs.traces == (2 if max_new > 1 else 1)
    ahead = sampling.Sampler(programs.layout, params, programs)
    results = ahead.generate(PROMPTS, max_new, temperature=0.0, return_logprobs=True)
    assert programs.traces == (2 if max_new > 1 else 1)
    for ours, ref in zip(results, greedy):
        assert ours.tokens == ref.tokens[:max_new]
        np.testing.assert_allclose(ours.logprobs, ref.logprobs[:max_new], atol=1e-5)


def test_without_logprobs_the_tokens_are_the_same(sampler, greedy):
    plain = sampler.generate(PROMPTS, 10, temperature=0.0)  # a program that skips the log-softmax
    assert [r.tokens for r in plain] == [r.tokens for r in greedy] and all(r.logprobs is None for r in plain)


def test_truncate_left_cuts_the_prompt_from_the_left(sampler):
    long = list(range(30, 60))  # 30 tokens + 16 new > seq 32
    with pytest.raises(ValueError, match="beyond the context of 32 tokens"):
        sampler.generate([long, *PROMPTS[:2]], 16, temperature=0.0)
    cut = sampler.generate([long, *PROMPTS[:2]], 16, temperature=0.0, truncate_left=True)
    assert cut == sampler.generate([long[-16:], *PROMPTS[:2]], 16, temperature=0.0)


@pytest.mark.parametrize("prompts, kwargs, match", [
    ([[1, 2], []], {}, "prompt 1 is empty"),
    ([], {}, "no prompts"),
    ([[1, 300]], {}, "token id 300 outside the vocabulary"),
    ([list(range(30))], {}, "beyond the context"),
    ([[1]], {"top_p": 0.0}, r"top_p must be in \(0, 1\]"),
    ([[1]], {"top_p": 1.5}, r"top_p must be in \(0, 1\]"),
    ([[1]], {"temperature": -0.5}, "temperature must be at least 0"),
    ([[1]], {"top_k": -1}, "top_k must be at least 0"),
    ([[1]], {"max_new_tokens": 0}, "max_new_tokens must be an integer of at least 1"),
    ([[1], [2]], {"seed": [1, 2, 3]}, "seed has 3 values for 2 prompts"),
], ids=["empty-prompt", "no-prompts", "bad-token", "too-long", "top-p-0", "top-p-1.5", "negative-temperature",
        "negative-top-k", "max-new-0", "seed-count"])
def test_bad_inputs_are_clear_errors(sampler, prompts, kwargs, match):
    kwargs = {"max_new_tokens": 8, **kwargs}
    with pytest.raises(ValueError, match=match):
        sampler.generate(prompts, **kwargs)


def test_load_params_reads_params_only_and_rejects_a_mismatched_config(tmp_path, params):
    state = {"step": np.int32(5), "params": params, "opt_state": {"mu": np.zeros(3, np.float32)}}
    checkpoint.save(str(tmp_path), 5, state, blocking=True)
    layout = make_inference_layout(CFG, mesh=make_dp_mp(1, 1))
    for path in (str(tmp_path), str(tmp_path / "step_5")):
        loaded = infer_params.load_params(layout, path)
        jax.tree.map(np.testing.assert_array_equal, loaded, params)
    with pytest.raises(ValueError, match="does not match the config: checkpoint leaf 'params/embed/wte' has shape"):
        infer_params.load_params(make_inference_layout(dataclasses.replace(CFG, n_vocab=128), mesh=layout.mesh),
                                 str(tmp_path))
    with pytest.raises(FileNotFoundError, match="no checkpoint at"):
        infer_params.load_params(layout, str(tmp_path / "nothing"))


def test_cut_at_stop_cuts_before_the_earliest_stop_string():
    assert sampling.cut_at_stop("Hello world. Bye.\n", ["\n", ". B"]) == ("Hello world", True)
    assert sampling.cut_at_stop("Hello", ["x", "yz"]) == ("Hello", False)
    assert sampling.cut_at_stop("stop at once", ["stop"]) == ("", True)


@pytest.fixture(scope="module")
def big_params():
    return table.init_unsharded(BIG, jax.random.PRNGKey(0))


@pytest.fixture(scope="module")
def big_text(big_params):
    big_sampler = sampling.Sampler(make_inference_layout(BIG, mesh=make_dp_mp(1, 1)), big_params)
    full = big_sampler.generate_text(load_tokenizer(), ["Hello world"], 12, temperature=0.0)[0]
    assert len(full.text) >= 6
    stop = full.text[len(full.text) // 2:][:3]
    cut = big_sampler.generate_text(load_tokenizer(), ["Hello world"], 12, temperature=0.0, stop=[stop])[0]
    return full, stop, cut


def test_stop_strings_cut_the_text_exactly(big_text):
    full, stop, cut = big_text
    assert cut.text == full.text[:full.text.find(stop)] and cut.finish_reason == "stop"
    assert len(cut.tokens) < len(full.tokens) and cut.tokens == full.tokens[:len(cut.tokens)]
    assert cut.text.startswith(load_tokenizer().decode(cut.tokens))


@pytest.fixture
def saved_big(tmp_path, big_params):
    checkpoint.save(str(tmp_path / "ckpt"), 1, {"step": np.int32(1), "params": big_params}, blocking=True)
    path = tmp_path / "big.json"
    path.write_text(json.dumps({**{k: getattr(BIG, k) for k in ("layers", "d_model", "n_heads", "n_vocab",
                                                                  "pe_rotary_dims", "seq")},
                                "cores_per_replica": 1, "model_dir": str(tmp_path / "ckpt")}))
    return str(path)


def test_cli_prints_the_completion(saved_big, big_text):
    full, stop, cut = big_text
    argv = ["--config", saved_big, "--prompt", "Hello world", "--max-new-tokens", "12", "--temperature", "0",
            "--stop", stop, "--set", "cores_per_replica=2"]
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        once = pool.submit(run_script, "device_sample.py", *argv)
        piped = pool.submit(run_script, "device_sample.py", *argv[:2], *argv[4:],
                            stdin="Hello world\n\nHello world\n")
    assert once.result().returncode == 0, once.result().stderr
    assert once.result().stdout == cut.text + "\n"
    assert piped.result().returncode == 0, piped.result().stderr
    assert piped.result().stdout == (cut.text + "\n") * 2


BAD_INPUT = [
    (["--temperature", "hot"], "invalid float value: 'hot'"),
    (["--top-p", "1.5"], "top_p must be in (0, 1]"),
    (["--max-new-tokens", "0"], "--max-new-tokens must be at least 1"),
    (["--set", "n_heads=3"], "config key 'd_model' (32) must be divisible by n_heads (3)"),
    (["--bogus"], "unrecognized arguments: --bogus"),
    (["--prompt", " x" * 100, "--max-new-tokens", "8"], "beyond the context of 64 tokens"),
]


def test_cli_bad_input_is_a_one_line_error(saved_big):
    results = run_scripts(*(("device_sample.py", "--config", saved_big, *extra) for extra, _ in BAD_INPUT))
    for (extra, match), result in zip(BAD_INPUT, results):
        *logged, err = result.stderr.splitlines()
        assert result.returncode == 2 and err.startswith("error: ") and match in err, (extra, result.stderr)
        assert "Traceback" not in result.stderr
        assert all(line.startswith(("inference mesh:", "loading layers")) or not line.strip() for line in logged)


def test_ladders_pad_every_count_to_few_sizes():
    from mesh_transformer.infer.sizes import fit, ladder
    assert ladder(1, 4) == [1] and ladder(4, 4) == [1, 4] and ladder(8, 4) == [1, 4, 8]
    assert ladder(64, 4) == [1, 4, 16, 64] and ladder(4, 2) == [1, 2, 4] and ladder(6, 2) == [1, 2, 4, 6]
    for n, base in ((8, 4), (33, 2), (5, 4)):
        sizes = ladder(n, base)
        assert all(fit(k, sizes) >= k and fit(k, sizes) in sizes for k in range(1, n + 1))
        assert fit(n, sizes) == n
