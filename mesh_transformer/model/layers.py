"""The transformer's layers as pure functions over param dicts, for every model family (model/family.py).

Each layer is written once. With `tp_axis=None` it is the plain global computation; with the name of a
tensor-parallel mesh axis it runs inside `jax.shard_map` on this device's slice of the heads, the MLP and the
vocabulary, and does the reductions itself.

The package's one shape-letter legend (tensor names carry their shapes, letters joined by x: `q_BxTxHxK`):
B batch, T / S query / key length, D model width, H heads, K head dim, F MLP width, V vocab (H, F and V: this
device's share under tensor parallelism), L layers, R rows computed in a step, N cache slots, G micro-batches,
P rotary dims (P2 = P / 2), r LoRA rank.
"""
from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.ad_checkpoint import checkpoint_name

from mesh_transformer.model import lora_slots, order, quant, quant_kernel
from mesh_transformer.model.attention import attend, causal_mask, self_attention
from mesh_transformer.model.rotary import apply_rotary
from mesh_transformer.platforms import Policy

LN_EPS = 1e-5
F32 = jnp.float32


def lead(v: jax.Array, ndim: int) -> jax.Array:
    """v with leading axes of size 1 up to `ndim` axes: a [D] bias or scale lined up with a [B, T, D] array (the
    tests raise on implicit rank promotion)."""
    return jnp.expand_dims(v, tuple(range(ndim - v.ndim)))


def layer_norm(x_BxTxD: jax.Array, p: dict) -> jax.Array:
    """LayerNorm in f32, returned in the input's dtype; a norm without a bias is an RMSNorm (Llama's: x / rms(x) x
    scale, where HF rounds the normalized x to the input's dtype before the scale)."""
    x = x_BxTxD.astype(F32)
    if "bias" not in p:
        y = (x * lax.rsqrt(jnp.square(x).mean(-1, keepdims=True) + LN_EPS)).astype(x_BxTxD.dtype)
        return (lead(p["scale"], x.ndim) * y).astype(x_BxTxD.dtype)
    mean = x.mean(-1, keepdims=True)
    var = jnp.square(x - mean).mean(-1, keepdims=True)
    scale, bias = (lead(p[k].astype(F32), x.ndim) for k in ("scale", "bias"))
    y = (x - mean) * lax.rsqrt(var + LN_EPS) * scale + bias
    return y.astype(x_BxTxD.dtype)


def dense(x: jax.Array, w, policy: Policy) -> jax.Array:
    """x @ w, differentiated as the policy says (`_matmul`'s backward on CPU, autodiff elsewhere); a LoRA-adapted
    weight (model/lora.py's `Adapted`, a callable) adds its low-rank path itself."""
    if callable(w):
        return w(x)
    return _matmul(*_same_varying_axes(x, w)) if policy.dense_backward == "ordered" else x @ w


@jax.custom_vjp
def _matmul(x: jax.Array, w_DxF: jax.Array) -> jax.Array:
    """x @ w with a hand-written backward: the weight's gradient as x^T dy, or as (dy^T x)^T where x is the wider.
    XLA's CPU backend transposes the left side of such a product into a copy; JAX's own transpose of x @ w always
    computes (dy^T x)^T, so XLA would copy dy (for fc_in the wider side) and run a slower product. Forward +
    backward on a 2-core CPU at 1024 tokens, against autodiff's: a [512, 2048] projection 0.65 of the time,
    [512, 512] 0.66, [2048, 512] 0.93; the whole model 0.97 (bench/bench_model.py). The CPU policy's dense backward.
    """
    return x @ w_DxF


def _matmul_fwd(x, w_DxF):
    return x @ w_DxF, (x, w_DxF)


def _matmul_bwd(residuals, dy):
    x, w_DxF = residuals
    leading = tuple(range(x.ndim - 1))
    if x.shape[-1] <= dy.shape[-1]:
        d_w = jnp.tensordot(x, dy, (leading, leading))
    else:
        d_w = jnp.tensordot(dy, x, (leading, leading)).T
    return dy @ w_DxF.T, d_w


