"""The GPT-J transformer: param tree, sharded init, forward, loss and gradients over a scan of layers."""
from __future__ import annotations

from functools import partial
from collections.abc import Callable

import jax
import jax.numpy as jnp
import optax
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from mesh_transformer import layers
from mesh_transformer.config import Config
from mesh_transformer.mesh import DP, MP

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


def param_shapes(cfg: Config, dtype=jnp.float32) -> dict:
    """The global param tree as ShapeDtypeStructs; layers stacked on a leading axis L."""
    L, D, F, V = cfg.layers, cfg.d_model, cfg.d_ff, cfg.n_vocab

    def s(*shape):
        return jax.ShapeDtypeStruct(shape, dtype)

    return {
        "embed": {"wte": s(V, D)},
        "layers": {
            "ln_1": {"scale": s(L, D), "bias": s(L, D)},
            "attn": {"q": s(L, D, D), "k": s(L, D, D), "v": s(L, D, D), "out": s(L, D, D)},
            "mlp": {"fc_in": {"kernel": s(L, D, F), "bias": s(L, F)},
                    "fc_out": {"kernel": s(L, F, D), "bias": s(L, D)}},
        },
        "ln_f": {"scale": s(D), "bias": s(D)},
        "lm_head": {"kernel": s(D, V), "bias": s(V)},
    }


def param_specs(cfg: Config) -> dict:
    """Megatron placement over 'mp': heads, MLP columns/rows and vocab split; LayerNorms and fc_out.bias replicated."""
    cols, rows = P(None, None, MP), P(None, MP, None)
    return {
        "embed": {"wte": P(MP, None)},
        "layers": {
            "ln_1": {"scale": P(), "bias": P()},
            "attn": {"q": cols, "k": cols, "v": cols, "out": rows},
            "mlp": {"fc_in": {"kernel": cols, "bias": P(None, MP)}, "fc_out": {"kernel": rows, "bias": P()}},
        },
        "ln_f": {"scale": P(), "bias": P()},
        "lm_head": {"kernel": P(None, MP), "bias": P(MP)},
    }


def param_shardings(cfg: Config, mesh: Mesh) -> dict:
    return jax.tree.map(lambda spec: NamedSharding(mesh, spec), param_specs(cfg))


def abstract_params(cfg: Config, mesh: Mesh, dtype=jnp.float32) -> dict:
    """Shapes, dtypes and shardings of the params on a mesh, allocating nothing."""
    return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                        param_shapes(cfg, dtype), param_shardings(cfg, mesh))


def _init_std(cfg: Config, path: tuple[str, ...]) -> float:
    """The original's truncated-normal scales; 0 means a zero bias, None a LayerNorm scale of one."""
    name = "/".join(path)
    D, V = cfg.d_model, cfg.n_vocab
    if name.endswith("bias"):
        return 0.0
    if name.endswith("scale"):
        return None
    if name == "embed/wte":
        return 1.0 / V ** 0.5
    if name.endswith(("attn/out", "fc_out/kernel")):
        return (2.0 / cfg.layers) / D ** 0.5
    return 1.0 / D ** 0.5


def _init(cfg: Config, key: jax.Array) -> dict:
    shapes = param_shapes(cfg)
    leaves, treedef = jax.tree_util.tree_flatten_with_path(shapes)
    keys = jax.random.split(key, len(leaves))
    out = []
    for k, (path, s) in zip(keys, leaves):
        std = _init_std(cfg, tuple(p.key for p in path))
        if std is None:
            out.append(jnp.ones(s.shape, s.dtype))
        elif std == 0.0:
            out.append(jnp.zeros(s.shape, s.dtype))
        else:
            out.append(std * jax.random.truncated_normal(k, -2.0, 2.0, s.shape, s.dtype))
    return jax.tree.unflatten(treedef, out)


