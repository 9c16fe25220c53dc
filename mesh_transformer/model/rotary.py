"""Rotary position embedding: the sin and cos tables of the positions (GPT-J's interleaved pairs, GPT-NeoX's and
Llama's halves), the frequencies under HF's rope scaling, and the rotation of each head's first P dims (`layers.block`
applies it to q and k)."""
from __future__ import annotations

import jax
import jax.numpy as jnp

F32 = jnp.float32


def rotary_sincos(positions_BxT: jax.Array, rot_dims: int, base: float = 10000.0,
                  half: bool = False, scaling: dict | None = None) -> tuple[jax.Array, jax.Array]:
    """The rotary sin and cos tables [B, T, P]: GPT-J's interleaved [t0, t0, t1, t1, ...] per position, or with
    `half` (GPT-NeoX's) [t0, t1, ..., t0, t1, ...]; the frequencies scaled as HF's `rope_scaling` says."""
    inv_freq_P2 = scaled_frequencies(1.0 / (base ** (jnp.arange(0, rot_dims, 2, dtype=F32) / rot_dims)), scaling)
    angle_BxTxP2 = positions_BxT.astype(F32)[..., None] * inv_freq_P2.reshape((1,) * positions_BxT.ndim + (-1,))
    if half:
        return jnp.concatenate([jnp.sin(angle_BxTxP2)] * 2, -1), jnp.concatenate([jnp.cos(angle_BxTxP2)] * 2, -1)
    return jnp.repeat(jnp.sin(angle_BxTxP2), 2, -1), jnp.repeat(jnp.cos(angle_BxTxP2), 2, -1)


def scaled_frequencies(inv_freq_P2: jax.Array, scaling: dict | None) -> jax.Array:
    """Rotary frequencies under HF's rope scaling: "linear" divides them by `factor`; "llama3" (Llama 3.1 on)
    divides the low ones (wavelengths over original_max_position_embeddings / low_freq_factor) by `factor`, keeps
    the high ones (under ... / high_freq_factor) and blends between."""
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if kind == "default":
        return inv_freq_P2
    factor = float(scaling["factor"])
    if kind == "linear":
        return inv_freq_P2 / factor
    original = float(scaling["original_max_position_embeddings"])
    low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
    wavelength_P2 = 2 * jnp.pi / inv_freq_P2
    scaled_P2 = jnp.where(wavelength_P2 > original / low, inv_freq_P2 / factor, inv_freq_P2)
    smooth_P2 = (original / wavelength_P2 - low) / (high - low)
    medium_P2 = (wavelength_P2 >= original / high) & (wavelength_P2 <= original / low)
    return jnp.where(medium_P2, (1 - smooth_P2) * scaled_P2 / factor + smooth_P2 * scaled_P2, scaled_P2)


def apply_rotary(x_BxTxHxK: jax.Array, sin_BxTxP: jax.Array, cos_BxTxP: jax.Array, half: bool = False) -> jax.Array:
    """Rotate the first P dims of each head: pairs (0,1), (2,3), ... as GPT-J does, or with `half` dims i and
    i + P/2 as GPT-NeoX does."""
    rot = sin_BxTxP.shape[-1]
    if rot == 0:
        return x_BxTxHxK
    x_rot, x_pass = x_BxTxHxK[..., :rot].astype(F32), x_BxTxHxK[..., rot:]
    if half:
        rotated = jnp.concatenate([-x_rot[..., rot // 2:], x_rot[..., :rot // 2]], -1)
    else:
        pairs = x_rot.reshape(*x_rot.shape[:-1], rot // 2, 2)
        rotated = jnp.stack([-pairs[..., 1], pairs[..., 0]], -1).reshape(x_rot.shape)
    x_rot = x_rot * cos_BxTxP[:, :, None] + rotated * sin_BxTxP[:, :, None]
    return jnp.concatenate([x_rot.astype(x_BxTxHxK.dtype), x_pass], -1)
