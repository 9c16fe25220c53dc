"""The GSPMD path: logical axes, one rule table per parallelism mode, shardings, and jitted train/eval steps.

The model names logical axes only; a mode's rule table maps them to the mesh axes ('data', 'fsdp', 'tensor'),
t5x style. For each dim of an array the first rule naming its logical axis whose mesh axes are still free in that
array wins; a logical axis with no usable rule is replicated. So ("embed", "fsdp") shards the params' embed dim
(ZeRO-3: params and optimizer state split over fsdp), while an activation [batch, length, embed] keeps embed whole
because its batch dim has already taken 'fsdp': pinned so inside the layer scan, XLA gathers one layer's weights per
iteration and keeps the batch split. Params stay global arrays of their logical shapes; only their placement
changes with the mode.

The steps jit the plain global `model.loss_fn` (tp_axis=None) with in/out shardings from the table, so every
mode computes the single-device result. The parallelism mode is `cfg.parallelism`.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from functools import partial

import jax
import jax.numpy as jnp
import optax
from jax import lax
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from mesh_transformer.model import gptj as model
from mesh_transformer.config import Config, ConfigError

DATA, FSDP, TENSOR = "data", "fsdp", "tensor"
MESH_AXES = (DATA, FSDP, TENSOR)

Rules = list[tuple[str, str | tuple[str, ...] | None]]

BATCH_RULES: Rules = [("batch", (DATA, FSDP))]  # fsdp is data parallel for compute, so the batch splits over it too
ZERO3_RULES: Rules = [("embed", FSDP)]  # taken by params; activations find 'fsdp' used by their batch dim
TENSOR_RULES: Rules = [("vocab", TENSOR), ("heads", TENSOR), ("mlp", TENSOR)]
RULES: dict[str, Rules] = {
    "dp": BATCH_RULES,
    "fsdp": BATCH_RULES + ZERO3_RULES,
    "tp": BATCH_RULES + TENSOR_RULES,
    "fsdp_tp": BATCH_RULES + ZERO3_RULES + TENSOR_RULES,
}
MODES = tuple(RULES)

# Logical axes of activations and caches, for constraints (K head dim and length are never split).
ACTIVATION_AXES = {
    "tokens": ("batch", "length"),
    "hidden": ("batch", "length", "embed"),
    "heads": ("batch", "length", "heads", "head_dim"),
    "mlp": ("batch", "length", "mlp"),
    "logits": ("batch", "length", "vocab"),
    "kv_cache": ("batch", "heads", "head_dim", "length"),  # one layer's
}


def param_logical_axes() -> dict:
    """Logical axis names of every param, in the tree of `model.param_shapes` (layers stacked on 'layers')."""
    qkv, stacked = ("layers", "embed", "heads"), ("layers", "embed")
    return {
        "embed": {"wte": ("vocab", "embed")},
        "layers": {
            "ln_1": {"scale": stacked, "bias": stacked},
            "attn": {"q": qkv, "k": qkv, "v": qkv, "out": ("layers", "heads", "embed")},
            "mlp": {"fc_in": {"kernel": ("layers", "embed", "mlp"), "bias": ("layers", "mlp")},
                    "fc_out": {"kernel": ("layers", "mlp", "embed"), "bias": stacked}},
        },
        "ln_f": {"scale": ("embed",), "bias": ("embed",)},
        "lm_head": {"kernel": ("embed", "vocab"), "bias": ("vocab",)},
    }


def is_logical_axes(x) -> bool:
    """True for a leaf of `param_logical_axes` (a tuple of names, which jax.tree would otherwise walk into)."""
    return isinstance(x, tuple) and all(isinstance(a, str) for a in x)


def _mesh_axes(entry: str | tuple[str, ...] | None) -> tuple[str, ...]:
    return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def logical_to_spec(logical_axes: Sequence[str], rules: Rules) -> P:
    """The PartitionSpec of one array: per dim, the first rule for its logical axis whose mesh axes are still free."""
    used: set[str] = set()
    spec = []
    for name in logical_axes:
        choice = None
        for rule_name, entry in rules:
            if rule_name == name and used.isdisjoint(_mesh_axes(entry)):
                choice = entry
                break
        used.update(_mesh_axes(choice))
        spec.append(choice)
    return P(*spec)


def rules_for(cfg: Config) -> Rules:
    """The rule table of cfg.parallelism."""
    if cfg.parallelism not in RULES:
        raise ConfigError(f"config key 'parallelism' must be one of {', '.join(MODES)} for the GSPMD path, "
                          f"got {cfg.parallelism!r}")
    return RULES[cfg.parallelism]


def make_mesh(data: int | None = None, fsdp: int = 1, tensor: int = 1,
              devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A ('data', 'fsdp', 'tensor') mesh of Auto axes; data=None takes the devices fsdp x tensor leaves."""
    devices = list(jax.devices() if devices is None else devices)
    if data is None:
        if len(devices) % (fsdp * tensor):
            raise ConfigError(f"fsdp x tensor ({fsdp} x {tensor}) must divide the device count ({len(devices)})")
        data = len(devices) // (fsdp * tensor)
    if min(data, fsdp, tensor) < 1 or data * fsdp * tensor > len(devices):
        raise ConfigError(f"mesh data={data}, fsdp={fsdp}, tensor={tensor} needs {data * fsdp * tensor} devices; "
                          f"{len(devices)} are available")
    # jax.make_mesh orders devices by physical topology (tensor and fsdp on the fastest links, data across hosts);
    # Auto axes: shardings are placed by us and propagated by XLA, where make_mesh would default to Explicit.
    return jax.make_mesh((data, fsdp, tensor), MESH_AXES, axis_types=(AxisType.Auto,) * 3,
                         devices=devices[: data * fsdp * tensor])