def init(cfg: Config, mesh: Mesh, key: jax.Array) -> dict:
    """Random params created directly in their shards: no device or host ever holds the whole model."""
    return jax.jit(partial(_init, cfg), out_shardings=param_shardings(cfg, mesh))(key)


def init_unsharded(cfg: Config, key: jax.Array) -> dict:
    """The same params as `init` with the same key, on one device (for tests and tiny models)."""
    return jax.jit(partial(_init, cfg))(key)


def cast_for_compute(params: dict, cfg: Config) -> dict:
    return jax.tree.map(lambda x: x.astype(DTYPES[cfg.compute_dtype]), params)


def forward(params: dict, ids_BxT: jax.Array, cfg: Config, tp_axis: str | None = None) -> jax.Array:
    """Logits [B, T, V] in f32 (this device's vocab columns under tensor parallelism)."""
    params = cast_for_compute(params, cfg)
    h_BxTxD = layers.embed(ids_BxT, params["embed"]["wte"], tp_axis)
    positions_1xT = jnp.arange(ids_BxT.shape[1])[None]
    sincos = layers.rotary_sincos(positions_1xT, cfg.pe_rotary_dims)
    mask_1xTxT = layers.causal_mask(ids_BxT.shape[1])

    def step(h_BxTxD, layer_params):
        return layers.block(h_BxTxD, layer_params, cfg.head_dim, sincos, mask_1xTxT, tp_axis)[0], None

    if cfg.remat:
        step = jax.checkpoint(step, prevent_cse=False)
    h_BxTxD, _ = lax.scan(step, h_BxTxD, params["layers"])
    return layers.head(h_BxTxD, params["ln_f"], params["lm_head"])


def loss_fn(params: dict, tokens_BxT1: jax.Array, cfg: Config, tp_axis: str | None = None,
            dp_axis: str | None = None) -> jax.Array:
    """Mean next-token cross entropy of a [B, T+1] token batch (inputs [:-1], targets [1:])."""
    logits_BxTxV = forward(params, tokens_BxT1[:, :-1], cfg, tp_axis)
    loss = layers.cross_entropy(logits_BxTxV, tokens_BxT1[:, 1:], tp_axis).mean()
    return loss if dp_axis is None else lax.pmean(loss, dp_axis)


def shard_map_over(cfg: Config, mesh: Mesh, fn: Callable, in_specs, out_specs) -> Callable:
    """Run `fn` per device on the Megatron ('dp', 'mp') layout, checking varying/invariant values."""
    return jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=True)


def sharded_logits_fn(cfg: Config, mesh: Mesh) -> Callable:
    """Jitted (params, ids [B, T]) -> logits [B, T, V], batch split on dp and vocab on mp."""
    fn = partial(forward, cfg=cfg, tp_axis=MP)
    return jax.jit(shard_map_over(cfg, mesh, fn, (param_specs(cfg), P(DP, None)), P(DP, None, MP)))


def sharded_loss_fn(cfg: Config, mesh: Mesh) -> Callable:
    """Jitted (params, tokens [B, T+1]) -> mean loss, vocab-sharded cross entropy."""
    fn = partial(loss_fn, cfg=cfg, tp_axis=MP, dp_axis=DP)
    return jax.jit(shard_map_over(cfg, mesh, fn, (param_specs(cfg), P(DP, None)), P()))


def sharded_loss_and_grad_fn(cfg: Config, mesh: Mesh) -> Callable:
    """Loss and gradients computed per device; check_vma supplies the backward collectives."""
    specs = param_specs(cfg)
    fn = jax.value_and_grad(partial(loss_fn, cfg=cfg, tp_axis=MP, dp_axis=DP))
    return shard_map_over(cfg, mesh, fn, (specs, P(DP, None)), (P(), specs))


# Train state: {"step": int32 [], "params": tree, "opt_state": optax state}, every leaf placed on the mesh.


