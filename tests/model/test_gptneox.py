"""The GPT-NeoX family (Pythia): logits equal transformers' GPTNeoXForCausalLM, HF state dicts, config.json files and
directories convert both ways, the sharded loss and gradients equal the unsharded ones, the fused decode form samples
what HF's generate does (f32 and int8), and config mistakes are named."""
import dataclasses
import json
from functools import partial

import jax
import numpy as np
import pytest
import torch
from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

from mesh_transformer import config
from mesh_transformer.config import ConfigError
from mesh_transformer.infer import decode, params as infer_params, sampler as sampling
from mesh_transformer.infer.params import make_inference_layout
from mesh_transformer.model import gptj as model
from mesh_transformer.parallel.layout import make_layout
from mesh_transformer.parallel.mesh import make_dp_mp
from mesh_transformer.store import convert, hf, hf_export
from tests.helpers import (CPU_POLICY, hf_greedy, hf_logits, layout_of, our_logits, ours_of, random_params,
                           state_dict_numpy)

# HF's shape of the tiny models: head dim 16, so rotary_pct 0.25 rotates 4 dims of each head and 1.0 all 16.
HF_SHAPE = {"vocab_size": 128, "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
            "intermediate_size": 256, "max_position_embeddings": 32}
BASE = 500.0  # a rotary base other than the default 10000
SHAPE_KEYS = ("family", "layers", "d_model", "n_heads", "n_vocab", "pe_rotary_dims", "rotary_base",
              "parallel_residual", "seq")
PROMPTS = [[5, 17, 42], [100, 3, 7, 9, 120, 11, 2], list(range(20, 32))]  # lengths 3, 7, 12


def random_neox(parallel: bool, pct: float, seed: int = 0) -> GPTNeoXForCausalLM:
    """HF's GPT-NeoX (eager attention), configured with the original config.json keys (rotary_pct,
    rotary_emb_base), every parameter random with a spread (LayerNorms and biases too), no EOS token."""
    torch.manual_seed(seed)
    hf_config = GPTNeoXConfig(**HF_SHAPE, rotary_pct=pct, rotary_emb_base=BASE, use_parallel_residual=parallel,
                              bos_token_id=None, eos_token_id=None)
    hf_config._attn_implementation = "eager"
    hf_model = GPTNeoXForCausalLM(hf_config).eval()
    with torch.no_grad():
        for p in hf_model.parameters():
            p.copy_(torch.randn_like(p) * 0.3)
    return hf_model


@pytest.fixture(scope="module")
def hf_models():
    """One random HF model per (parallel residual, rotary_pct), made once."""
    return {(parallel, pct): random_neox(parallel, pct, seed=int(parallel) + int(4 * pct))
            for parallel in (True, False) for pct in (0.25, 1.0)}


# ---- 1. logits ----

@pytest.mark.parametrize("pct", [0.25, 1.0])
@pytest.mark.parametrize("parallel", [True, False], ids=["parallel", "sequential"])
def test_logits_equal_hf_gptneox(hf_models, parallel, pct):
    hf_model = hf_models[parallel, pct]
    cfg, params = ours_of(hf_model)
    assert (cfg.family, cfg.parallel_residual, cfg.rotary_base) == ("gptneox", parallel, BASE)
    assert cfg.pe_rotary_dims == int(pct * cfg.head_dim)
    ids = np.random.default_rng(0).integers(0, cfg.n_vocab, (2, cfg.seq))
    expected = hf_logits(hf_model, ids)
    assert expected.std() > 1000 * 1e-4  # the random weights spread the logits: the tolerance is tight
    np.testing.assert_allclose(our_logits(params, ids, cfg), expected, atol=1e-4, rtol=0)


# ---- 2. HF state dicts, config.json and directories ----

