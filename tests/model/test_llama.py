"""The Llama family (Llama 2, Llama 3 with grouped-query attention and its rope scaling, Mistral): logits equal
transformers' LlamaForCausalLM and MistralForCausalLM, HF state dicts and directories convert both ways (a tied
embedding read as the head), the sharded loss and gradients equal the unsharded ones on shard_map and GSPMD meshes,
greedy sampling through the fused decode form equals HF's generate, and config mistakes are named."""
import dataclasses
from functools import partial

import jax
import numpy as np
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM

from mesh_transformer import config
from mesh_transformer.config import ConfigError
from mesh_transformer.infer import params as infer_params, sampler as sampling
from mesh_transformer.infer.params import make_inference_layout
from mesh_transformer.model import gptj as model
from mesh_transformer.parallel.mesh import make_dp_mp
from mesh_transformer.store import hf
from tests.helpers import CPU_POLICY, hf_greedy, layout_of, random_params, state_dict_numpy

# head dim 16; 8 query heads over 8 (Llama 2's MHA), 4 or 2 key/value heads (grouped-query)
SHAPE = {"vocab_size": 128, "hidden_size": 128, "num_hidden_layers": 2, "num_attention_heads": 8,
         "intermediate_size": 96, "max_position_embeddings": 32, "rms_norm_eps": 1e-5, "bos_token_id": None,
         "eos_token_id": None, "pad_token_id": None}
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8}
KINDS = {  # name -> (HF class, config class, its keys)
    "llama2": (LlamaForCausalLM, LlamaConfig, {"num_key_value_heads": 8, "rope_theta": 10000.0}),
    "llama3": (LlamaForCausalLM, LlamaConfig, {"num_key_value_heads": 2, "rope_theta": 500000.0,
                                                "rope_scaling": LLAMA3_ROPE, "tie_word_embeddings": True}),
    "linear": (LlamaForCausalLM, LlamaConfig, {"num_key_value_heads": 4, "rope_theta": 1000.0,
                                                "rope_scaling": {"rope_type": "linear", "factor": 4.0}}),
    "mistral": (MistralForCausalLM, MistralConfig, {"num_key_value_heads": 4, "rope_theta": 1e6,
                                                     "sliding_window": None}),
}
PROMPTS = [[5, 17, 42], [100, 3, 7, 9, 120, 11, 2], list(range(20, 32))]


def random_hf(kind: str, seed: int = 0):
    model_class, config_class, keys = KINDS[kind]
    torch.manual_seed(seed)
    hf_config = config_class(**SHAPE, **keys)
    hf_config._attn_implementation = "eager"
    hf_model = model_class(hf_config).eval()
    with torch.no_grad():  # norms too, so each one counts
        for p in hf_model.parameters():
            p.copy_(torch.randn_like(p) * 0.2)
    return hf_model


@pytest.fixture(scope="module")
def hf_models():
    return {kind: random_hf(kind, seed) for seed, kind in enumerate(KINDS)}


def ours_of(hf_model, **overrides):
    cfg = hf.config_from_hf(hf_model.config.to_dict(), cores_per_replica=1, remat=False, **overrides)
    return cfg, hf.hf_to_params(state_dict_numpy(hf_model), cfg)


def hf_logits(hf_model, ids) -> np.ndarray:
    with torch.no_grad():
        return hf_model(torch.tensor(ids)).logits.numpy()


def our_logits(params, ids, cfg) -> np.ndarray:
    return np.asarray(jax.jit(lambda p, x: model.forward(p, x, cfg, policy=CPU_POLICY))(params, ids))