def _opt_state_shardings(abstract_opt_state, cfg: Config, mesh: Mesh):
    """Optimizer moments sit exactly where their params sit; counters are replicated."""
    by_path = {tuple(k.key for k in path): s for path, s in
               jax.tree_util.tree_flatten_with_path(param_shardings(cfg, mesh))[0]}
    replicated = NamedSharding(mesh, P())

    def place(path, leaf):
        dict_keys = tuple(k.key for k in path if isinstance(k, jax.tree_util.DictKey))
        return by_path.get(dict_keys, replicated) if leaf.ndim else replicated

    return jax.tree_util.tree_map_with_path(place, abstract_opt_state)


def abstract_train_state(cfg: Config, mesh: Mesh, optimizer) -> dict:
    """Shapes, dtypes and shardings of the whole train state, allocating nothing (for restore and AOT)."""
    params = abstract_params(cfg, mesh)
    opt_state = jax.eval_shape(optimizer.init, params)
    opt_shardings = _opt_state_shardings(opt_state, cfg, mesh)
    opt_state = jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), opt_state,
                             opt_shardings)
    step = jax.ShapeDtypeStruct((), jnp.int32, sharding=NamedSharding(mesh, P()))
    return {"step": step, "params": params, "opt_state": opt_state}


def _shardings(abstract) -> dict:
    return jax.tree.map(lambda s: s.sharding, abstract)


def init_opt_state(params: dict, cfg: Config, mesh: Mesh, optimizer):
    """Fresh optimizer state for `params`, created in place on the mesh."""
    shardings = _shardings(abstract_train_state(cfg, mesh, optimizer)["opt_state"])
    return jax.jit(optimizer.init, out_shardings=shardings)(params)


def init_train_state(cfg: Config, mesh: Mesh, optimizer, key: jax.Array) -> dict:
    params = init(cfg, mesh, key)
    step = jax.device_put(jnp.zeros((), jnp.int32), NamedSharding(mesh, P()))
    return {"step": step, "params": params, "opt_state": init_opt_state(params, cfg, mesh, optimizer)}


def batch_sharding(mesh: Mesh, accumulated: bool = True) -> NamedSharding:
    """Token batches [G, B, T+1] (or [B, T+1]) split over dp on the batch axis."""
    return NamedSharding(mesh, P(None, DP, None) if accumulated else P(DP, None))


def make_train_step(cfg: Config, mesh: Mesh, optimizer, schedule: Callable) -> Callable:
    """Jitted (state, tokens [G, B, T+1]) -> (state, metrics): gradients accumulated over G in f32, state donated."""
    loss_and_grad = sharded_loss_and_grad_fn(cfg, mesh)

    def step(state, tokens_GxBxT1):
        def micro(carry, tokens_BxT1):
            loss_sum, grad_sum = carry
            loss, grads = loss_and_grad(state["params"], tokens_BxT1)
            return (loss_sum + loss, jax.tree.map(jnp.add, grad_sum, grads)), None

        zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), state["params"])
        (loss_sum, grad_sum), _ = lax.scan(micro, (jnp.zeros((), jnp.float32), zeros), tokens_GxBxT1)
        n_micro = tokens_GxBxT1.shape[0]
        grads = jax.tree.map(lambda g: g / n_micro, grad_sum)
        updates, opt_state = optimizer.update(grads, state["opt_state"], state["params"])
        params = optax.apply_updates(state["params"], updates)
        metrics = {"loss": loss_sum / n_micro, "grad_norm": optax.global_norm(grads), "lr": schedule(state["step"])}
        return {"step": state["step"] + 1, "params": params, "opt_state": opt_state}, metrics

    shardings = _shardings(abstract_train_state(cfg, mesh, optimizer))
    return jax.jit(step, in_shardings=(shardings, batch_sharding(mesh)),
                   out_shardings=(shardings, NamedSharding(mesh, P())), donate_argnums=0)


def make_eval_step(cfg: Config, mesh: Mesh) -> Callable:
    """Jitted (params, tokens [B, T+1]) -> mean loss."""
    return sharded_loss_fn(cfg, mesh)