def test_hf_state_dict_round_trips_exactly_both_ways(hf_models):
    hf_model = hf_models[False, 0.25]
    cfg, _ = ours_of(hf_model)
    # transformers 5 names the output embedding lm_head.weight; the original checkpoints (and we) embed_out.weight
    state = state_dict_numpy(hf_model)
    assert "lm_head.weight" in state
    original = {("embed_out.weight" if k == "lm_head.weight" else k): v for k, v in state.items()}
    for held in (state, original):
        back = hf.params_to_hf(hf.hf_to_params(held, cfg), cfg)
        assert set(back) == set(original) == set(hf.hf_names(cfg))
        for name, array in original.items():
            np.testing.assert_array_equal(back[name], array, err_msg=name)

    params = random_params(cfg, seed=1)
    jax.tree.map(np.testing.assert_array_equal, hf.hf_to_params(hf.params_to_hf(params, cfg), cfg), params)
    # q, k and v of one layer are the fused query_key_value's per-head thirds, as HF splits it
    qkv = original["gpt_neox.layers.1.attention.query_key_value.weight"].reshape(cfg.n_heads, 3, cfg.head_dim, -1)
    attn = hf.hf_to_params(original, cfg)["layers"]["attn"]
    for part, name in enumerate("qkv"):
        np.testing.assert_array_equal(attn[name][1], qkv[:, part].reshape(cfg.d_model, cfg.d_model).T)
    # and HF takes our state dict as complete
    fresh = GPTNeoXForCausalLM(hf_model.config).eval()
    ours = hf.params_to_hf(hf.hf_to_params(original, cfg), cfg)
    fresh.load_state_dict({("lm_head.weight" if k == "embed_out.weight" else k): torch.from_numpy(v.copy())
                           for k, v in ours.items()}, strict=True)
    ids = np.random.default_rng(1).integers(0, cfg.n_vocab, (1, 16))
    np.testing.assert_array_equal(hf_logits(fresh, ids), hf_logits(hf_model, ids))


def test_config_from_hf_gives_back_the_family_and_shape():
    for overrides in ([], ["parallel_residual=false", "rotary_base=2500.0", "pe_rotary_dims=8"]):
        cfg = config.load("configs/tiny_neox.json", overrides)
        hf_dict = hf.hf_config(cfg)
        assert hf_dict["model_type"] == "gpt_neox" and hf_dict["architectures"] == ["GPTNeoXForCausalLM"]
        # as we write config.json, and as transformers itself writes it back (rope_parameters alone)
        for written in (hf_dict, GPTNeoXConfig(**hf_dict).to_dict()):
            back = hf.config_from_hf(written)
            assert {k: getattr(back, k) for k in SHAPE_KEYS} == {k: getattr(cfg, k) for k in SHAPE_KEYS}
            assert back.cores_per_replica == cfg.cores_per_replica  # 8 heads, 256 ids: 8 splits both
    # a Pythia config.json as its authors wrote it (transformers 4: rotary_pct, rotary_emb_base)
    pythia = {"architectures": ["GPTNeoXForCausalLM"], "bos_token_id": 0, "eos_token_id": 0, "hidden_act": "gelu",
              "hidden_size": 512, "initializer_range": 0.02, "intermediate_size": 2048, "layer_norm_eps": 1e-05,
              "max_position_embeddings": 2048, "model_type": "gpt_neox", "num_attention_heads": 8,
              "num_hidden_layers": 6, "rotary_emb_base": 10000, "rotary_pct": 0.25, "tie_word_embeddings": False,
              "torch_dtype": "float16", "use_cache": True, "use_parallel_residual": True, "vocab_size": 50304}
    cfg = hf.config_from_hf(pythia)
    assert (cfg.family, cfg.layers, cfg.d_model, cfg.n_heads, cfg.n_vocab, cfg.seq) == ("gptneox", 6, 512, 8, 50304,
                                                                                         2048)
    assert cfg.pe_rotary_dims == 512 // 8 // 4 and cfg.rotary_base == 10000.0 and cfg.parallel_residual


@pytest.fixture(scope="module")
def saved_dir(hf_models, tmp_path_factory):
    """A random GPT-NeoX (sequential residual, rotary_pct 0.25) saved by transformers as safetensors, no tokenizer."""
    hf_model = hf_models[False, 0.25]
    path = str(tmp_path_factory.mktemp("neox") / "hf")
    hf_model.save_pretrained(path, safe_serialization=True)
    return path, hf_model


