"""GPT-J (EleutherAI's GPT-J-6B; HF `GPTJForCausalLM`): one LayerNorm read by attention and the MLP side by side,
interleaved rotary on the first `pe_rotary_dims` of each head, no biases on q, k, v and attn out, GELU by tanh."""
from __future__ import annotations

from collections.abc import Mapping

from mesh_transformer.model.family import Block, Family, Param

GPT2_EOS = 50256

_QKV, _STACKED = ("layers", "embed", "heads"), ("layers", "embed")
PARAMS = {
    ("embed", "wte"): Param(("vocab", "embed"), "transformer.wte.weight", False, "vocab", True),
    ("layers", "ln_1", "scale"): Param(_STACKED, "ln_1.weight", False, "ones", False),
    ("layers", "ln_1", "bias"): Param(_STACKED, "ln_1.bias", False, "zeros", False),
    ("layers", "attn", "q"): Param(_QKV, "attn.q_proj.weight", True, "fan_in", True, "q"),
    ("layers", "attn", "k"): Param(_QKV, "attn.k_proj.weight", True, "fan_in", True, "k"),
    ("layers", "attn", "v"): Param(_QKV, "attn.v_proj.weight", True, "fan_in", True, "v"),
    ("layers", "attn", "out"): Param(("layers", "heads", "embed"), "attn.out_proj.weight", True, "residual", True,
                                     "out"),
    ("layers", "mlp", "fc_in", "kernel"): Param(("layers", "embed", "mlp"), "mlp.fc_in.weight", True, "fan_in", True,
                                                "fc_in"),
    ("layers", "mlp", "fc_in", "bias"): Param(("layers", "mlp"), "mlp.fc_in.bias", False, "zeros", False),
    ("layers", "mlp", "fc_out", "kernel"): Param(("layers", "mlp", "embed"), "mlp.fc_out.weight", True, "residual",
                                                 True, "fc_out"),
    ("layers", "mlp", "fc_out", "bias"): Param(_STACKED, "mlp.fc_out.bias", False, "zeros", False),
    ("ln_f", "scale"): Param(("embed",), "transformer.ln_f.weight", False, "ones", False),
    ("ln_f", "bias"): Param(("embed",), "transformer.ln_f.bias", False, "zeros", False),
    ("lm_head", "kernel"): Param(("embed", "vocab"), "lm_head.weight", True, "fan_in", True),
    ("lm_head", "bias"): Param(("vocab",), "lm_head.bias", False, "zeros", False),
}


def config_from_hf(hf: Mapping) -> dict:
    if hf.get("activation_function", "gelu_new") != "gelu_new" or hf.get("n_inner") not in (None, 4 * hf["n_embd"]):
        raise ValueError("only GPT-J models with gelu_new and n_inner = 4 * n_embd are supported")
    return {"layers": hf["n_layer"], "d_model": hf["n_embd"], "n_heads": hf["n_head"], "n_vocab": hf["vocab_size"],
            "pe_rotary_dims": hf.get("rotary_dim") or hf["n_embd"] // hf["n_head"], "seq": hf["n_positions"]}


def hf_config(cfg) -> dict:
    return {"architectures": ["GPTJForCausalLM"], "model_type": "gptj", "vocab_size": cfg.n_vocab,
            "n_positions": cfg.seq, "n_embd": cfg.d_model, "n_layer": cfg.layers, "n_head": cfg.n_heads,
            "rotary_dim": cfg.pe_rotary_dims, "n_inner": None, "activation_function": "gelu_new",
            "layer_norm_epsilon": 1e-5, "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0,
            "initializer_range": 0.02, "tie_word_embeddings": False, "bos_token_id": GPT2_EOS,
            "eos_token_id": GPT2_EOS, "use_cache": True}


FAMILY = Family("gptj", PARAMS, Block(rotary="interleaved", gelu_tanh=True), "gptj", "transformer.h",
                 config_from_hf, hf_config)
