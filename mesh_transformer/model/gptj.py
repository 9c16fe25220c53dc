"""The transformer of every model family (model/family.py: GPT-J, GPT-NeoX) as pure functions of global arrays: the
one forward, embedding to head, that training, logits, prefill, decode and scoring run (`run`), and the training
loss.

Knows no mesh: a Layout (parallel/layout.py) runs these under shard_map (with a tensor-parallel axis name) or under
jit with shardings (with a `constrain` hook for activations). The param tree is model/table.py's.
"""
from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any, NamedTuple, Protocol

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from mesh_transformer.config import Config
from mesh_transformer.model import families, family, layers, lora, lora_slots, order, quant, rotary
from mesh_transformer.model.table import DTYPES
from mesh_transformer.platforms import Policy

HIDDEN_AXES = ("batch", "length", "embed")
LOGITS_AXES = ("batch", "length", "vocab")
# (x, logical axes) -> x placed as a parallelism mode wants; the GSPMD path passes one, the model never sees a mesh.
Constrain = Callable[[jax.Array, tuple[str, ...]], jax.Array]


def _unconstrained(x: jax.Array, logical_axes: tuple[str, ...]) -> jax.Array:
    return x


class Precision(NamedTuple):
    """The model's one mixed-precision policy (`precision`): `params` the trained params' master dtype, `frozen` a
    LoRA run's frozen base, `compute` the activations' and the matrix products', `weights` an inference model's
    layer matrices (the compute dtype, or int8 with f32 scales: model/quant.py), `int8_head` the LM head in int8
    too, `output` the logits' and the loss's."""
    params: np.dtype
    frozen: np.dtype
    compute: np.dtype
    weights: np.dtype
    int8_head: bool
    output: np.dtype

    @property
    def int8(self) -> bool:
        return self.weights == quant.INT8


def precision(cfg: Config, policy: Policy | None = None) -> Precision:
    """The config's dtypes, with compute_dtype "auto" what the platform policy says (bf16 where the matrix units
    are, f32 on CPU, where XLA's bf16 matmul is slower). A Layout's config has "auto" resolved for its devices
    already; with neither, "auto" is f32."""
    name = cfg.compute_dtype
    if name == "auto":
        name = policy.compute_dtype if policy is not None else "float32"
    compute = np.dtype(DTYPES[name])
    weights = np.dtype(quant.INT8) if cfg.weight_dtype == "int8" else compute
    # an int8 LoRA base holds its layers' matrices in int8 (model/lora.py), the rest of it in bf16
    frozen = np.dtype(DTYPES["bfloat16" if cfg.base_dtype == quant.INT8 else cfg.base_dtype])
    return Precision(np.dtype(np.float32), frozen, compute, weights, cfg.quantize_head,
                     np.dtype(np.float32))


def cast_for_compute(params: dict, cfg: Config) -> dict:
    """The params in the compute dtype, except the stacked layers: `run` casts one layer at a time inside its
    scan, so a base held in another dtype is never copied whole."""
    dtype = precision(cfg).compute
    return {k: v if k == "layers" else quant.cast({k: v}, dtype)[k] for k, v in params.items()}


class KV(Protocol):
    """How a cached forward treats each layer's keys and values (infer/decode.py): `read` gives the cached ones its
    queries also see, as `attention.attend`'s past (None: none), `write` puts the layer's new ones into its state.
    Both get the layer's input h (`read`, to order its reads after the layer before: `order.in_turn`) or output
    (`write`, to order the write after attention's reads of the cache)."""

    def read(self, state: Any, h_BxTxD: jax.Array) -> tuple | None: ...

    def write(self, state: Any, k_BxTxHxK: jax.Array, v_BxTxHxK: jax.Array, h_BxTxD: jax.Array) -> Any: ...


# (step, h, layers, states) -> (h, states): runs step(h, layer, state) -> (h, state) over the layers, where a layer
# is (its params, its adapters or None). `run` picks `scanned` for stacked layers and `unrolled` for a list; gradient
# accumulation passes its own (train/accumulate.py).
LayerLoop = Callable[[Callable, jax.Array, Any, Any], tuple[jax.Array, Any]]