def test_a_saved_pretrained_directory_loads_to_the_same_params(saved_dir):
    path, hf_model = saved_dir
    cfg = convert.source_config(path, cores_per_replica=1)
    want_cfg, want = ours_of(hf_model)
    assert {k: getattr(cfg, k) for k in SHAPE_KEYS} == {k: getattr(want_cfg, k) for k in SHAPE_KEYS}
    assert cfg.tokenizer == path  # a GPT-NeoX directory is read with its own tokenizer
    loaded = convert.load_params(make_layout(cfg, jax.devices()[:1]), path, dtype="float32")
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), b), loaded, want)
    with convert.open_params(path, cfg) as reader:
        np.testing.assert_array_equal(reader.read(("layers", "attn", "v"), 1), want["layers"]["attn"]["v"][1])
        np.testing.assert_array_equal(reader.read(("lm_head", "kernel")), want["lm_head"]["kernel"])


def test_write_hf_output_loads_in_transformers_with_equal_logits(saved_dir, tmp_path):
    path, hf_model = saved_dir
    cfg = convert.source_config(path, cores_per_replica=1)
    out = str(tmp_path / "export")
    files = hf_export.write_hf(path, cfg, out, dtype="fp32", tokenizer="gpt2")  # the source dir has no tokenizer
    assert "config.json" in files and "tokenizer.json" in files
    written = json.loads((tmp_path / "export" / "config.json").read_text())
    assert written["model_type"] == "gpt_neox" and written["torch_dtype"] == "float32"
    loaded, info = GPTNeoXForCausalLM.from_pretrained(out, attn_implementation="eager", output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    assert loaded.config.use_parallel_residual is False
    ids = np.random.default_rng(2).integers(0, cfg.n_vocab, (2, 20))
    np.testing.assert_array_equal(hf_logits(loaded.eval(), ids), hf_logits(hf_model, ids))
    # and it reads back as the same params
    jax.tree.map(np.testing.assert_array_equal, dict(convert.iter_params(out, cfg)),
                 dict(convert.iter_params(path, cfg)))


# ---- 3. sharded equals unsharded ----

CFG = config.load("configs/tiny_neox.json", ["cores_per_replica=1", "remat=false"])  # 8 heads, V 256, seq 32
# (mesh spec, parallel residual): shard_map (dp, mp) and GSPMD (mode, data, fsdp, tensor), helpers.layout_of
SHARDED = [(("shard_map", 2, 4), True), (("shard_map", 4, 2), False), (("fsdp_tp", 2, 2, 2), False)]


def max_diff(a, b) -> float:
    return max(float(np.abs(np.asarray(x) - np.asarray(y)).max()) for x, y in zip(jax.tree.leaves(a),
                                                                                  jax.tree.leaves(b)))


@pytest.fixture(scope="module")
def reference():
    """parallel residual -> (cfg, params, tokens, loss, grads, logits) of the unsharded model on one device."""
    tokens = np.random.default_rng(3).integers(0, CFG.n_vocab, (8, CFG.seq + 1))
    out = {}
    for parallel in (True, False):
        cfg = dataclasses.replace(CFG, parallel_residual=parallel)
        params = random_params(cfg, seed=int(parallel))
        loss_fn = partial(model.loss_fn, cfg=cfg, policy=CPU_POLICY)
        loss, grads = jax.jit(jax.value_and_grad(loss_fn))(params, tokens)
        out[parallel] = cfg, params, tokens, loss, grads, our_logits(params, tokens[:, :-1], cfg)
    return out


@pytest.mark.parametrize("spec, parallel", SHARDED,
                         ids=[f"{'-'.join(map(str, s))}-{'parallel' if p else 'sequential'}" for s, p in SHARDED])
def test_sharded_loss_grads_and_logits_equal_the_unsharded_model(reference, spec, parallel):
    cfg, params, tokens, ref_loss, ref_grads, ref_logits = reference[parallel]
    layout = layout_of(cfg, spec)
    sharded = jax.device_put(params, layout.param_shardings())
    assert not sharded["layers"]["attn"]["q_bias"].sharding.is_fully_replicated  # split with the heads
    loss, grads = jax.jit(layout.loss_and_grad_fn())(sharded, {}, tokens)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)
    assert jax.tree.structure(grads) == jax.tree.structure(ref_grads)
    assert max_diff(grads, ref_grads) < 1e-6
    for name in ("ln_2", "attn"):  # the family's own params get gradients
        assert all(float(np.abs(np.asarray(g)).max()) > 0 for g in jax.tree.leaves(grads["layers"][name]))
    np.testing.assert_allclose(layout.logits_fn()(sharded, tokens[:, :-1]), ref_logits, atol=1e-5, rtol=0)


