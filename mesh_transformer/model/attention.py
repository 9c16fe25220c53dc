"""Attention for training, prefill and the block cache, as pure functions (shape letters: see `layers`).

`attend` is the masked softmax attention every program can run, with an optional KV cache read where it lies;
`self_attention` is the causal one of training and prefill, by the kernel the platform policy names
(`mesh_transformer.platforms`): `blocked_attention` on CPU, `jax.nn.dot_product_attention` elsewhere (cuDNN's fused
kernel on GPU where it applies).
"""
from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

log = logging.getLogger(__name__)

F32 = jnp.float32


class Scaled(NamedTuple):
    """Cached keys or values held as int8 [B, S, H, K] with a scale per position and head [B, S, H] (an int8 KV
    cache's): a key's scale multiplies its scores and a value's its probabilities, so the int8 values go to the dot
    as they are (converted inside it), never dequantized into a copy of the cache."""
    values: jax.Array
    scale_BxSxH: jax.Array


def _per_score(scale_BxSxH: jax.Array) -> jax.Array:
    """A scale per position and key head as a factor of grouped scores [B, H_kv, 1, 1, S]."""
    return scale_BxSxH.transpose(0, 2, 1)[:, :, None, None, :]


def attend(q_BxTxHxK: jax.Array, k_BxTxHxK: jax.Array, v_BxTxHxK: jax.Array, mask_BxTxT: jax.Array,
           past: tuple | None = None) -> jax.Array:
    """Softmax attention in f32 over the keys allowed by the mask; returns [B, T, H*K]. Keys and values may have
    fewer heads than the queries (grouped-query attention: query head h reads key head h // (H / H_kv)).

    With `past=(k_blocks, v_blocks, mask_BxTxS)` the queries also see S earlier keys (a KV cache) held in one or
    more blocks [B, S_j, H, K] (or `Scaled` int8 blocks) that together make S, read where they lie: their scores are
    joined to the new keys' before the softmax, so the cache is never copied to append the new keys or to join its
    blocks.
    """
    b, t, heads, head_dim = q_BxTxHxK.shape
    n = v_BxTxHxK.shape[2]  # key heads, each read by g = H / n query heads (query head h reads key head h // g)
    g = heads // n
    # the queries as [B, n, T*g, K]: one product per key head, its batch and free axes as in multi-head attention
    q_BxNxMxK = q_BxTxHxK.reshape(b, t, n, g, head_dim).transpose(0, 2, 1, 3, 4).reshape(b, n, t * g, head_dim)

    def scores(k_BxSxNxK, mask_BxTxS):  # [B, n, T, g, S]
        scaled = isinstance(k_BxSxNxK, Scaled)
        q = q_BxNxMxK.astype(v_BxTxHxK.dtype) if scaled else q_BxNxMxK
        k = k_BxSxNxK.values.astype(v_BxTxHxK.dtype) if scaled else k_BxSxNxK
        s = jnp.einsum("bnmk,bsnk->bnms", q, k, preferred_element_type=F32)
        s = s.reshape(b, n, t, g, -1) / jnp.sqrt(F32(head_dim))
        if scaled:
            s = s * _per_score(k_BxSxNxK.scale_BxSxH)
        return jnp.where(mask_BxTxS[:, None, :, None], s, jnp.finfo(F32).min)

    def context(probs, v_BxSxNxK):  # [B, n, T*g, K]
        if isinstance(v_BxSxNxK, Scaled):
            probs = probs * _per_score(v_BxSxNxK.scale_BxSxH)
            v_BxSxNxK = v_BxSxNxK.values.astype(v_BxTxHxK.dtype)
        probs = probs.reshape(b, n, t * g, -1).astype(v_BxTxHxK.dtype)
        return jnp.einsum("bnms,bsnk->bnmk", probs, v_BxSxNxK)

    # The softmax over every block's scores and the new keys' without joining them: one maximum and one sum over all,
    # each block's probabilities times its values (joined, XLA:TPU held the joined scores, their softmax and its
    # slices at once: 0.6 GB of Llama-2-7B's 512-token prompt tail over 2,048 cached positions).
    k_blocks, v_blocks, past_mask = past if past is not None else ([], [], None)
    starts = [0]
    for k_block in k_blocks:
        starts.append(starts[-1] + (k_block.values if isinstance(k_block, Scaled) else k_block).shape[1])
    parts = [scores(k, past_mask[..., a:b]) for k, a, b in zip(k_blocks, starts, starts[1:])]
    parts.append(scores(k_BxTxHxK, mask_BxTxT))
    top = functools.reduce(jnp.maximum, [jnp.max(s, -1, keepdims=True) for s in parts])
    exps = [jnp.exp(s - top) for s in parts]
    total = sum(jnp.sum(e, -1, keepdims=True) for e in exps)
    ctx_BxNxMxK = context(exps[-1] / total, v_BxTxHxK)
    for e, v in zip(exps, v_blocks):
        ctx_BxNxMxK += context(e / total, v)
    return ctx_BxNxMxK.reshape(b, n, t, g, head_dim).transpose(0, 2, 1, 3, 4).reshape(b, t, heads * head_dim)