_matmul.defvjp(_matmul_fwd, _matmul_bwd)


def _attention(q_BxTxHxK, k_BxTxHxK, v_BxTxHxK, mask_BxTxT, past, causal) -> jax.Array:
    """`causal` attention when the mask is None and there is no cache; else `attend` (the block cache), or a
    cache's own attention where `past` is one (a callable of q, k, v: `infer/paged.py`'s kernel)."""
    if callable(past):
        return past(q_BxTxHxK, k_BxTxHxK, v_BxTxHxK)
    if mask_BxTxT is None and past is None:
        return causal(q_BxTxHxK, k_BxTxHxK, v_BxTxHxK)
    mask_BxTxT = causal_mask(q_BxTxHxK.shape[1]) if mask_BxTxT is None else mask_BxTxT
    return attend(q_BxTxHxK, k_BxTxHxK, v_BxTxHxK, mask_BxTxT, past)


class Projections(NamedTuple):
    """How one layer's weights are applied (`projections`): `inputs(n_attn_BxTxD, n_mlp_BxTxD)` gives q, k, v
    [B, T, H*K] (their biases added) and the MLP's pre-activation [B, T, F] (fc_in's bias added), of attention's
    and the MLP's normalized inputs (the same array where a family has one LayerNorm); `output(attn_BxTxW,
    act_BxTxF)` this device's part of attn out + fc_out [B, T, D], before the reduction and without the biases:
    attn out's `attn_bias` (None: none) and fc_out's `out_bias`. A block whose MLP reads attention's output (no
    parallel residual) takes each side alone: `attn_inputs(n)` q, k, v; `mlp_input(n)`; `attn_output(attn)`;
    `mlp_output(act)`. `attention` is the kernel."""
    inputs: Callable
    output: Callable
    out_bias: jax.Array
    attention: str
    attn_inputs: Callable
    mlp_input: Callable
    attn_output: Callable
    mlp_output: Callable
    attn_bias: jax.Array | None


