"""The order of inference's weight reads on the CPU: XLA's CPU dot has no bf16 or int8 kernel, so it converts
such a matrix to f32 before its product, and nothing orders those converts. Tying each matrix (or each piece of
one) to what comes before it keeps one f32 copy alive at a time. Accelerators take the weights as they are: with
their policy every function here is the plain computation.
"""
from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from mesh_transformer.platforms import Policy


def in_turn(h: jax.Array, weights: Any, policy: Policy) -> Any:
    """The weights, where the policy orders converts (CPU) with the bf16/fp16 matrices made to depend on h. XLA's
    CPU dot has no bf16 kernel, so it converts such operands to f32 first; left unordered, the scheduler runs all
    those converts up front, every layer's f32 copy alive at once (2x the model in temporaries; an
    optimization_barrier does not help, it is converted too). A select on a value of h, fused into the convert, makes
    each layer's copy wait for the layer before, so one is alive at a time. Accelerators have bf16 dots: nothing is
    done there."""
    if not policy.ordered_converts:
        return weights
    first = h.reshape(-1)[0]
    keep = first == first  # false only where h is NaN, which the layer's output would be anyway

    return jax.tree.map(lambda w: _tied(keep, w) if w.ndim >= 2 else w, weights)


def waits_for(h: jax.Array, x: jax.Array) -> jax.Array:
    """x made to depend on h, whatever the policy: a select on a value of h, so XLA cannot compute what reads x (a
    gather by a page table, say) before h (false only where h is NaN, which what follows would be anyway)."""
    first = h.reshape(-1)[0]
    return jnp.where(first == first, x, jnp.zeros((), x.dtype))


def _tied(keep: jax.Array, w: jax.Array) -> jax.Array:
    """w made to depend on `keep` (true), where it is converted before its products (narrower than f32)."""
    return jnp.where(keep, w, jnp.zeros((), w.dtype)) if w.dtype.itemsize < 4 else w


def weights_in_turn(h: jax.Array, weights: Any, policy: Policy) -> Any:
    """`in_turn` for inference weights, unless the policy computes their products in pieces, each waiting for what
    comes before it (`in_pieces`): a whole-matrix select there is written out as a copy of the matrix."""
    return weights if policy.dot_piece_bytes else in_turn(h, weights, policy)


def in_pieces(product, w: jax.Array, scale: jax.Array | None, axis: int, policy: Policy, x: jax.Array) -> jax.Array:
    """product(w, scale), its outputs on the last axis, computed in pieces of w along `axis` (its outputs) one after
    the other where the policy says (`dot_piece_bytes`, CPU): XLA's CPU dot converts a bf16 or int8 matrix to f32
    whole before its product, and each piece waits for the one before (the first for the product's input x), so
    one piece's f32 copy is alive at a time instead of the matrix's (GPT-J-6B: 0.47 GB for a layer's joined input
    matrix, 0.83 GB for the head). Only for products over at most `dot_piece_tokens` tokens (decode steps, short
    prompts), where the weights outweigh the activations: a long prefill's are larger than one matrix anyway, and
    pieces make each GPT-J-6B program compile 1.4-1.9x longer."""
    n, tokens = w.shape[axis], x.size // x.shape[-1]
    narrow, short = w.dtype.itemsize < 4, tokens <= policy.dot_piece_tokens
    count = _piece_count(n, w.size // n * 4, policy.dot_piece_bytes) if narrow and short else 1
    size, outs = n // count, []
    for i in range(count):
        piece = lax.slice_in_dim(w, i * size, (i + 1) * size, axis=axis)
        if policy.dot_piece_bytes and policy.ordered_converts:
            first = (outs[-1] if outs else x).reshape(-1)[0]
            piece = _tied(first == first, piece)
        outs.append(product(piece, None if scale is None else scale[i * size:(i + 1) * size]))
    return outs[0] if count == 1 else jnp.concatenate(outs, -1)


def _piece_count(n: int, f32_bytes_per_output: int, limit: int) -> int:
    """The fewest pieces, a divisor of n, whose f32 weights are each at most `limit` bytes (0: one piece)."""
    if not limit:
        return 1
    return next(c for c in range(1, n + 1) if n % c == 0 and (n // c) * f32_bytes_per_output <= limit or c == n)
