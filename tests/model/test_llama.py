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
from tests.helpers import (CPU_POLICY, hf_greedy, hf_logits, int8_base, layout_of, our_logits, ours_of, random_params,
                           state_dict_numpy)

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

# mp 8 and tensor 8 over 4 key heads: each device holds them whole (`layout.kv_replicated`)
SHARDED = [("shard_map", 2, 4), ("shard_map", 4, 2), ("shard_map", 1, 8), ("fsdp", 1, 8, 1), ("fsdp_tp", 2, 2, 2),
           ("tp", 1, 1, 8)]


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


@pytest.mark.parametrize("base_dtype", ["float32", "int8"])
def test_lora_with_key_heads_held_whole_equals_one_device(reference, base_dtype):
    """LoRA on all seven projections at mp 8 over 4 key heads (k and v and their adapters held whole on every
    device), over a float base and an int8 one: the loss and the adapters' gradients of one device."""
    from mesh_transformer.model import lora
    from mesh_transformer.model.split import LORA
    from mesh_transformer.train import state as state_lib

    cfg, params, tokens, *_ = reference
    cfg = dataclasses.replace(cfg, lora_rank=4, lora_alpha=8, base_dtype=base_dtype)
    adapters = lora.init_lora(cfg, jax.random.PRNGKey(4))
    adapters = {t: {"a": ab["a"], "b": ab["b"] + 0.05} for t, ab in adapters.items()}  # B nonzero: A learns too
    base = int8_base(cfg, params)[0] if base_dtype == "int8" else params

    def loss_and_grads(spec):
        layout = layout_of(cfg, spec)
        placed = jax.device_put(base, state_lib.frozen_shardings(layout))
        trained = jax.device_put(adapters, layout.shardings(LORA.trainable_axes(cfg)))
        return jax.jit(layout.loss_and_grad_fn(LORA))(trained, placed, tokens)

    (ref_loss, ref_grads), (loss, grads) = loss_and_grads(("shard_map", 1, 1)), loss_and_grads(("shard_map", 1, 8))
    assert set(grads) == {"q", "k", "v", "out", "gate", "fc_in", "fc_out"}
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)
    for got, want in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads)):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-6)


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
    with pytest.raises(ConfigError, match="n_kv_heads.*cores_per_replica"):  # neither split nor held whole
        config.from_dict({"family": "llama", "n_heads": 12, "d_model": 192, "n_kv_heads": 3, "cores_per_replica": 4})
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


def test_int8_weights_with_a_gated_mlp_agree_with_f32_and_split_as_on_one_device(hf_models):
    """int8 weights (the gate its own scale group, joined between v and fc_in): the prefill's logits close to f32's
    and most top-1 choices the same; on dp 2 x mp 2 the tokens of one device."""
    from mesh_transformer.infer import decode

    cfg, params = ours_of(hf_models["llama3"])
    int8 = dataclasses.replace(cfg, weight_dtype="int8", compute_dtype="float32")
    ids = np.random.default_rng(4).integers(0, cfg.n_vocab, (32, 12)).astype(np.int32)

    def prefill(c):
        layout = make_inference_layout(c, mesh=make_dp_mp(1, 1))
        placed = infer_params.place_params(params, layout)
        shape, dtype = decode.block_shape(len(ids), c.seq, c, layout.policy), decode.cache_dtype(c, layout.policy)
        block = jax.numpy.zeros(shape, dtype)
        cache = decode.KVCache(*([[block] for _ in range(c.layers)] for _ in range(2)))
        run = jax.jit(lambda p, k: decode.prefill_logits(p, k, ids, np.full(len(ids), 12, np.int32),
                                                         np.arange(len(ids), dtype=np.int32), c, policy=layout.policy))
        return placed, np.asarray(run(placed, cache)[0])

    _, ref = prefill(cfg)
    placed, ours = prefill(int8)
    assert placed["layers"][0]["fused"]["in"].dtype == np.int8
    np.testing.assert_allclose(ref, hf_logits(hf_models["llama3"], ids)[:, -1], atol=1e-4)
    assert 0 < np.sqrt(np.mean((ours - ref) ** 2)) / ref.std() < 0.05
    assert np.mean(ours.argmax(-1) == ref.argmax(-1)) >= 0.9
    one = sampling.Sampler(make_inference_layout(int8, mesh=make_dp_mp(1, 1)), params)
    split = sampling.Sampler(make_inference_layout(int8, mesh=make_dp_mp(2, 2)), params)
    for a, b in zip(split.generate(PROMPTS, 6, temperature=0.0), one.generate(PROMPTS, 6, temperature=0.0)):
        assert a.tokens == b.tokens


