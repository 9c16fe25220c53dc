"""The original optimizer: clipped Adam with decoupled weight decay on weight matrices, GPT-3 style schedule."""
from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import optax

from mesh_transformer.config import Config
from mesh_transformer.model import table


def lr_schedule(cfg: Config) -> Callable[[jax.Array], jax.Array]:
    """Linear warmup to lr over warmup_steps, cosine to end_lr over anneal_steps, then end_lr (the original's)."""
    warmup, anneal, peak, end = cfg.warmup_steps, cfg.anneal_steps, cfg.lr, cfg.end_lr

    def schedule(step):
        step = jnp.asarray(step, jnp.float32)
        warmup_frac = jnp.clip(step, 0, warmup) / warmup if warmup else 1.0
        anneal_frac = jnp.clip(step - warmup, 0, anneal) / max(anneal, 1)
        return warmup_frac * peak - (peak - end) * (1 - jnp.cos(jnp.pi * anneal_frac)) / 2

    return schedule


def decay_mask(params: dict, cfg: Config) -> dict:
    """True for the leaves weight decay applies to: the params the config's table marks decayed (weight matrices;
    biases and LayerNorm params, 2-D too once stacked, never), not LoRA adapters."""
    rows = table.params_table(cfg)

    def decayed(path, _):
        row = rows.get(tuple(k.key for k in path))
        return row is not None and row.decayed

    return jax.tree_util.tree_map_with_path(decayed, params)


def make_optimizer(cfg: Config) -> optax.GradientTransformation:
    """clip_by_global_norm(1) -> Adam(0.9, 0.999, 1e-8) -> decoupled weight decay (masked) -> -lr(step)."""
    return optax.chain(
        optax.clip_by_global_norm(1.0),
        optax.scale_by_adam(b1=0.9, b2=0.999, eps=1e-8),
        optax.add_decayed_weights(cfg.weight_decay, mask=functools.partial(decay_mask, cfg=cfg)),
        optax.scale_by_learning_rate(lr_schedule(cfg)),
    )
