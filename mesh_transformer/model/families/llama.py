"""Llama (HF `LlamaForCausalLM`: Llama 2, Llama 3, 3.1, 3.2; and `MistralForCausalLM` without a sliding window, or
one at least the context): an RMSNorm before attention and another before the MLP, one after the other; rotary by
halves on the whole head with its base (`rope_theta`) and HF's rope scaling ("llama3", "linear"); grouped-query
attention (`n_kv_heads`); a SwiGLU MLP (silu(x @ gate) * (x @ up), then down) of `intermediate_size`; no biases; the
output embedding untied, or tied to the input's (read from it; written untied)."""
from __future__ import annotations

from collections.abc import Mapping

from mesh_transformer.model.family import Block, Family, Param

_STACKED = ("layers", "embed")
PARAMS = {
    ("embed", "wte"): Param(("vocab", "embed"), "model.embed_tokens.weight", False, "vocab", True),
    ("layers", "ln_1", "scale"): Param(_STACKED, "input_layernorm.weight", False, "ones", False),
    ("layers", "ln_2", "scale"): Param(_STACKED, "post_attention_layernorm.weight", False, "ones", False),
    ("layers", "attn", "q"): Param(("layers", "embed", "heads"), "self_attn.q_proj.weight", True, "fan_in", True, "q"),
    ("layers", "attn", "k"): Param(("layers", "embed", "kv_heads"), "self_attn.k_proj.weight", True, "fan_in", True,
                                   "k"),
    ("layers", "attn", "v"): Param(("layers", "embed", "kv_heads"), "self_attn.v_proj.weight", True, "fan_in", True,
                                   "v"),
    ("layers", "attn", "out"): Param(("layers", "heads", "embed"), "self_attn.o_proj.weight", True, "residual", True,
                                     "out"),
    ("layers", "mlp", "gate", "kernel"): Param(("layers", "embed", "mlp"), "mlp.gate_proj.weight", True, "fan_in",
                                               True, "gate"),
    ("layers", "mlp", "fc_in", "kernel"): Param(("layers", "embed", "mlp"), "mlp.up_proj.weight", True, "fan_in", True,
                                                "fc_in"),
    ("layers", "mlp", "fc_out", "kernel"): Param(("layers", "mlp", "embed"), "mlp.down_proj.weight", True, "residual",
                                                 True, "fc_out"),
    ("ln_f", "scale"): Param(("embed",), "model.norm.weight", False, "ones", False),
    ("lm_head", "kernel"): Param(("embed", "vocab"), "lm_head.weight", True, "fan_in", True),
}
ROPE_TYPES = ("default", "llama3", "linear")


def _rope(hf: Mapping) -> tuple[float, dict | None]:
    """(base, scaling or None) from either generation of HF's config keys (transformers 5's `rope_parameters`)."""
    rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    base = float(rope.pop("rope_theta", hf.get("rope_theta", 10000.0)))
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind not in ROPE_TYPES:
        raise ValueError(f"only Llama models with rope_type {', '.join(ROPE_TYPES)} are supported, this one has "
                         f"{kind!r}")
    if kind == "default":
        return base, None
    keys = ("factor",) if kind == "linear" else ("factor", "low_freq_factor", "high_freq_factor",
                                                  "original_max_position_embeddings")
    return base, {"rope_type": kind, **{key: rope[key] for key in keys}}


def config_from_hf(hf: Mapping) -> dict:
    d, heads = hf["hidden_size"], hf["num_attention_heads"]
    seq = hf.get("max_position_embeddings", 2048)
    window = hf.get("sliding_window")
    unsupported = {"hidden_act": (hf.get("hidden_act", "silu"), "silu"),
                   "rms_norm_eps": (hf.get("rms_norm_eps", 1e-5), 1e-5),
                   "attention_bias": (hf.get("attention_bias", False), False),
                   "mlp_bias": (hf.get("mlp_bias", False), False),
                   "head_dim": (hf.get("head_dim") or d // heads, d // heads),
                   "pretraining_tp": (hf.get("pretraining_tp", 1), 1)}
    for key, (value, want) in unsupported.items():
        if value != want:
            raise ValueError(f"only Llama models with {key} = {want!r} are supported, this one has {value!r}")
    if window is not None and window < seq:
        raise ValueError(f"sliding-window attention (sliding_window {window} under the context {seq}) is not "
                         f"supported; set max_position_embeddings to at most {window}")
    base, scaling = _rope(hf)
    return {"layers": hf["num_hidden_layers"], "d_model": d, "n_heads": heads,
            "n_kv_heads": hf.get("num_key_value_heads") or heads, "n_vocab": hf["vocab_size"],
            "intermediate_size": hf["intermediate_size"], "pe_rotary_dims": d // heads, "rotary_base": base,
            "rope_scaling": scaling, "seq": seq}


def hf_config(cfg) -> dict:
    rope = {"rope_type": "default", **(cfg.rope_scaling or {}), "rope_theta": cfg.rotary_base}
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": cfg.n_vocab,
            "hidden_size": cfg.d_model, "num_hidden_layers": cfg.layers, "num_attention_heads": cfg.n_heads,
            "num_key_value_heads": cfg.kv_heads, "intermediate_size": cfg.d_ff, "hidden_act": "silu",
            "max_position_embeddings": cfg.seq, "rms_norm_eps": 1e-5, "rope_theta": cfg.rotary_base,
            "rope_scaling": cfg.rope_scaling, "rope_parameters": rope, "attention_bias": False, "mlp_bias": False,
            "tie_word_embeddings": False, "initializer_range": 0.02, "attention_dropout": 0.0, "bos_token_id": 1,
            "eos_token_id": 2, "use_cache": True, "pretraining_tp": 1}


FAMILY = Family("llama", PARAMS, Block(rotary="half", gelu_tanh=False, parallel=False, mlp="swiglu"), "llama",
                "model.layers", config_from_hf, hf_config,
                config_keys=("rotary_base", "n_kv_heads", "intermediate_size", "rope_scaling"), own_tokenizer=True,
                hf_aliases={"lm_head.weight": ("model.embed_tokens.weight",)}, hf_also_reads=("mistral",),
                eos_id=2)
