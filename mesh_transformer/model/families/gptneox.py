"""GPT-NeoX (EleutherAI's Pythia suite and GPT-NeoX-20B; HF `GPTNeoXForCausalLM`): a LayerNorm before attention and
another before the MLP, read side by side (`parallel_residual`, Pythia's and NeoX-20B's) or one after the other;
rotary by halves on `pe_rotary_dims` (HF's rotary_pct of each head) with its own base; biases on every projection;
q, k and v held in one HF tensor per layer; an untied output embedding without a bias."""
from __future__ import annotations

from collections.abc import Mapping

from mesh_transformer.model.family import Block, Family, Param

_QKV, _STACKED = ("layers", "embed", "heads"), ("layers", "embed")
PARAMS = {
    ("embed", "wte"): Param(("vocab", "embed"), "gpt_neox.embed_in.weight", False, "vocab", True),
    ("layers", "ln_1", "scale"): Param(_STACKED, "input_layernorm.weight", False, "ones", False),
    ("layers", "ln_1", "bias"): Param(_STACKED, "input_layernorm.bias", False, "zeros", False),
    ("layers", "ln_2", "scale"): Param(_STACKED, "post_attention_layernorm.weight", False, "ones", False),
    ("layers", "ln_2", "bias"): Param(_STACKED, "post_attention_layernorm.bias", False, "zeros", False),
    **{("layers", "attn", name): Param(_QKV, "attention.query_key_value.weight", True, "fan_in", True, name, hf_part=i)
       for i, name in enumerate("qkv")},
    **{("layers", "attn", f"{name}_bias"): Param(("layers", "heads"), "attention.query_key_value.bias", False,
                                                 "zeros", False, hf_part=i) for i, name in enumerate("qkv")},
    ("layers", "attn", "out"): Param(("layers", "heads", "embed"), "attention.dense.weight", True, "residual", True,
                                     "out"),
    ("layers", "attn", "out_bias"): Param(_STACKED, "attention.dense.bias", False, "zeros", False),
    ("layers", "mlp", "fc_in", "kernel"): Param(("layers", "embed", "mlp"), "mlp.dense_h_to_4h.weight", True,
                                                "fan_in", True, "fc_in"),
    ("layers", "mlp", "fc_in", "bias"): Param(("layers", "mlp"), "mlp.dense_h_to_4h.bias", False, "zeros", False),
    ("layers", "mlp", "fc_out", "kernel"): Param(("layers", "mlp", "embed"), "mlp.dense_4h_to_h.weight", True,
                                                 "residual", True, "fc_out"),
    ("layers", "mlp", "fc_out", "bias"): Param(_STACKED, "mlp.dense_4h_to_h.bias", False, "zeros", False),
    ("ln_f", "scale"): Param(("embed",), "gpt_neox.final_layer_norm.weight", False, "ones", False),
    ("ln_f", "bias"): Param(("embed",), "gpt_neox.final_layer_norm.bias", False, "zeros", False),
    ("lm_head", "kernel"): Param(("embed", "vocab"), "embed_out.weight", True, "fan_in", True),
}


def _rope(hf: Mapping) -> tuple[float, float]:
    """(rotary fraction of a head, base) from either generation of HF's config keys."""
    rope = hf.get("rope_parameters") or {}
    pct = rope.get("partial_rotary_factor", hf.get("rotary_pct", hf.get("partial_rotary_factor", 1.0)))
    base = rope.get("rope_theta", hf.get("rotary_emb_base", hf.get("rope_theta", 10000.0)))
    if rope.get("rope_type", "default") != "default" or hf.get("rope_scaling"):
        raise ValueError("only GPT-NeoX models with the default rotary embedding (no rope scaling) are supported")
    return pct, base


def config_from_hf(hf: Mapping) -> dict:
    d, heads = hf["hidden_size"], hf["num_attention_heads"]
    unsupported = {"hidden_act": (hf.get("hidden_act", "gelu"), "gelu"),
                   "intermediate_size": (hf.get("intermediate_size", 4 * d), 4 * d),
                   "layer_norm_eps": (hf.get("layer_norm_eps", 1e-5), 1e-5),
                   "attention_bias": (hf.get("attention_bias", True), True),
                   "tie_word_embeddings": (hf.get("tie_word_embeddings", False), False)}
    for key, (value, want) in unsupported.items():
        if value != want:
            raise ValueError(f"only GPT-NeoX models with {key} = {want!r} are supported, this one has {value!r}")
    pct, base = _rope(hf)
    return {"layers": hf["num_hidden_layers"], "d_model": d, "n_heads": heads, "n_vocab": hf["vocab_size"],
            "pe_rotary_dims": int(d // heads * pct), "rotary_base": float(base),
            "seq": hf.get("max_position_embeddings", 2048),
            "parallel_residual": bool(hf.get("use_parallel_residual", True))}


def hf_config(cfg) -> dict:
    return {"architectures": ["GPTNeoXForCausalLM"], "model_type": "gpt_neox", "vocab_size": cfg.n_vocab,
            "hidden_size": cfg.d_model, "num_hidden_layers": cfg.layers, "num_attention_heads": cfg.n_heads,
            "intermediate_size": cfg.d_ff, "hidden_act": "gelu", "max_position_embeddings": cfg.seq,
            "rotary_pct": cfg.pe_rotary_dims / cfg.head_dim, "rotary_emb_base": cfg.rotary_base,
            "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rotary_base,
                                "partial_rotary_factor": cfg.pe_rotary_dims / cfg.head_dim},
            "layer_norm_eps": 1e-5, "use_parallel_residual": cfg.parallel_residual, "attention_bias": True,
            "tie_word_embeddings": False, "initializer_range": 0.02, "attention_dropout": 0.0,
            "hidden_dropout": 0.0, "bos_token_id": 0, "eos_token_id": 0, "use_cache": True}


# transformers 5 holds the output embedding as lm_head.weight; the Hub's checkpoints and earlier versions, embed_out
FAMILY = Family("gptneox", PARAMS, Block(rotary="half", gelu_tanh=False), "gpt_neox", "gpt_neox.layers",
                 config_from_hf, hf_config, config_keys=("parallel_residual", "rotary_base"),
                 own_tokenizer=True, hf_aliases={"embed_out.weight": ("lm_head.weight",)}, eos_id=0)