@pytest.mark.parametrize("kind", list(KINDS))
def test_logits_equal_hf(hf_models, kind):
    hf_model = hf_models[kind]
    cfg, params = ours_of(hf_model)
    assert cfg.family == "llama" and cfg.kv_heads == KINDS[kind][2]["num_key_value_heads"]
    assert cfg.d_ff == 96 and cfg.pe_rotary_dims == cfg.head_dim
    ids = np.random.default_rng(0).integers(0, cfg.n_vocab, (2, cfg.seq))
    expected = hf_logits(hf_model, ids)
    assert expected.std() > 1000 * 1e-4
    np.testing.assert_allclose(our_logits(params, ids, cfg), expected, atol=1e-4, rtol=0)


def test_state_dicts_round_trip_and_a_tied_head_is_read_from_the_embedding(hf_models):
    hf_model = hf_models["llama3"]  # tied: its state dict may lack lm_head.weight
    cfg, params = ours_of(hf_model)
    state = state_dict_numpy(hf_model)
    untied = {k: v for k, v in state.items() if k != "lm_head.weight"}
    from_embedding = hf.hf_to_params(untied, cfg)
    np.testing.assert_array_equal(from_embedding["lm_head"]["kernel"], state["model.embed_tokens.weight"].T)
    back = hf.params_to_hf(params, cfg)
    assert set(back) == set(hf.hf_names(cfg)) and "lm_head.weight" in back
    for name, array in back.items():
        np.testing.assert_array_equal(array, state.get(name, state["model.embed_tokens.weight"]), err_msg=name)
    # written untied, a fresh HF model takes it whole and gives the same logits
    keys = {**hf.hf_config(cfg)}
    fresh = LlamaForCausalLM(LlamaConfig(**{k: v for k, v in keys.items() if k != "model_type"})).eval()
    fresh.load_state_dict({k: torch.from_numpy(v.copy()) for k, v in back.items()}, strict=True)
    ids = np.random.default_rng(1).integers(0, cfg.n_vocab, (1, 16))
    np.testing.assert_allclose(hf_logits(fresh, ids), hf_logits(hf_model, ids), atol=1e-5)


# ---- sharded equals unsharded ----

SHARDED = [("shard_map", 2, 4), ("shard_map", 4, 2), ("fsdp", 1, 8, 1), ("fsdp_tp", 2, 2, 2)]


@pytest.fixture(scope="module")
def reference(hf_models):
    cfg, _ = ours_of(hf_models["mistral"])  # 8 heads over 4 key/value heads
    params = random_params(cfg, seed=3)
    tokens = np.random.default_rng(3).integers(0, cfg.n_vocab, (8, cfg.seq + 1))
    loss, grads = jax.jit(jax.value_and_grad(partial(model.loss_fn, cfg=cfg, policy=CPU_POLICY)))(params, tokens)
    return cfg, params, tokens, loss, grads, our_logits(params, tokens[:, :-1], cfg)


@pytest.mark.parametrize("spec", SHARDED, ids=["-".join(map(str, s)) for s in SHARDED])
def test_sharded_loss_grads_and_logits_equal_the_unsharded_model(reference, spec):
    cfg, params, tokens, ref_loss, ref_grads, ref_logits = reference
    layout = layout_of(cfg, spec)
    sharded = jax.device_put(params, layout.param_shardings())
    loss, grads = jax.jit(layout.loss_and_grad_fn())(sharded, {}, tokens)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)
    for got, want in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads)):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-6)
    assert all(float(np.abs(np.asarray(g)).max()) > 0 for g in jax.tree.leaves(grads["layers"]["mlp"]["gate"]))
    np.testing.assert_allclose(layout.logits_fn()(sharded, tokens[:, :-1]), ref_logits, atol=1e-5, rtol=0)


# ---- inference: the fused decode form against HF's generate ----

@pytest.mark.parametrize("kind, dp, mp, placed", [("llama3", 1, 1, "place"), ("mistral", 2, 4, "read"),
                                                  ("llama2", 1, 2, "read")])