# What remat keeps of a layer besides its input (config key remat_policy; `layers.block` names them): "save_qkv" the
# q, k and v products' outputs, "save_mlp_hidden" the MLP's hidden pre-activation (fc_in's output), so the backward
# recomputes the rest but not those products.
REMAT_POLICIES = {"full": None, "save_qkv": jax.checkpoint_policies.save_only_these_names("qkv"),
                  "save_mlp_hidden": jax.checkpoint_policies.save_only_these_names("mlp_hidden")}


def scanned(step: Callable, h_BxTxD: jax.Array, layers_: tuple, states: Any, *, remat: bool = False,
            remat_policy: str = "full"):
    """The layers (params and adapters) stacked on a leading axis, run by lax.scan (with remat: each layer's input
    saved, and what `remat_policy` names, the rest recomputed in the backward)."""
    if remat:
        step = jax.checkpoint(step, prevent_cse=False, policy=REMAT_POLICIES[remat_policy])
    return lax.scan(lambda h, xs: step(h, *xs), h_BxTxD, (layers_, states))


def unrolled(step: Callable, h_BxTxD: jax.Array, layers_: list, states: list | None, *, policy: Policy):
    """A list of per-layer trees, one after another in the program (inference: a scan would copy each layer's
    weights out of the stack at every token), each layer's weights tied to its input (`order.weights_in_turn`)."""
    states = [None] * len(layers_) if states is None else list(states)
    for i, layer in enumerate(layers_):
        h_BxTxD, states[i] = step(h_BxTxD, order.weights_in_turn(h_BxTxD, layer, policy), states[i])
    return h_BxTxD, states


def run(params: dict, ids_BxT: jax.Array, positions_BxT: jax.Array, cfg: Config, *, policy: Policy,
        tp_axis: str | None = None, mask_BxTxS: jax.Array | None = None, kv: KV | None = None, kv_states: Any = None,
        columns_BxC: jax.Array | None = None, head: Callable | None = None, constrain: Constrain | None = None,
        loop: LayerLoop | None = None, adapters: dict | None = None) -> tuple[Any, Any]:
    """The model's one forward, embedding to head, that training, logits, prefill, decode and scoring all run:
    returns the head's output and the layers' new KV states. What differs between them comes in as data and hooks:

    - `positions_BxT`: each token's rotary position; `mask_BxTxS`: which keys a query sees (None: causal);
    - `kv`, `kv_states`: a KV cache's per-layer reads and writes (`KV`), with each layer's state;
    - `columns_BxC`: the positions that reach the head (None: all);
    - `head(params, h_BxCxD)`: what the head computes (default `logits`: f32, this device's vocab columns);
    - `adapters`: LoRA adapters on the stacked layers (model/lora.py); for placed layers with adapter slots, each
      row's slot (`lora_slots.Rows`); or None;
    - `constrain`: pins activations between layers (GSPMD: under FSDP that makes XLA gather one layer's weights per
      scan iteration instead of splitting the activations like the weights); `loop`: how the layers run (default:
      `scanned` for stacked layers, `unrolled` for a list).

    The params may be stacked (training: each layer, adapters included, cast to the compute dtype as the scan
    reaches it) or placed for inference (infer/params.py: a list of layers, already in the compute dtype).
    """
    constrain = constrain or _unconstrained
    params = cast_for_compute(params, cfg)
    h_BxTxD = constrain(layers.embed(ids_BxT, params["embed"]["wte"], tp_axis), HIDDEN_AXES)
    arch = block_arch(cfg)
    sincos = rotary.rotary_sincos(positions_BxT, cfg.pe_rotary_dims, cfg.rotary_base, half=arch.rotary == "half",
                                  scaling=cfg.rope_scaling)
    dtype = precision(cfg).compute

    def step(h_BxTxD, layer_and_adapters, state):
        layer, layer_adapters = layer_and_adapters
        if isinstance(layer_adapters, lora_slots.Rows):  # served adapters: each row's slot (model/lora_slots.py)
            layer = {**quant.cast(layer, dtype), "lora_rows": layer_adapters}
        else:
            # an int8 base's matrices multiply as int8 x scale (model/lora.py)
            layer = lora.adapt_layer(*quant.cast((lora.dequantized(layer), layer_adapters), dtype),
                                     lora.scale(cfg))
        past = None if kv is None else kv.read(state, h_BxTxD)
        h_BxTxD, (k, v) = layers.block(h_BxTxD, layer, cfg.head_dim, sincos, arch=arch, mask_BxTxT=mask_BxTxS,
                                       tp_axis=tp_axis, past=past, join=cfg.join_projections, policy=policy)
        return constrain(h_BxTxD, HIDDEN_AXES), (state if kv is None else kv.write(state, k, v, h_BxTxD))

    stacked = not isinstance(params["layers"], list)
    if loop is None:
        loop = (partial(scanned, remat=cfg.remat, remat_policy=cfg.remat_policy) if stacked
                else partial(unrolled, policy=policy))
    layers_ = (params["layers"], adapters) if stacked else [(layer, adapters) for layer in params["layers"]]
    h_BxTxD, kv_states = loop(step, h_BxTxD, layers_, kv_states)
    if columns_BxC is not None:
        h_BxTxD = jnp.take_along_axis(h_BxTxD, columns_BxC[..., None], axis=1)
    return (head or logits)(params, h_BxTxD), kv_states