def causal_mask(length: int) -> jax.Array:
    return jnp.tril(jnp.ones((1, length, length), bool))


# Query blocks of CPU training attention (`blocked_attention`): 4 skip 3/8 of the score products; blocks of fewer
# than MIN_QUERY_BLOCK queries are not worth their extra products (and compile time), so short sequences take fewer.
CPU_QUERY_BLOCKS, MIN_QUERY_BLOCK = 4, 64


KERNELS = ("blocked", "xla", "cudnn", "splash")
SPLASH_BLOCK = 512  # splash attention's query and key blocks (at most; fewer where they would not divide the rows)
SPLASH_LANES = 128  # what splash needs the sequence and the head dim to be multiples of
SPLASH_INTERPRET = False  # run splash in Pallas' interpreter (the CPU's tests; its TPU interpreter cannot run splash)


def self_attention(q_BxTxHxK: jax.Array, k_BxTxHxK: jax.Array, v_BxTxHxK: jax.Array,
                   length_B: jax.Array | None = None, kernel: str = "xla", shards: tuple | None = None) -> jax.Array:
    """Causal self-attention for training and prefill; returns [B, T, H*K]. With `length_B` (right-padded rows),
    keys at or after a row's length are masked. Scores and softmax in f32, as in `attend`.

    `kernel` "blocked" (the CPU's): `blocked_attention`, which skips the masked blocks. "xla":
    `jax.nn.dot_product_attention` in XLA's implementation (TPU). "cudnn": cuDNN's fused (flash) kernel where it
    takes the dtype and head dim (bf16 or fp16; head dim a multiple of 8, at most 128, 256 from Hopper on), else
    XLA's. "splash": JAX's TPU splash attention kernel (`splash_attention`) where the sequence and the head dim are
    multiples of 128, else XLA's; with `shards` (mesh, PartitionSpec of q, k, v), on each device for its rows and
    heads (`platforms.for_layout`).
    """
    if kernel not in KERNELS:
        raise ValueError(f"attention kernel must be one of {KERNELS}, got {kernel!r}")
    if kernel in ("blocked", "splash"):  # fewer key and value heads (grouped-query): each read by its queries' group
        k_BxTxHxK, v_BxTxHxK = (_repeat_heads(x, q_BxTxHxK.shape[2]) for x in (k_BxTxHxK, v_BxTxHxK))
    if kernel == "blocked":
        return blocked_attention(q_BxTxHxK, k_BxTxHxK, v_BxTxHxK, length_B)
    if kernel == "splash":
        _, length, _, head_dim = q_BxTxHxK.shape
        if length % SPLASH_LANES == 0 and head_dim % SPLASH_LANES == 0:
            if shards is None:
                return splash_attention(q_BxTxHxK, k_BxTxHxK, v_BxTxHxK)
            mesh, spec = shards  # [B, T, H*K] out: a device's heads side by side, as they are split
            return jax.shard_map(splash_attention, mesh=mesh, in_specs=(spec,) * 3, out_specs=P(*spec[:3]),
                                 check_vma=False)(q_BxTxHxK, k_BxTxHxK, v_BxTxHxK)
        _kernel_refused("splash", q_BxTxHxK.shape, str(q_BxTxHxK.dtype), "sequence or head dim not a multiple of 128")
    return dot_product_attention(q_BxTxHxK, k_BxTxHxK, v_BxTxHxK, length_B, cudnn=kernel == "cudnn")


@functools.cache
def _kernel_refused(kernel: str, shape: tuple, dtype: str, reason: str) -> None:
    """Say once per shape and reason (a program traces its attention many times) that XLA's attention runs instead."""
    log.warning("%s attention not used for q %s %s: %s", kernel, shape, dtype, reason)


@functools.cache
def _splash_kernel(length: int, heads: int, block: int, interpret: bool):
    """JAX's splash attention for `heads` causal heads of `length` positions (one sequence [H, T, K]), its forward
    and backward in blocks of `block` positions."""
    from jax.experimental.pallas.ops.tpu import splash_attention as splash

    sizes = splash.BlockSizes(block_q=block, block_kv=block, block_kv_compute=block, block_q_dkv=block,
                              block_kv_dkv=block, block_kv_dkv_compute=block, block_q_dq=block, block_kv_dq=block)
    mask = splash.MultiHeadMask([splash.CausalMask((length, length)) for _ in range(heads)])
    with jax.ensure_compile_time_eval():  # its mask tables are constants, not values of the trace that asks first
        return splash.make_splash_mha_single_device(mask, block_sizes=sizes, interpret=interpret)


