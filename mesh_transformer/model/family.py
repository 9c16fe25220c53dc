"""What a model family declares, in a module of its own under model/families/ (whose package is the registry the rest
of the package reads it from). Nothing outside the families names one; a config selects its family with the key
`family`.

A family declares its param table (`Param` rows: logical axes, HF names, init, weight decay, LoRA targets), what
its block does differently (`Block`), how its config maps to and from an HF config.json, and its HF names' layout.
model/ runs any family's table and block; parallel/ places its params by their logical axes; train/, infer/,
serve/ and store/ read the table. docs/porting.md says how to add one.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

Path = tuple[str, ...]  # a param's keys from the root of the tree, e.g. ("layers", "attn", "q")


class Param(NamedTuple):
    """One param's row of a family's table."""
    axes: tuple[str, ...]  # logical axes; "layers" (L) first for the stacked layers, "heads" is the H*K width
    hf: str  # its name in the family's HF state dict (inside the family's `hf_layers`.{i} for a layer's)
    transposed: bool  # HF holds it transposed (a torch Linear weight is [out, in])
    init: str  # "ones", "zeros", or the original's truncated-normal scale: "fan_in" 1/sqrt(D), "vocab" 1/sqrt(V),
    # "residual" (2/L)/sqrt(D) for the projections that write into the residual stream
    decayed: bool  # weight decay applies (weight matrices; never biases or LayerNorm params)
    lora: str | None = None  # the LoRA target that adapts it (config.LORA_TARGETS), if any
    hf_part: int | None = None  # HF holds q, k and v in one tensor, heads outermost ([H, 3, K] on its output
    # axis): which of the three this is


class Block(NamedTuple):
    """What a family's transformer block does, beyond the param table (which says whether it has a second
    LayerNorm "ln_2" before the MLP, biases on q, k, v and attn out, and whether its norms are LayerNorms, with a
    bias, or RMSNorms, a scale alone)."""
    rotary: str  # "interleaved": rotate pairs (0, 1), (2, 3), ... (GPT-J); "half": dims i and i + P/2 (GPT-NeoX)
    gelu_tanh: bool  # the MLP's GELU: tanh's approximation (GPT-J's gelu_new) or exact (erf)
    parallel: bool = True  # attention and the MLP read the block's input side by side (the config's
    # parallel_residual where the family has that key, filled in by `gptj.block_arch`), else the MLP reads
    # attention's output
    mlp: str = "gelu"  # "gelu"; "swiglu": silu(x @ gate) * (x @ fc_in), then fc_out (Llama's)
    heads: int = 0  # query heads and key/value heads (grouped-query attention where fewer), filled in by
    kv_heads: int = 0  # `gptj.block_arch` from the config


class Family(NamedTuple):
    name: str  # the config's `family`
    params: dict[Path, Param]  # the param tree, one row per param
    block: Block
    hf_model_type: str  # config.json's model_type
    hf_layers: str  # the prefix of layer i's HF names, before ".{i}."
    config_from_hf: Callable[[Mapping], dict]  # an HF config.json -> our config keys (shape and block keys)
    hf_config: Callable[[Any], dict]  # our Config -> an HF config.json
    config_keys: tuple[str, ...] = ()  # the config keys of the family's own, beside every family's
    own_tokenizer: bool = False  # an HF directory of the family carries the tokenizer it is read with (else GPT-2's
    # BPE, the config's default)
    hf_aliases: Mapping[str, tuple[str, ...]] = {}  # an HF name -> other names a checkpoint may hold it under
    # (what another transformers version writes); the table's name is the one written
    hf_also_reads: tuple[str, ...] = ()  # other model_types whose HF directories have this family's layout
    eos_id: int = 50256  # its tokenizer's end of text: where a token-level API stops when not told (GPT-2's BPE's)