# ---- 4. inference: the fused decode form against HF's generate, f32 and int8 ----

@pytest.mark.parametrize("parallel, dp, mp, placed", [(False, 1, 1, "place"), (False, 2, 4, "read"),
                                                      (True, 1, 2, "read")],
                         ids=["sequential-1dev-place", "sequential-dp2-mp4-read", "parallel-mp2-read"])
def test_greedy_sampling_equals_hf_generate(hf_models, tmp_path, parallel, dp, mp, placed):
    hf_model = hf_models[parallel, 0.25]
    cfg, params = ours_of(hf_model)
    layout = make_inference_layout(cfg, mesh=make_dp_mp(dp, mp))
    if placed == "place":
        fused = infer_params.place_params(params, layout)
    else:  # read from an HF directory, one layer at a time
        hf_model.save_pretrained(str(tmp_path / "hf"), safe_serialization=True)
        fused = infer_params.read_params(layout, str(tmp_path / "hf"))
    assert infer_params.is_placed(fused) and len(fused["layers"]) == cfg.layers
    assert fused["layers"][0]["fused"]["in"].addressable_shards[0].data.shape[0] == 1  # one tensor-parallel slice
    results = sampling.Sampler(layout, fused).generate(PROMPTS, 10, temperature=0.0, return_logprobs=True)
    tokens, logprobs = hf_greedy(hf_model, PROMPTS, 10)
    for row, result in enumerate(results):
        assert result.tokens == tokens[row].tolist() and result.finish_reason == "length"
        np.testing.assert_allclose(result.logprobs, logprobs[row], atol=1e-4)


def prefill_logits(params, cfg, ids):
    """The logits after each row's last token [R, V] of the decode programs' prefill, with params placed for cfg."""
    placed = infer_params.place_params(params, make_inference_layout(cfg, mesh=make_dp_mp(1, 1)))
    block = jax.numpy.zeros(decode.block_shape(len(ids), cfg.seq, cfg, CPU_POLICY), decode.cache_dtype(cfg, CPU_POLICY))
    cache = decode.KVCache(*([[block] for _ in range(cfg.layers)] for _ in range(2)))
    length, slots = np.full(len(ids), ids.shape[1], np.int32), np.arange(len(ids), dtype=np.int32)
    return np.asarray(jax.jit(lambda p, c: decode.prefill_logits(p, c, ids, length, slots, cfg, policy=CPU_POLICY))(
        placed, cache)[0])


@pytest.mark.parametrize("parallel, compute, head", [(True, "float32", False), (False, "bfloat16", True)],
                         ids=["parallel-f32", "sequential-bf16-int8-head"])
def test_int8_weights_agree_with_f32_on_most_top1_choices(hf_models, parallel, compute, head):
    cfg, params = ours_of(hf_models[parallel, 0.25])
    int8 = dataclasses.replace(cfg, weight_dtype="int8", compute_dtype=compute, quantize_head=head)
    placed = infer_params.place_params(params, make_inference_layout(int8, mesh=make_dp_mp(1, 1)))
    assert placed["layers"][0]["fused"]["in"].dtype == np.int8 and placed["layers"][0]["fused"]["out"].dtype == np.int8
    assert (placed["lm_head"]["kernel"].dtype == np.int8) == head
    ids = np.random.default_rng(4).integers(0, cfg.n_vocab, (32, 12)).astype(np.int32)
    ref, ours = prefill_logits(params, cfg, ids), prefill_logits(params, int8, ids)
    np.testing.assert_allclose(ref, hf_logits(hf_models[parallel, 0.25], ids)[:, -1], atol=1e-4)
    relative_rms = np.sqrt(np.mean((ours - ref) ** 2)) / ref.std()
    assert 0 < relative_rms < 0.05, relative_rms
    assert np.mean(ours.argmax(-1) == ref.argmax(-1)) >= 0.9