def block_arch(cfg: Config) -> family.Block:
    """What the config's family's block does (model/family.py), with the config's own choices filled in."""
    family_ = families.of(cfg)
    parallel = cfg.parallel_residual if "parallel_residual" in family_.config_keys else family_.block.parallel
    return family_.block._replace(parallel=parallel, heads=cfg.n_heads, kv_heads=cfg.kv_heads)


def logits(params: dict, h_BxTxD: jax.Array) -> jax.Array:
    """The default head: final LayerNorm and the LM head, logits [B, T, V] in f32 (this device's vocab columns)."""
    return layers.head(h_BxTxD, params["ln_f"], params["lm_head"])


def positions(ids_BxT: jax.Array) -> jax.Array:
    """Rotary positions [1, T] of rows that start at position 0."""
    return jnp.arange(ids_BxT.shape[1])[None]


def forward(params: dict, ids_BxT: jax.Array, cfg: Config, tp_axis: str | None = None,
            constrain: Constrain | None = None, *, policy: Policy, adapters: dict | None = None) -> jax.Array:
    """Logits [B, T, V] in f32 (this device's vocab columns under tensor parallelism), of the model with these LoRA
    adapters, if any."""
    out, _ = run(params, ids_BxT, positions(ids_BxT), cfg, policy=policy, tp_axis=tp_axis, constrain=constrain,
                 adapters=adapters)
    return (constrain or _unconstrained)(out, LOGITS_AXES)


def loss_fn(params: dict, tokens_BxT1: jax.Array, cfg: Config, tp_axis: str | None = None,
            dp_axis: str | None = None, constrain: Constrain | None = None, *, policy: Policy,
            adapters: dict | None = None, loop: LayerLoop | None = None) -> jax.Array:
    """Mean next-token cross entropy of a [B, T+1] token batch (inputs [:-1], targets [1:]) of the model with these
    adapters, if any; `loop`: see `run`."""
    ids_BxT, targets_BxT = tokens_BxT1[:, :-1], tokens_BxT1[:, 1:]
    pin_logits = None if constrain is None else (lambda logits_BxTxV: constrain(logits_BxTxV, LOGITS_AXES))

    def cross_entropy(params, h_BxTxD):
        return layers.head_cross_entropy(h_BxTxD, params["ln_f"], params["lm_head"], targets_BxT, tp_axis,
                                         pin_logits)

    ce_BxT, _ = run(params, ids_BxT, positions(ids_BxT), cfg, policy=policy, tp_axis=tp_axis, head=cross_entropy,
                    constrain=constrain, loop=loop, adapters=adapters)
    loss = ce_BxT.mean()
    return loss if dp_axis is None else lax.pmean(loss, dp_axis)
