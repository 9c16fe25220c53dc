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

from mesh_transformer.model import layers
from mesh_transformer.config import Config
from mesh_transformer.parallel.mesh import DP, MP

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}
HIDDEN_AXES = ("batch", "length", "embed")
LOGITS_AXES = ("batch", "length", "vocab")
# (x, logical axes) -> x placed as a parallelism mode wants; the GSPMD path passes one, the model never sees a mesh.
Constrain = Callable[[jax.Array, tuple[str, ...]], jax.Array]


def _unconstrained(x: jax.Array, logical_axes: tuple[str, ...]) -> jax.Array:
    return x


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


def unstacked_specs(specs: dict, n_layers: int) -> dict:
    """A param tree's specs (or shardings' specs) with "layers" as a list of per-layer trees, as `unstack_layers`."""
    layer = jax.tree.map(lambda spec: P(*spec[1:]), specs["layers"], is_leaf=lambda x: isinstance(x, P))
    return {**specs, "layers": [layer] * n_layers}


def unstack_layers(params: dict, split: Callable | None = None) -> dict:
    """The params with "layers" as a list of L per-layer trees, for inference programs that loop over the layers
    in Python. `split(stacked leaf) -> its L slices` (default: indexing) may also place or describe them."""
    split = split or (lambda x: [x[i] for i in range(x.shape[0])])
    stacked, treedef = jax.tree.flatten(params["layers"])
    slices = [split(x) for x in stacked]
    return {**params, "layers": [jax.tree.unflatten(treedef, list(layer)) for layer in zip(*slices)]}


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


def init_params(cfg: Config, key: jax.Array) -> dict:
    """Random params by the original's scales, as global arrays; jit it with out_shardings to create them sharded."""
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
    return jax.jit(partial(init_params, cfg), out_shardings=param_shardings(cfg, mesh))(key)


def init_unsharded(cfg: Config, key: jax.Array) -> dict:
    """The same params as `init` with the same key, on one device (for tests and tiny models)."""
    return jax.jit(partial(init_params, cfg))(key)


def cast_for_compute(params: dict, cfg: Config) -> dict:
    return jax.tree.map(lambda x: x.astype(DTYPES[cfg.compute_dtype]), params)


def forward(params: dict, ids_BxT: jax.Array, cfg: Config, tp_axis: str | None = None,
            constrain: Constrain | None = None) -> jax.Array:
    """Logits [B, T, V] in f32 (this device's vocab columns under tensor parallelism).

    `constrain` pins activations between layers (GSPMD): under FSDP that makes XLA gather one layer's weights per
    scan iteration instead of splitting the activations like the weights.
    """
    constrain = constrain or _unconstrained
    params = cast_for_compute(params, cfg)
    h_BxTxD = hidden(params, ids_BxT, cfg, tp_axis, constrain)
    return constrain(layers.head(h_BxTxD, params["ln_f"], params["lm_head"]), LOGITS_AXES)


def hidden(params: dict, ids_BxT: jax.Array, cfg: Config, tp_axis: str | None, constrain: Constrain) -> jax.Array:
    """The last block's output [B, T, D], before the final LayerNorm; params already in the compute dtype."""
    h_BxTxD = constrain(layers.embed(ids_BxT, params["embed"]["wte"], tp_axis), HIDDEN_AXES)
    positions_1xT = jnp.arange(ids_BxT.shape[1])[None]
    sincos = layers.rotary_sincos(positions_1xT, cfg.pe_rotary_dims)
    mask_1xTxT = layers.causal_mask(ids_BxT.shape[1])

    def step(h_BxTxD, layer_params):
        h_BxTxD = layers.block(h_BxTxD, layer_params, cfg.head_dim, sincos, mask_1xTxT, tp_axis)[0]
        return constrain(h_BxTxD, HIDDEN_AXES), None

    if cfg.remat:
        step = jax.checkpoint(step, prevent_cse=False)
    return lax.scan(step, h_BxTxD, params["layers"])[0]


def loss_fn(params: dict, tokens_BxT1: jax.Array, cfg: Config, tp_axis: str | None = None,
            dp_axis: str | None = None, constrain: Constrain | None = None) -> jax.Array:
    """Mean next-token cross entropy of a [B, T+1] token batch (inputs [:-1], targets [1:])."""
    constrain = constrain or _unconstrained
    params = cast_for_compute(params, cfg)
    h_BxTxD = hidden(params, tokens_BxT1[:, :-1], cfg, tp_axis, constrain)
    pin_logits = None if constrain is _unconstrained else (lambda logits: constrain(logits, LOGITS_AXES))
    ce_BxT = layers.head_cross_entropy(h_BxTxD, params["ln_f"], params["lm_head"], tokens_BxT1[:, 1:], tp_axis,
                                       pin_logits)
    loss = ce_BxT.mean()
    return loss if dp_axis is None else lax.pmean(loss, dp_axis)


def shard_map_over(mesh: Mesh, fn: Callable, in_specs, out_specs) -> Callable:
    """Run `fn` per device on the Megatron ('dp', 'mp') layout, checking varying/invariant values."""
    return jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=True)