def mesh_for(cfg: Config, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """The ('data', 'fsdp', 'tensor') mesh of a GSPMD config: data takes the devices fsdp x tensor leave."""
    from mesh_transformer.config import check_devices

    check_devices(cfg, len(jax.devices() if devices is None else devices))
    return make_mesh(None, cfg.mesh_fsdp, cfg.mesh_tensor, devices)


def batch_shards(mesh: Mesh) -> int:
    """How many ways the batch is split: data x fsdp."""
    return mesh.shape[DATA] * mesh.shape[FSDP]


def global_batch(cfg: Config, mesh: Mesh) -> int:
    """Sequences per micro-batch: per_replica_batch for each batch shard."""
    return cfg.per_replica_batch * batch_shards(mesh)


def check(cfg: Config, mesh: Mesh) -> None:
    """The mode must use every split mesh axis, and each split model dim must divide over its mesh axes."""
    rules = rules_for(cfg)
    ruled = {a for _, entry in rules for a in _mesh_axes(entry)}
    for axis in MESH_AXES:
        if mesh.shape[axis] > 1 and axis not in ruled:
            raise ConfigError(f"parallelism {cfg.parallelism!r} does not use mesh axis '{axis}' of size "
                              f"{mesh.shape[axis]}; choose a mode that does ({', '.join(MODES)}) or size it 1")
    sizes = {"embed": ("d_model", cfg.d_model), "heads": ("n_heads", cfg.n_heads),
             "mlp": ("d_ff = 4 d_model", cfg.d_ff), "vocab": ("n_vocab", cfg.n_vocab)}
    for name, entry in rules:
        if name in sizes:
            key, size = sizes[name]
            split = math.prod(mesh.shape[a] for a in _mesh_axes(entry))
            if size % split:
                raise ConfigError(f"{key} ({size}) must be divisible by the {'x'.join(_mesh_axes(entry))} mesh size "
                                  f"({split}) under parallelism {cfg.parallelism!r}")


def logical_sharding(cfg: Config, mesh: Mesh, logical_axes: Sequence[str]) -> NamedSharding:
    """The NamedSharding of one array with these logical axes under cfg.parallelism."""
    return NamedSharding(mesh, logical_to_spec(logical_axes, rules_for(cfg)))


def param_specs(cfg: Config) -> dict:
    """PartitionSpecs of the param tree under cfg.parallelism."""
    rules = rules_for(cfg)
    return jax.tree.map(lambda axes: logical_to_spec(axes, rules), param_logical_axes(), is_leaf=is_logical_axes)


def param_shardings(cfg: Config, mesh: Mesh) -> dict:
    check(cfg, mesh)
    return jax.tree.map(lambda spec: NamedSharding(mesh, spec), param_specs(cfg))


def abstract_params(cfg: Config, mesh: Mesh, dtype=jnp.float32) -> dict:
    """Shapes, dtypes and shardings of the params, allocating nothing."""
    return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                        model.param_shapes(cfg, dtype), param_shardings(cfg, mesh))