def test_int8_on_dp2_mp2_samples_as_on_one_device(hf_models):
    # f32 compute: in bf16 the tensor-parallel partial sums round differently from the whole ones (about 1e-2 in
    # these weights' log-probabilities, int8 or not), which would hide a mistake of that size
    cfg, params = ours_of(hf_models[False, 0.25])
    int8 = dataclasses.replace(cfg, weight_dtype="int8", compute_dtype="float32", quantize_head=True)
    one = sampling.Sampler(make_inference_layout(int8, mesh=make_dp_mp(1, 1)), params)
    sharded = sampling.Sampler(make_inference_layout(int8, mesh=make_dp_mp(2, 2)), params)
    placed = sharded.params
    assert placed["layers"][0]["fused"]["in"].dtype == np.int8 and placed["lm_head"]["kernel"].dtype == np.int8
    expected = one.generate(PROMPTS, 8, temperature=0.0, return_logprobs=True)
    for ours, ref in zip(sharded.generate(PROMPTS, 8, temperature=0.0, return_logprobs=True), expected):
        assert ours.tokens == ref.tokens
        np.testing.assert_allclose(ours.logprobs, ref.logprobs, atol=1e-5)


# ---- 5. config mistakes ----

def test_an_unknown_family_is_a_config_error_naming_the_choices():
    raw = json.loads(open("configs/tiny_neox.json").read())
    with pytest.raises(ConfigError, match=r"config key 'family': unknown model family 'falcon'; choose one of "
                                          r"gptj, gptneox, llama"):
        config.from_dict({**raw, "family": "falcon"})


@pytest.mark.parametrize("key, value", [("parallel_residual", False), ("rotary_base", 500.0)])
def test_a_gptneox_key_in_a_gptj_config_is_a_config_error_naming_the_family(key, value):
    raw = {k: v for k, v in json.loads(open("configs/tiny_neox.json").read()).items()
           if k not in ("family", "parallel_residual", "rotary_base")}
    assert config.from_dict(raw).family == "gptj"
    with pytest.raises(ConfigError, match=f"config key '{key}' belongs to the gptneox family, not this config's "
                                          f"gptj"):
        config.from_dict({**raw, key: value})


def test_config_from_hf_refuses_an_activation_other_than_gelu(tmp_path):
    hf_dict = {**GPTNeoXConfig(**HF_SHAPE).to_dict(), "hidden_act": "relu"}
    with pytest.raises(ValueError, match="only GPT-NeoX models with hidden_act = 'gelu' are supported, this one has "
                                         "'relu'"):
        hf.config_from_hf(hf_dict)
    # an HF directory with such a config.json: a ConfigError naming the file, before any weight is read
    (tmp_path / "config.json").write_text(json.dumps(hf_dict))
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(ConfigError, match=f"{tmp_path / 'config.json'}: only GPT-NeoX models with hidden_act"):
        convert.source_config(str(tmp_path))


@pytest.mark.parametrize("family", ["gptj", "gptneox"])
def test_the_token_api_stops_at_the_familys_end_of_text_unless_told(family):
    """A model whose every next token is the family's end of text (Pythia's 0, GPT-2's 50256): the sampler's token
    API stops there by default, before returning it; told other stops, it runs on."""
    from mesh_transformer.model import families, table

    base = {"layers": 1, "d_model": 32, "n_heads": 4, "n_vocab": 50304, "pe_rotary_dims": 4, "seq": 16,
            "cores_per_replica": 1}
    cfg = config.from_dict({**base, "family": family})
    eos = families.of(cfg).eos_id
    params = jax.tree.map(lambda s: np.zeros(s.shape, np.float32), table.param_shapes(cfg))
    params["lm_head"]["kernel"][:, eos] = 1.0
    params["ln_f"]["bias"][:] = 1.0  # the final LayerNorm's output: its bias, so every logit but eos's is 0
    sampler = sampling.Sampler(make_inference_layout(cfg, mesh=make_dp_mp(1, 1)), params)
    assert [r.tokens for r in sampler.generate([[1, 2]], 4, temperature=0.0)] == [[]]
    assert sampler.generate([[1, 2]], 4, temperature=0.0, stop_token_ids=[7])[0].tokens == [eos] * 4