def sharded_logits_fn(cfg: Config, mesh: Mesh) -> Callable:
    """Jitted (params, ids [B, T]) -> logits [B, T, V], batch split on dp and vocab on mp."""
    fn = partial(forward, cfg=cfg, tp_axis=MP)
    return jax.jit(shard_map_over(mesh, fn, (param_specs(cfg), P(DP, None)), P(DP, None, MP)))


def sharded_loss_fn(cfg: Config, mesh: Mesh) -> Callable:
    """Jitted (params, tokens [B, T+1]) -> mean loss, vocab-sharded cross entropy."""
    fn = partial(loss_fn, cfg=cfg, tp_axis=MP, dp_axis=DP)
    return jax.jit(shard_map_over(mesh, fn, (param_specs(cfg), P(DP, None)), P()))


def sharded_loss_and_grad_fn(cfg: Config, mesh: Mesh) -> Callable:
    """Loss and gradients computed per device; check_vma supplies the backward collectives."""
    specs = param_specs(cfg)
    fn = jax.value_and_grad(partial(loss_fn, cfg=cfg, tp_axis=MP, dp_axis=DP))
    return shard_map_over(mesh, fn, (specs, P(DP, None)), (P(), specs))


# Train state: {"step": int32 [], "params": tree, "opt_state": optax state}, every leaf placed on the mesh.


def follow_params(abstract_opt_state, abstract_params: dict, replicated: NamedSharding):
    """Optimizer-state shardings: a leaf at a param's path and of its shape (a moment) sits like that param; the
    rest (counters) is replicated."""
    by_path = {tuple(k.key for k in path): s for path, s in jax.tree_util.tree_flatten_with_path(abstract_params)[0]}

    def place(path, leaf):
        param = by_path.get(tuple(k.key for k in path if isinstance(k, jax.tree_util.DictKey)))
        return param.sharding if param is not None and param.shape == leaf.shape else replicated

    return jax.tree_util.tree_map_with_path(place, abstract_opt_state)


def train_state_of(params: dict, optimizer, mesh: Mesh) -> dict:
    """Abstract {"step", "params", "opt_state"} for abstract params placed on `mesh` (any layout)."""
    replicated = NamedSharding(mesh, P())
    opt_state = jax.eval_shape(optimizer.init, params)
    opt_state = jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), opt_state,
                             follow_params(opt_state, params, replicated))
    return {"step": jax.ShapeDtypeStruct((), jnp.int32, sharding=replicated), "params": params,
            "opt_state": opt_state}


def abstract_train_state(cfg: Config, mesh: Mesh, optimizer) -> dict:
    """Shapes, dtypes and shardings of the whole train state, allocating nothing (for restore and AOT)."""
    return train_state_of(abstract_params(cfg, mesh), optimizer, mesh)


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


def accumulated_train_step(loss_and_grad: Callable, optimizer, schedule: Callable) -> Callable:
    """(state, tokens [G, B, T+1]) -> (state, metrics): gradients of G micro-batches summed in f32, one update."""
    def step(state, tokens_GxBxT1):
        def micro(carry, tokens_BxT1):
            loss_sum, grad_sum = carry
            loss, grads = loss_and_grad(state["params"], tokens_BxT1)
            return (loss_sum + loss, jax.tree.map(jnp.add, grad_sum, grads)), None

        n_micro = tokens_GxBxT1.shape[0]
        if n_micro == 1:  # no accumulator: the gradients go straight into the update
            loss_sum, grad_sum = loss_and_grad(state["params"], tokens_GxBxT1[0])
        else:
            zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), state["params"])
            (loss_sum, grad_sum), _ = lax.scan(micro, (jnp.zeros((), jnp.float32), zeros), tokens_GxBxT1)
        grads = jax.tree.map(lambda g: g / n_micro, grad_sum)
        updates, opt_state = optimizer.update(grads, state["opt_state"], state["params"])
        params = optax.apply_updates(state["params"], updates)
        metrics = {"loss": loss_sum / n_micro, "grad_norm": optax.global_norm(grads), "lr": schedule(state["step"])}
        return {"step": state["step"] + 1, "params": params, "opt_state": opt_state}, metrics

    return step


def jit_train_step(step: Callable, abstract_state: dict, batch: NamedSharding) -> Callable:
    """Jit a train step with the state's shardings in and out, the state donated, metrics replicated."""
    shardings = _shardings(abstract_state)
    mesh = batch.mesh
    return jax.jit(step, in_shardings=(shardings, batch), out_shardings=(shardings, NamedSharding(mesh, P())),
                   donate_argnums=0)


def make_train_step(cfg: Config, mesh: Mesh, optimizer, schedule: Callable) -> Callable:
    """Jitted (state, tokens [G, B, T+1]) -> (state, metrics) on the shard_map path, state donated."""
    step = accumulated_train_step(sharded_loss_and_grad_fn(cfg, mesh), optimizer, schedule)
    return jit_train_step(step, abstract_train_state(cfg, mesh, optimizer), batch_sharding(mesh))


def make_eval_step(cfg: Config, mesh: Mesh) -> Callable:
    """Jitted (params, tokens [B, T+1]) -> mean loss."""
    return sharded_loss_fn(cfg, mesh)