def splash_block(length: int) -> int:
    """Splash's query and key blocks over rows of `length` positions (a multiple of 128): the largest multiple of 128,
    at most SPLASH_BLOCK, that divides them."""
    block = min(SPLASH_BLOCK, length)
    while length % block:
        block -= SPLASH_LANES
    return block


def clear_kernels() -> None:
    """Drop the splash kernels made so far (each holds its mask tables in device memory)."""
    _splash_kernel.cache_clear()


def _at_default_precision(fn: Callable) -> Callable:
    """fn with its forward and backward traced at the default matmul precision: bf16 products are exact at any, and
    Mosaic refuses bf16 ones at "highest" (a `jax.default_matmul_precision` the caller may have set)."""

    def forward(*args):
        with jax.default_matmul_precision("default"):
            return jax.vjp(fn, *args)

    def backward(vjp, cotangent):
        with jax.default_matmul_precision("default"):
            return vjp(cotangent)

    run = jax.custom_vjp(lambda *args: forward(*args)[0])
    run.defvjp(forward, backward)
    return run


def splash_attention(q_BxTxHxK: jax.Array, k_BxTxHxK: jax.Array, v_BxTxHxK: jax.Array) -> jax.Array:
    """Causal self-attention by JAX's TPU splash attention kernel (flash attention skipping the masked blocks; f32
    softmax), each row on its own; returns [B, T, H*K]. A right-padded row's real positions see only real keys (the
    mask is causal), as with `dot_product_attention`'s lengths. On the rows and heads it is given: `self_attention`
    runs it per device under a GSPMD layout of several."""
    batch, length, heads, head_dim = q_BxTxHxK.shape
    q_BxTxHxK = q_BxTxHxK * jnp.asarray(1 / head_dim ** 0.5, q_BxTxHxK.dtype)
    kernel = jax.vmap(_splash_kernel(length, heads, splash_block(length), SPLASH_INTERPRET))
    if q_BxTxHxK.dtype == jnp.bfloat16:
        kernel = _at_default_precision(kernel)
    ctx_BxHxTxK = kernel(*(x.transpose(0, 2, 1, 3) for x in (q_BxTxHxK, k_BxTxHxK, v_BxTxHxK)))
    return ctx_BxHxTxK.transpose(0, 2, 1, 3).reshape(batch, length, heads * head_dim)