def block(h_BxTxD: jax.Array, p: dict, head_dim: int, sincos, *, arch, mask_BxTxT: jax.Array | None = None,
          tp_axis: str | None = None, past: tuple | None = None, join: bool = False,
          policy: Policy) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
    """One transformer block of the family whose `arch` (model/family.py's `Block`) this is: GPT-J's
    h + Attn(LN(h)) + MLP(LN(h)), with one all-reduce of attn + mlp under tensor parallelism; with a second
    LayerNorm "ln_2" in `p`, h + Attn(LN1(h)) + MLP(LN2(h)) (GPT-NeoX's parallel residual), or without
    `arch.parallel` h' = h + Attn(LN1(h)), then h' + MLP(LN2(h')), an all-reduce each.

    Returns the new h and this block's keys and values [B, T, H, K], for a caller that keeps a KV cache. A mask of
    None is causal self-attention (`self_attention`: training, prefill). With `past=(k_blocks, v_blocks,
    mask_BxTxS)` attention also sees those cached keys (see `attend`). `p` is a layer of the param tree, or one
    whose projections `fused.fuse_layer` joined (for inference); how its weights are applied is `projections`' choice,
    the rest is this one body. The policy names the kernels (attention, the dense backward).
    """
    shards = 1 if tp_axis is None else lax.psum(1, tp_axis)
    # Fewer key heads than devices are held whole on each (`layout.kv_replicated`): a device computes them all and
    # attends with the one its query heads read.
    kv_whole = bool(arch.kv_heads) and arch.kv_heads < shards
    # this device's width of q and of k (v), where the arch says its heads (`gptj.block_arch`)
    widths = ((arch.heads * head_dim // shards, arch.kv_heads * head_dim // (1 if kv_whole else shards))
              if arch.heads else None)
    proj = projections(p, join, policy, widths)
    n_BxTxD = layer_norm(h_BxTxD, p["ln_1"])

    def attention(q, k, v):  # q, k and v are what remat_policy "save_qkv" keeps
        q, k, v = (checkpoint_name(x, "qkv").reshape(*x.shape[:-1], -1, head_dim) for x in (q, k, v))
        if kv_whole:
            read = lax.axis_index(tp_axis) // (shards // arch.kv_heads)
            k, v = (lax.dynamic_slice_in_dim(x, read, 1, axis=2) for x in (k, v))
        half = arch.rotary == "half"
        q, k = apply_rotary(q, *sincos, half=half), apply_rotary(k, *sincos, half=half)
        attend_self = partial(self_attention, kernel=proj.attention, shards=policy.attention_shards)
        return _attention(q, k, v, mask_BxTxT, past, attend_self), (k, v)

    def act(pre):  # its input is what remat_policy "save_mlp_hidden" keeps (`gptj.REMAT_POLICIES`)
        pre = checkpoint_name(pre, "mlp_hidden")
        if arch.mlp == "swiglu":  # [gate | fc_in] on this device's columns
            gate, up = jnp.split(pre, 2, axis=-1)
            return jax.nn.silu(gate) * up
        return jax.nn.gelu(pre, approximate=arch.gelu_tanh)

    if not arch.parallel:
        attn, kv = attention(*proj.attn_inputs(n_BxTxD))
        h_BxTxD = _residual(h_BxTxD, proj.attn_output(attn), proj.attn_bias, tp_axis)
        pre = proj.mlp_input(layer_norm(h_BxTxD, p["ln_2"]))
        return _residual(h_BxTxD, proj.mlp_output(act(pre)), proj.out_bias, tp_axis), kv
    n_mlp_BxTxD = layer_norm(h_BxTxD, p["ln_2"]) if "ln_2" in p else n_BxTxD
    q, k, v, pre_act = proj.inputs(n_BxTxD, n_mlp_BxTxD)
    attn, kv = attention(q, k, v)
    out_BxTxD = proj.output(attn, act(pre_act))
    bias = proj.out_bias if proj.attn_bias is None or proj.out_bias is None else proj.out_bias + proj.attn_bias
    return _residual(h_BxTxD, out_BxTxD, bias, tp_axis), kv


def projections(p: dict, join: bool, policy: Policy, widths: tuple[int, int] | None = None) -> Projections:
    """A layer's `Projections`: `fused.fuse_layer`'s joined matrices (inference, int8 ones with their scales), the param
    tree's matrices joined inside the computation (`join`, for a family with one LayerNorm), or the param tree's
    products as they are. `widths`: this device's width of q and of k (and v), which joined matrices need where k
    and v are narrower than q or the MLP is gated (None: as wide as q, not gated). A gated MLP's pre-activation is
    [gate | fc_in]."""
    if "fused" in p:  # with served adapters' slots beside it, each row's own added (model/lora_slots.py)
        proj = _fused(p["fused"], policy, widths)
        return proj if p.get("lora_rows") is None else lora_slots.adapted(proj, p["lora"], p["lora_rows"])
    attn, mlp_p = p["attn"], p["mlp"]
    fc_in, fc_out = mlp_p["fc_in"], mlp_p["fc_out"]

    def attn_inputs(n_BxTxD):
        qkv = [dense(n_BxTxD, attn[name], policy) for name in "qkv"]
        return tuple(x if f"{name}_bias" not in attn else x + lead(attn[f"{name}_bias"], x.ndim)
                     for name, x in zip("qkv", qkv))

    def mlp_input(n_BxTxD):
        pre = dense(n_BxTxD, fc_in["kernel"], policy)
        if "gate" in mlp_p:
            pre = jnp.concatenate([dense(n_BxTxD, mlp_p["gate"]["kernel"], policy), pre], -1)
        return pre if "bias" not in fc_in else pre + lead(fc_in["bias"], pre.ndim)

    def attn_output(attn_BxTxW):
        return dense(attn_BxTxW, attn["out"], policy)

    def mlp_output(act_BxTxF):
        return dense(act_BxTxF, fc_out["kernel"], policy)

    def separate_inputs(n_BxTxD, n_mlp_BxTxD):
        return *attn_inputs(n_BxTxD), mlp_input(n_mlp_BxTxD)

    def separate_output(attn_BxTxW, act_BxTxF):
        return attn_output(attn_BxTxW) + mlp_output(act_BxTxF)

    sides = (attn_inputs, mlp_input, attn_output, mlp_output, attn.get("out_bias"))
    out_bias = fc_out.get("bias")
    if join and "ln_2" not in p and "q_bias" not in attn and "gate" not in mlp_p:
        # q, k, v and fc_in (which all read LN(h)) in one product, out and fc_out (summed) in another
        in_DxN = jnp.concatenate([attn["q"], attn["k"], attn["v"], fc_in["kernel"]], -1)
        out_MxD = jnp.concatenate([attn["out"], fc_out["kernel"]], 0)
        def inputs(n_BxTxD, n_mlp_BxTxD):
            *qkv, pre = _split(dense(n_BxTxD, in_DxN, policy), (attn["q"].shape[-1], attn["k"].shape[-1]))
            return *qkv, pre + lead(fc_in["bias"], pre.ndim)

        def output(attn_BxTxW, act_BxTxF):
            return dense(jnp.concatenate([attn_BxTxW, act_BxTxF], -1), out_MxD, policy)
        return Projections(inputs, output, out_bias, policy.attention, *sides)
    return Projections(separate_inputs, separate_output, out_bias, policy.attention, *sides)


def _split(y, widths: tuple[int, int]) -> tuple[jax.Array, ...]:
    """q, k, v and the MLP's part of a joined input product y [B, T, W + 2 W_kv + F], `widths` (W, W_kv)."""
    q, kv = widths
    return y[..., :q], y[..., q:q + kv], y[..., q + kv:q + 2 * kv], y[..., q + 2 * kv:]


def _residual(h_BxTxD: jax.Array, out_BxTxD: jax.Array, bias_D: jax.Array | None,
              tp_axis: str | None) -> jax.Array:
    """h + the block's output, summed over tensor-parallel shards first, + fc_out's bias (added once; None: none)."""
    if tp_axis is not None:
        out_BxTxD = lax.psum(out_BxTxD, tp_axis)
    return h_BxTxD + out_BxTxD if bias_D is None else h_BxTxD + out_BxTxD + lead(bias_D, h_BxTxD.ndim)


def _fused(p: dict, policy: Policy, widths: tuple[int, int] | None) -> Projections:
    """`Projections` of `fused.fuse_layer`'s matrices (this device's slice: the device axis is 1 here), int8 ones with
    their scales (model/quant.py), computed in pieces where the policy says (`order.in_pieces`). A side alone (or
    inputs of two LayerNorms) reads its rows of "in" or columns of "out". `widths`: this device's (W, W_kv): "in"
    has W + 2 W_kv + F rows (2 F, gate and fc_in, for a gated MLP), "out" W + F columns (None: W_kv = W, no gate:
    W is half of in's rows less out's columns)."""
    d = p["in"].shape[-1]
    if widths is None:
        widths = ((p["in"].shape[1] - p["out"].shape[-1]) // 2,) * 2
    width, qkv = widths[0], widths[0] + 2 * widths[1]
    scales = [p[name].reshape(-1) if name in p else None for name in ("in_scale", "out_scale")]  # int8: quant.py
    dot_dtype = None if policy.int8_dot in ("compute", "kernel") else jnp.dtype(policy.int8_dot)
    in_NxK, in_bias = p["in"].reshape(-1, d), p["in_bias"].reshape(-1)
    out_DxM = p["out"].reshape(d, -1)

    def product(x, w_NxK, scale_N, rows=None, cols=None):
        """x @ w[rows, cols].T (ranges (start, stop); None: all), the int8 kernel reading its ranges in place."""
        if scale_N is not None and policy.int8_dot == "kernel" and quant_kernel.applies(x, w_NxK, rows, cols):
            return quant_kernel.by_rows(x, w_NxK, scale_N, rows, cols)
        r, c = slice(*rows) if rows else slice(None), slice(*cols) if cols else slice(None)
        scale = None if scale_N is None else scale_N[r]
        return order.in_pieces(lambda w, s: quant.by_rows(x, w, s, dot_dtype), w_NxK[r, c], scale, 0, policy, x)

    def side_input(x, start, stop):
        y = product(x, in_NxK, scales[0], (start, stop))
        return y + lead(in_bias[start:stop], y.ndim)

    def inputs(n_BxTxD, n_mlp_BxTxD):
        if n_mlp_BxTxD is not n_BxTxD:
            return *attn_inputs(n_BxTxD), mlp_input(n_mlp_BxTxD)
        y = product(n_BxTxD, in_NxK, scales[0])
        return _split(y + lead(in_bias, y.ndim), widths)

    def attn_inputs(n_BxTxD):
        return _split(side_input(n_BxTxD, 0, qkv), widths)[:3]

    def mlp_input(n_BxTxD):
        return side_input(n_BxTxD, qkv, in_NxK.shape[0])

    def output(attn_BxTxW, act_BxTxF):
        return product(jnp.concatenate([attn_BxTxW, act_BxTxF], -1), out_DxM, scales[1])

    def attn_output(attn_BxTxW):
        return product(attn_BxTxW, out_DxM, scales[1], cols=(0, width))

    def mlp_output(act_BxTxF):
        return product(act_BxTxF, out_DxM, scales[1], cols=(width, out_DxM.shape[1]))
    # Inference only, so forward only: on CPU prefill keeps XLA's attention, whose programs compile faster: the
    # blocked one adds 1.2-2.2 s to each GPT-J-6B prefill program (the serving warm-up compiles 17 of them).
    return Projections(inputs, output, p["out_bias"], "xla" if policy.attention == "blocked" else policy.attention,
                       attn_inputs, mlp_input, attn_output, mlp_output, p.get("attn_bias"))


def vocab_offset(vocab_local: int, tp_axis: str | None) -> jax.Array | int:
    """The first vocab id of this device's columns (0 without tensor parallelism)."""
    return 0 if tp_axis is None else lax.axis_index(tp_axis) * vocab_local


def gather_shards(x: jax.Array, tp_axis: str | None) -> jax.Array:
    """Every tp shard's x side by side on the last axis, the same on every device: each shard placed into zeros, then
    summed over tp_axis. A psum rather than an all_gather, because its result is typed as identical on every device
    (check_vma), so what is computed from it (sampled tokens, top k) can leave shard_map unsplit over tp_axis."""
    if tp_axis is None:
        return x
    width = x.shape[-1]
    full = jnp.zeros((*x.shape[:-1], width * lax.axis_size(tp_axis)), x.dtype)
    full = lax.dynamic_update_slice_in_dim(full, x, lax.axis_index(tp_axis) * width, x.ndim - 1)
    return lax.psum(full, tp_axis)


def embed(ids_BxT: jax.Array, wte_VxD: jax.Array, tp_axis: str | None = None) -> jax.Array:
    """Token embeddings; under tensor parallelism each device looks up ids in its vocab rows, then one psum."""
    if tp_axis is None:
        return wte_VxD[ids_BxT]
    vocab_local = wte_VxD.shape[0]
    local_ids_BxT = ids_BxT - vocab_offset(vocab_local, tp_axis)
    in_range_BxT = (local_ids_BxT >= 0) & (local_ids_BxT < vocab_local)
    h_BxTxD = jnp.where(in_range_BxT[..., None], wte_VxD[jnp.clip(local_ids_BxT, 0, vocab_local - 1)], 0)
    return lax.psum(h_BxTxD, tp_axis)


def head(h_BxTxD: jax.Array, ln_f: dict, lm_head: dict, policy: Policy | None = None) -> jax.Array:
    """Final LayerNorm and the (untied) LM head; logits in f32, this device's vocab columns. An int8 head (with a
    "scale" per vocab entry, `quant.quantize_head`) is converted to the activations' dtype and its logits scaled.
    With a policy (inference), the product runs in its pieces (`in_pieces`)."""
    n_BxTxD = layer_norm(h_BxTxD, ln_f)

    def product(kernel_DxV, scale_V):
        kernel_DxV = kernel_DxV if scale_V is None else kernel_DxV.astype(n_BxTxD.dtype)
        logits_BxTxV = jnp.einsum("btd,dv->btv", n_BxTxD, kernel_DxV, preferred_element_type=F32)
        return logits_BxTxV if scale_V is None else logits_BxTxV * lead(scale_V, logits_BxTxV.ndim)

    if policy is None:
        logits_BxTxV = product(lm_head["kernel"], lm_head.get("scale"))
    else:
        logits_BxTxV = order.in_pieces(product, lm_head["kernel"], lm_head.get("scale"), 1, policy, n_BxTxD)
    if "bias" not in lm_head:  # a family whose head has none
        return logits_BxTxV
    return logits_BxTxV + lead(lm_head["bias"].astype(F32), logits_BxTxV.ndim)


def _softmax_sums(logits_BxTxV: jax.Array, targets_BxT: jax.Array, tp_axis: str | None):
    """(max, exp(logits - max), its sum, the target's logit) of each row, over the whole (possibly vocab-sharded)
    vocabulary: max and sum [B, T] are global, exp [B, T, V] is this device's columns."""
    vocab_local = logits_BxTxV.shape[-1]
    offset = vocab_offset(vocab_local, tp_axis)
    max_BxT = lax.stop_gradient(logits_BxTxV.max(-1))
    if tp_axis is not None:
        max_BxT = lax.pmax(max_BxT, tp_axis)
    exp_BxTxV = jnp.exp(logits_BxTxV - max_BxT[..., None])
    sum_exp_BxT = exp_BxTxV.sum(-1)
    # A gather of the one target column, not a [B, T, V] one-hot: the vocab is the largest axis by far.
    local_BxT = targets_BxT - offset
    in_range_BxT = (local_BxT >= 0) & (local_BxT < vocab_local)
    picked_BxT = jnp.take_along_axis(logits_BxTxV, jnp.clip(local_BxT, 0, vocab_local - 1)[..., None], -1)[..., 0]
    target_logit_BxT = jnp.where(in_range_BxT, picked_BxT, 0.0)
    if tp_axis is not None:
        sum_exp_BxT, target_logit_BxT = lax.psum((sum_exp_BxT, target_logit_BxT), tp_axis)
    return max_BxT, exp_BxTxV, sum_exp_BxT, target_logit_BxT


def cross_entropy(logits_BxTxV: jax.Array, targets_BxT: jax.Array, tp_axis: str | None = None) -> jax.Array:
    """Per-token cross entropy [B, T] from (vocab-sharded) f32 logits, never gathering the vocab."""
    max_BxT, _, sum_exp_BxT, target_logit_BxT = _softmax_sums(logits_BxTxV, targets_BxT, tp_axis)
    return jnp.log(sum_exp_BxT) + max_BxT - target_logit_BxT


def head_cross_entropy(h_BxTxD: jax.Array, ln_f: dict, lm_head: dict, targets_BxT: jax.Array,
                       tp_axis: str | None = None, constrain_logits=None) -> jax.Array:
    """`cross_entropy(head(h))` with a hand-written backward through the LM head: the training loss.

    The [B, T, V] logits are the largest activation by far. Autodiff would keep exp(logits), then write the
    gradient of the logits and a transposed copy of it for the kernel's gradient. Here the forward writes
    softmax - onehot once, and the backward is two matmuls that read it in place, with the per-token cotangent
    folded into the small [B, T, D] side.
    """
    bias = lm_head["bias"] if "bias" in lm_head else jnp.zeros(lm_head["kernel"].shape[-1:], lm_head["kernel"].dtype)
    n_BxTxD, kernel_DxV, bias_V = _same_varying_axes(layer_norm(h_BxTxD, ln_f), lm_head["kernel"], bias)
    return _head_ce(n_BxTxD, kernel_DxV, bias_V, targets_BxT, tp_axis, constrain_logits)


def _same_varying_axes(*xs: jax.Array) -> list[jax.Array]:
    """Inside shard_map, cast each array to vary over every mesh axis that any of them varies over, so that a
    custom_vjp's backward returns gradients of the primal's type; autodiff turns each cast into the psum the
    gradient needs (over 'dp' for the weights, over 'mp' for the activations). Outside shard_map: unchanged."""
    axes = [jax.typeof(x).manual_axis_type.varying for x in xs]
    union = frozenset().union(*axes)
    return [lax.pcast(x, tuple(sorted(union - a)), to="varying") if union - a else x for x, a in zip(xs, axes)]


def _head_ce_fwd(n_BxTxD, kernel_DxV, bias_V, targets_BxT, tp_axis, constrain_logits):
    logits_BxTxV = jnp.einsum("btd,dv->btv", n_BxTxD, kernel_DxV, preferred_element_type=F32)
    logits_BxTxV = logits_BxTxV + lead(bias_V.astype(F32), 3)
    if constrain_logits is not None:
        logits_BxTxV = constrain_logits(logits_BxTxV)
    max_BxT, exp_BxTxV, sum_exp_BxT, target_logit_BxT = _softmax_sums(logits_BxTxV, targets_BxT, tp_axis)
    vocab_local = logits_BxTxV.shape[-1]
    offset = vocab_offset(vocab_local, tp_axis)
    onehot_BxTxV = lead(jnp.arange(vocab_local), 3) == (targets_BxT - offset)[..., None]
    dlogits_BxTxV = (exp_BxTxV * (1 / sum_exp_BxT)[..., None] - onehot_BxTxV).astype(n_BxTxD.dtype)
    ce_BxT = jnp.log(sum_exp_BxT) + max_BxT - target_logit_BxT
    return ce_BxT, (n_BxTxD, kernel_DxV, bias_V, dlogits_BxTxV)


def _head_ce_bwd(tp_axis, constrain_logits, residuals, g_BxT):
    n_BxTxD, kernel_DxV, bias_V, dlogits_BxTxV = residuals
    g_BxT = g_BxT.astype(F32)
    scaled_n_BxTxD = (n_BxTxD * g_BxT[..., None]).astype(n_BxTxD.dtype)
    d_kernel = jnp.einsum("btd,btv->dv", scaled_n_BxTxD, dlogits_BxTxV, preferred_element_type=F32)
    d_bias = jnp.einsum("bt,btv->v", g_BxT, dlogits_BxTxV, preferred_element_type=F32)
    d_n_BxTxD = jnp.einsum("btv,dv->btd", dlogits_BxTxV, kernel_DxV, preferred_element_type=F32) * g_BxT[..., None]
    return (d_n_BxTxD.astype(n_BxTxD.dtype), d_kernel.astype(kernel_DxV.dtype), d_bias.astype(bias_V.dtype),
            None)


_head_ce = jax.custom_vjp(lambda n, kernel, bias, targets, tp_axis, constrain: _head_ce_fwd(
    n, kernel, bias, targets, tp_axis, constrain)[0], nondiff_argnums=(4, 5))
_head_ce.defvjp(_head_ce_fwd, _head_ce_bwd)