def batch_sharding(mesh: Mesh, accumulated: bool = True) -> NamedSharding:
    """Token batches [G, B, T+1] (or [B, T+1]) split on the batch axis (the same rule in every mode)."""
    return NamedSharding(mesh, logical_to_spec(("accumulation",) * accumulated + ACTIVATION_AXES["tokens"],
                                               BATCH_RULES))


def _shardings(abstract):
    return jax.tree.map(lambda s: s.sharding, abstract)


def abstract_train_state(cfg: Config, mesh: Mesh, optimizer: optax.GradientTransformation) -> dict:
    """Shapes, dtypes and shardings of {"step", "params", "opt_state"}, allocating nothing (restore, AOT)."""
    return model.train_state_of(abstract_params(cfg, mesh), optimizer, mesh)


def init(cfg: Config, mesh: Mesh, key: jax.Array) -> dict:
    """Random params made directly in their shards; the same numbers as `model.init` with the same key."""
    return jax.jit(partial(model.init_params, cfg), out_shardings=param_shardings(cfg, mesh))(key)


def init_opt_state(params: dict, cfg: Config, mesh: Mesh, optimizer: optax.GradientTransformation):
    """Fresh optimizer state for `params`, made in place on the mesh."""
    shardings = _shardings(abstract_train_state(cfg, mesh, optimizer)["opt_state"])
    return jax.jit(optimizer.init, out_shardings=shardings)(params)


def init_train_state(cfg: Config, mesh: Mesh, optimizer: optax.GradientTransformation, key: jax.Array) -> dict:
    """{"step": 0, "params", "opt_state"} on the mesh; the same numbers as `model.init_train_state`."""
    params = init(cfg, mesh, key)
    step = jax.device_put(jnp.zeros((), jnp.int32), NamedSharding(mesh, P()))
    return {"step": step, "params": params, "opt_state": init_opt_state(params, cfg, mesh, optimizer)}


def constrain_fn(cfg: Config, mesh: Mesh) -> Callable[[jax.Array, Sequence[str]], jax.Array]:
    """(x, logical_axes) -> x pinned to the rule table's placement: the hook for activations inside the model."""
    return lambda x, logical_axes: lax.with_sharding_constraint(x, logical_sharding(cfg, mesh, logical_axes))


def loss_fn(cfg: Config, mesh: Mesh) -> Callable:
    """(params, tokens [B, T+1]) -> mean loss: the global `model.loss_fn` with the batch split and, once the model
    takes it, the activation hook that makes FSDP gather each layer's weights inside the scan."""
    check(cfg, mesh)
    constrain = constrain_fn(cfg, mesh)

    def loss(params, tokens_BxT1):
        return model.loss_fn(params, constrain(tokens_BxT1, ACTIVATION_AXES["tokens"]), cfg, constrain=constrain)

    return loss


def loss_and_grad_fn(cfg: Config, mesh: Mesh) -> Callable:
    """(params, tokens [B, T+1]) -> (loss, grads), grads kept where their params are (FSDP reduce-scatters them)."""
    grad_shardings = param_shardings(cfg, mesh)
    value_and_grad = jax.value_and_grad(loss_fn(cfg, mesh))

    def fn(params, tokens_BxT1):
        loss, grads = value_and_grad(params, tokens_BxT1)
        return loss, lax.with_sharding_constraint(grads, grad_shardings)

    return fn


def make_train_step(cfg: Config, mesh: Mesh, optimizer: optax.GradientTransformation,
                    schedule: Callable) -> Callable:
    """Jitted (state, tokens [G, B, T+1]) -> (state, metrics) over the GSPMD layout, state donated."""
    step = model.accumulated_train_step(loss_and_grad_fn(cfg, mesh), optimizer, schedule)
    return model.jit_train_step(step, abstract_train_state(cfg, mesh, optimizer), batch_sharding(mesh))


def make_eval_step(cfg: Config, mesh: Mesh) -> Callable:
    """Jitted (params, tokens [B, T+1]) -> mean loss."""
    return jax.jit(loss_fn(cfg, mesh), in_shardings=(param_shardings(cfg, mesh), batch_sharding(mesh, False)),
                   out_shardings=NamedSharding(mesh, P()))