def _repeat_heads(x_BxTxNxK: jax.Array, heads: int) -> jax.Array:
    """Key or value heads repeated to `heads` (head h reads head h // (heads / N), as HF's repeat_kv)."""
    return x_BxTxNxK if x_BxTxNxK.shape[2] == heads else jnp.repeat(x_BxTxNxK, heads // x_BxTxNxK.shape[2], axis=2)


def dot_product_attention(q_BxTxHxK: jax.Array, k_BxTxHxK: jax.Array, v_BxTxHxK: jax.Array,
                          length_B: jax.Array | None = None, cudnn: bool = False) -> jax.Array:
    """`self_attention` through `jax.nn.dot_product_attention`; with `cudnn`, cuDNN's kernel where it applies."""
    lengths_B = None if length_B is None else length_B.astype(jnp.int32)
    run = partial(jax.nn.dot_product_attention, q_BxTxHxK, k_BxTxHxK, v_BxTxHxK, is_causal=True,
                  key_value_seq_lengths=lengths_B)
    ctx_BxTxHxK = None
    if cudnn and q_BxTxHxK.dtype in (jnp.bfloat16, jnp.float16):
        try:
            ctx_BxTxHxK = run(implementation="cudnn")
        except Exception as e:  # refused when traced (dtype, head dim, cuDNN version, layout): XLA's is always there
            _kernel_refused("cuDNN", q_BxTxHxK.shape, str(q_BxTxHxK.dtype), str(e))
    if ctx_BxTxHxK is None:
        ctx_BxTxHxK = run(implementation=None)
    return ctx_BxTxHxK.reshape(*ctx_BxTxHxK.shape[:2], -1)


def blocked_attention(q_BxTxHxK: jax.Array, k_BxTxHxK: jax.Array, v_BxTxHxK: jax.Array,
                      length_B: jax.Array | None = None, n_blocks: int | None = None) -> jax.Array:
    """Causal self-attention in `n_blocks` query blocks (default CPU_QUERY_BLOCKS, fewer where blocks would hold
    under MIN_QUERY_BLOCK queries), each over the keys up to its own end, so the blocks above the diagonal are
    never computed; heads-major inside, with a hand-written backward (`_causal_core`). Equal to
    `dot_product_attention`, and a third of its cost on the CPU: forward + backward at one layer of
    configs/bench.json (B 4, T 256, H 8, K 64) on 2 cores, 15 ms against XLA's 43 ms (torch SDPA 16 ms)."""
    B, T, H, K = q_BxTxHxK.shape
    n_blocks = n_blocks or max(1, min(CPU_QUERY_BLOCKS, T // MIN_QUERY_BLOCK))
    q_BxHxTxK, k_BxHxTxK, v_BxHxTxK = (x.transpose(0, 2, 1, 3) for x in (q_BxTxHxK, k_BxTxHxK, v_BxTxHxK))
    valid_BxT = jnp.ones((1, T), bool) if length_B is None else jnp.arange(T)[None] < length_B[:, None]
    ends = sorted({T * (i + 1) // n_blocks for i in range(n_blocks)} - {0})
    outs = []
    for start, end in zip([0, *ends], ends):
        causal_TxS = (start + jnp.arange(end - start))[:, None] >= jnp.arange(end)[None]
        mask_BxTxS = causal_TxS[None] & valid_BxT[:, None, :end]
        outs.append(_causal_core(q_BxHxTxK[:, :, start:end], k_BxHxTxK[:, :, :end], v_BxHxTxK[:, :, :end],
                                 mask_BxTxS))
    return jnp.concatenate(outs, 2).transpose(0, 2, 1, 3).reshape(B, T, H * K)


def _causal_core_fwd(q_BxHxTxK, k_BxHxSxK, v_BxHxSxK, mask_BxTxS):
    scale = 1 / jnp.sqrt(F32(q_BxHxTxK.shape[-1]))
    s_BxHxTxS = jnp.einsum("bhtk,bhsk->bhts", q_BxHxTxK, k_BxHxSxK, preferred_element_type=F32) * scale
    s_BxHxTxS = jnp.where(mask_BxTxS[:, None], s_BxHxTxS, jnp.finfo(F32).min)
    probs_BxHxTxS = jax.nn.softmax(s_BxHxTxS, -1)
    ctx_BxHxTxK = jnp.einsum("bhts,bhsk->bhtk", probs_BxHxTxS.astype(v_BxHxSxK.dtype), v_BxHxSxK)
    return ctx_BxHxTxK, (q_BxHxTxK, k_BxHxSxK, v_BxHxSxK, probs_BxHxTxS, ctx_BxHxTxK)


def _causal_core_bwd(residuals, d_ctx_BxHxTxK):
    """Softmax attention's backward from the saved probabilities P: dV = P^T dO, dS = P * (dO V^T - rowsum(dO * O)),
    dQ = dS K, dK = dS^T Q (scaled as the scores were)."""
    q_BxHxTxK, k_BxHxSxK, v_BxHxSxK, probs_BxHxTxS, ctx_BxHxTxK = residuals
    scale = 1 / jnp.sqrt(F32(q_BxHxTxK.shape[-1]))
    d_v = jnp.einsum("bhts,bhtk->bhsk", probs_BxHxTxS.astype(d_ctx_BxHxTxK.dtype), d_ctx_BxHxTxK,
                     preferred_element_type=F32)
    d_probs_BxHxTxS = jnp.einsum("bhtk,bhsk->bhts", d_ctx_BxHxTxK, v_BxHxSxK, preferred_element_type=F32)
    row_BxHxTx1 = (d_ctx_BxHxTxK.astype(F32) * ctx_BxHxTxK.astype(F32)).sum(-1, keepdims=True)
    d_s_BxHxTxS = (probs_BxHxTxS * (d_probs_BxHxTxS - row_BxHxTx1) * scale).astype(q_BxHxTxK.dtype)
    d_q = jnp.einsum("bhts,bhsk->bhtk", d_s_BxHxTxS, k_BxHxSxK, preferred_element_type=F32)
    d_k = jnp.einsum("bhts,bhtk->bhsk", d_s_BxHxTxS, q_BxHxTxK, preferred_element_type=F32)
    return d_q.astype(q_BxHxTxK.dtype), d_k.astype(k_BxHxSxK.dtype), d_v.astype(v_BxHxSxK.dtype), None


_causal_core = jax.custom_vjp(lambda q, k, v, mask: _causal_core_fwd(q, k, v, mask)[0])
_causal_core.defvjp(_causal_core_fwd, _causal_core_bwd)