# ---- LoRA: PEFT adapters on all seven projections ----

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def test_peft_adapters_on_every_projection_read_merged_served_and_written_as_peft(hf_models, tmp_path):
    """PEFT's own adapters on q, k, v, o, gate, up and down of a grouped-query Llama: merged at load they give PEFT's
    logits; two of them (ranks 4 and 8) served from adapter slots beside the base give each PEFT model's greedy tokens
    and log-probs in one batch; and our adapters written as a PEFT directory load in PEFT with our logits."""
    from peft import LoraConfig, PeftModel, get_peft_model

    from mesh_transformer.infer import adapter_slots
    from mesh_transformer.model import lora
    from mesh_transformer.store import adapters, convert, peft
    from mesh_transformer.model import table
    from tests.helpers import served_greedy

    base_dir = str(tmp_path / "base")
    hf_models["mistral"].save_pretrained(base_dir, safe_serialization=True)
    cfg, base = ours_of(hf_models["mistral"])
    peft_models = []
    for slot, rank in enumerate((4, 8)):
        torch.manual_seed(slot)
        peft_model = get_peft_model(MistralForCausalLM.from_pretrained(base_dir), LoraConfig(
            r=rank, lora_alpha=2 * rank, target_modules=TARGETS, init_lora_weights=False, lora_dropout=0.0)).eval()
        peft_model.save_pretrained(str(tmp_path / f"a{slot}"))
        peft_models.append(peft_model)
    ids = np.random.default_rng(5).integers(0, cfg.n_vocab, (2, 16))
    with convert.open_params(base_dir, cfg, lora=str(tmp_path / "a0")) as reader:
        merged = {}
        for path, like in table.param_paths(cfg):
            table.set_path(merged, path, convert.read_array(reader, path, like.shape))
    np.testing.assert_allclose(our_logits(merged, ids, cfg), hf_logits(peft_models[0], ids), atol=1e-4)

    served_cfg = dataclasses.replace(cfg, max_loras=2, max_lora_rank=8)
    layout = make_inference_layout(served_cfg, jax.devices()[:1], mp=1)
    params = adapter_slots.with_slots(infer_params.place_params(base, layout), layout)
    writer = adapter_slots.SlotWriter(layout)
    for slot in range(2):
        params = writer.write(params, slot, *adapters.read_adapters(str(tmp_path / f"a{slot}"), served_cfg))
    prompts = [[5, 17, 42, 9], [100, 3, 7], [1, 2, 3, 4, 5]]
    tokens, logprobs = served_greedy(layout, params, prompts, np.array([-1, 0, 1]), steps=4)
    for prompt, row_tokens, row_logprobs, hf_model in zip(prompts, tokens, logprobs, [hf_models["mistral"],
                                                                                        *peft_models]):
        logp = torch.log_softmax(torch.tensor(hf_logits(hf_model, np.array([prompt + list(row_tokens)]))[0]),
                                 -1).numpy()
        positions = range(len(prompt) - 1, len(prompt) - 1 + len(row_tokens))
        assert list(row_tokens) == [int(logp[p].argmax()) for p in positions]
        np.testing.assert_allclose(row_logprobs, [logp[p, t] for p, t in zip(positions, row_tokens)], atol=1e-4)

    ranked = dataclasses.replace(cfg, lora_rank=4, lora_alpha=8.0)
    rng = np.random.default_rng(6)
    ours = jax.tree.map(lambda s: (rng.normal(size=s.shape) * 0.1).astype(np.float32), lora.lora_shapes(ranked))
    assert set(ours) == {"q", "k", "v", "out", "gate", "fc_in", "fc_out"}
    peft.write_peft(str(tmp_path / "ours"), ours, ranked, 4, 8.0)
    loaded = PeftModel.from_pretrained(MistralForCausalLM.from_pretrained(base_dir), str(tmp_path / "ours")).eval()
    forward = jax.jit(lambda p, x, a: model.forward(p, x, ranked, policy=CPU_POLICY, adapters=a))
    np.testing.assert_allclose(np.asarray(forward(base, ids, ours)), hf_logits(loaded, ids), atol=1e-4)