def test_greedy_sampling_equals_hf_generate(hf_models, tmp_path, kind, dp, mp, placed):
    hf_model = hf_models[kind]
    cfg, params = ours_of(hf_model)
    layout = make_inference_layout(cfg, mesh=make_dp_mp(dp, mp))
    if placed == "place":
        fused = infer_params.place_params(params, layout)
    else:
        hf_model.save_pretrained(str(tmp_path / "hf"), safe_serialization=True)
        fused = infer_params.read_params(layout, str(tmp_path / "hf"))
    results = sampling.Sampler(layout, fused).generate(PROMPTS, 10, temperature=0.0, return_logprobs=True)
    tokens, logprobs = hf_greedy(hf_model, PROMPTS, 10)
    for row, result in enumerate(results):
        assert result.tokens == tokens[row].tolist()
        np.testing.assert_allclose(result.logprobs, logprobs[row], atol=1e-4)


# ---- config mistakes ----

def test_what_the_family_cannot_run_is_named(hf_models):
    raw = hf_models["mistral"].config.to_dict()
    with pytest.raises(ValueError, match="sliding-window attention"):
        hf.config_from_hf({**raw, "sliding_window": 16})
    with pytest.raises(ValueError, match="rope_type"):
        hf.config_from_hf({**raw, "rope_scaling": {"rope_type": "yarn", "factor": 2.0}, "rope_parameters": None})
    with pytest.raises(ConfigError, match="n_kv_heads"):
        config.from_dict({"family": "llama", "n_heads": 8, "d_model": 128, "n_kv_heads": 3, "cores_per_replica": 1})
    with pytest.raises(ConfigError, match="n_kv_heads.*cores_per_replica"):  # key heads split over model parallel
        config.from_dict({"family": "llama", "n_heads": 8, "d_model": 128, "n_kv_heads": 2, "cores_per_replica": 4})
    with pytest.raises(ConfigError, match="'n_kv_heads' belongs to the llama family"):
        config.from_dict({"n_kv_heads": 2, "n_heads": 8, "d_model": 128, "cores_per_replica": 1})


@pytest.mark.parametrize("kv_dtype", ["compute", "int8"])
def test_grouped_heads_through_both_tpu_kernels_on_dp2_mp4_give_one_devices_tokens(hf_models, kv_dtype):
    """The paged and the slot cache's TPU decode kernels (Pallas' TPU interpreter on the CPU) with 8 query heads over
    4 key heads split over mp 4 (a device: 2 query heads reading 1 key head) make the tokens the pure-JAX paths make
    on one device; with the compute dtype's cache, HF's greedy tokens."""
    from jax.experimental.pallas import tpu as pltpu

    from tests.infer.test_paged import greedy_programs

    hf_model = hf_models["mistral"]
    cfg, params = ours_of(hf_model, kv_cache_dtype=kv_dtype)
    prompts = PROMPTS + [[7]]
    runs = {}
    for name, mesh in (("xla", make_dp_mp(1, 1)), ("kernel", make_dp_mp(2, 4))):
        layout = make_inference_layout(cfg, mesh=mesh)
        kernels = {"paged_attention": "gather", "decode_attention": "xla"} if name == "xla" else {
            "paged_attention": "kernel", "decode_attention": "kernel"}
        layout = dataclasses.replace(layout, policy=dataclasses.replace(layout.policy, cache_bits=False, **kernels))
        with pltpu.force_tpu_interpret_mode():
            paged_tokens = greedy_programs(layout, infer_params.place_params(params, layout), prompts, 4, 2)
            slot = sampling.Sampler(layout, params).generate(prompts, 5, temperature=0.0, stop_token_ids=[])
        runs[name] = paged_tokens, np.array([r.tokens for r in slot])
    np.testing.assert_array_equal(runs["kernel"][0], runs["xla"][0])
    np.testing.assert_array_equal(runs["kernel"][1], runs["xla"][1])
    if kv_dtype == "compute":
        want, _ = hf_greedy(hf_model, prompts, 5)
        np.testing.assert_array_equal(runs["xla"][0], want)
        np.testing.assert_array_equal(runs["xla"][1], want)
