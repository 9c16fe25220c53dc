"""Layout: what a parallelism mode decides, and nothing else: the mesh, where every param / optimizer leaf / batch /
activation lives, and the loss, loss-and-grad and logits functions that run there.

Both kinds place arrays by one rule table each, t5x style: the model names logical axes only (model/gptj.py), and
for each dim of an array the first rule naming its logical axis whose mesh axes are still free in that array wins;
a logical axis with no usable rule is replicated.

- shard_map kind (the original's Megatron scheme) over ('dp', 'mp'): vocab, heads and MLP columns on 'mp', tokens
  on 'dp'. The layer functions run per device under `jax.shard_map(..., check_vma=True)` with tp_axis='mp', doing
  one psum per block; check_vma gives the matching backward collectives.
- GSPMD kind over ('data', 'fsdp', 'tensor'): the plain global layer functions under `jax.jit`, with shardings from
  the mode's table and activations pinned through a `constrain` hook. ("embed", "fsdp") shards the params' embed dim
  (ZeRO-3), while an activation [batch, length, embed] keeps embed whole because its batch dim has already taken
  'fsdp': pinned so inside the layer scan, XLA gathers one layer's weights per iteration and keeps the batch split.

Everything above this (train state, steps, AOT, converters, inference placement) takes a Layout and never asks
which kind it is.
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from functools import partial

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from mesh_transformer import platforms
from mesh_transformer.config import Config, ConfigError, check_devices
from mesh_transformer.model import gptj, lora
from mesh_transformer.parallel.mesh import DATA, DP, FSDP, MP, TENSOR, make_mesh
from mesh_transformer.platforms import Policy

Rules = list[tuple[str, str | tuple[str, ...] | None]]

SHARD_MAP = "shard_map"
MEGATRON_RULES: Rules = [("batch", DP), ("vocab", MP), ("heads", MP), ("mlp", MP)]
BATCH_RULES: Rules = [("batch", (DATA, FSDP))]  # fsdp is data parallel for compute, so the batch splits over it too
ZERO3_RULES: Rules = [("embed", FSDP)]  # taken by params; activations find 'fsdp' used by their batch dim
TENSOR_RULES: Rules = [("vocab", TENSOR), ("heads", TENSOR), ("mlp", TENSOR)]
GSPMD_RULES: dict[str, Rules] = {
    "dp": BATCH_RULES,
    "fsdp": BATCH_RULES + ZERO3_RULES,
    "tp": BATCH_RULES + TENSOR_RULES,
    "fsdp_tp": BATCH_RULES + ZERO3_RULES + TENSOR_RULES,
}
MODES = tuple(GSPMD_RULES)

# Logical axes of activations and caches (K head dim and length are never split).
ACTIVATION_AXES = {
    "tokens": ("batch", "length"),
    "hidden": ("batch", "length", "embed"),
    "heads": ("batch", "length", "heads", "head_dim"),
    "mlp": ("batch", "length", "mlp"),
    "logits": ("batch", "length", "vocab"),
    "kv_cache": ("batch", "heads", "head_dim", "length"),  # one block of one layer's
}


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


def param_specs(rules: Rules) -> dict:
    """PartitionSpecs of the param tree under a rule table (no mesh needed: converters write pieces by them)."""
    return jax.tree.map(lambda axes: logical_to_spec(axes, rules), gptj.PARAM_AXES, is_leaf=gptj.is_axes)


def followed_param(key_path: Sequence[str], shape: Sequence[int],
                   param_shapes: Mapping[gptj.Path, Sequence[int]]) -> gptj.Path | None:
    """The param an optimizer leaf is placed like: the one whose path ends the leaf's key path and whose shape is the
    leaf's (an Adam moment); None for the rest (counters), which are replicated or kept whole."""
    for start in range(len(key_path)):
        param = tuple(key_path[start:])
        if param in param_shapes and tuple(param_shapes[param]) == tuple(shape):
            return param
    return None


def unstacked(specs: dict, n_layers: int) -> dict:
    """A param-shaped tree of specs with "layers" as a list of per-layer trees (the leading L dropped), as
    `gptj.unstack_layers` makes of the params."""
    layer = jax.tree.map(lambda spec: P(*spec[1:]), specs["layers"], is_leaf=lambda x: isinstance(x, P))
    return {**specs, "layers": [layer] * n_layers}


@dataclasses.dataclass(frozen=True, eq=False)
class Layout:
    """One parallelism mode on one mesh. Build it with `make_layout`."""
    cfg: Config  # compute_dtype "auto" resolved for the mesh's devices
    mesh: Mesh
    rules: Rules
    tp_axis: str | None  # the tensor-parallel axis the layers reduce over (shard_map kind), else None
    dp_axis: str | None  # the batch axis a per-device loss is averaged over (shard_map kind), else None
    policy: Policy  # the platform choices of the mesh's devices (mesh_transformer.platforms)

    # ----------------------------------------------------------------------------------------------- placement
    def spec(self, logical_axes: Sequence[str]) -> P:
        return logical_to_spec(logical_axes, self.rules)

    def sharding(self, logical_axes: Sequence[str]) -> NamedSharding:
        """Where an array with these logical axes lives (activations, caches, per-row values)."""
        return NamedSharding(self.mesh, self.spec(logical_axes))

    @property
    def replicated(self) -> NamedSharding:
        return NamedSharding(self.mesh, P())

    def param_specs(self) -> dict:
        return param_specs(self.rules)

    def param_shardings(self) -> dict:
        return jax.tree.map(partial(NamedSharding, self.mesh), self.param_specs())

    def abstract_params(self, dtype=jnp.float32) -> dict:
        """Shapes, dtypes and shardings of the params, allocating nothing."""
        return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                            gptj.param_shapes(self.cfg, dtype), self.param_shardings())

    def init_params(self, key: jax.Array) -> dict:
        """Random params made directly in their shards (no device holds the whole model); the same numbers as
        `gptj.init_unsharded` with the same key."""
        return jax.jit(partial(gptj.init_params, self.cfg), out_shardings=self.param_shardings())(key)

    def lora_specs(self) -> dict:
        """PartitionSpecs of the adapters (model/lora.py) under the same rules as the params."""
        return jax.tree.map(self.spec, lora.lora_axes(self.cfg), is_leaf=gptj.is_axes)

    def abstract_lora(self) -> dict:
        """Shapes, dtypes (f32) and shardings of the adapters, allocating nothing."""
        return jax.tree.map(lambda s, spec: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=NamedSharding(
            self.mesh, spec)), lora.lora_shapes(self.cfg), self.lora_specs())

    def init_lora(self, key: jax.Array) -> dict:
        """Fresh adapters (A normal, B zeros) made in their shards."""
        shardings = jax.tree.map(lambda s: s.sharding, self.abstract_lora())
        return jax.jit(partial(lora.init_lora, self.cfg), out_shardings=shardings)(key)

    def follow_params(self, abstract_tree, abstract_params: dict):
        """Shardings of a tree of optimizer leaves: a leaf at a param's path and of its shape (an Adam moment) sits
        like that param; the rest (counters) is replicated."""
        flat = jax.tree_util.tree_flatten_with_path(abstract_params)[0]
        by_path = {tuple(k.key for k in path): s for path, s in flat}
        shapes = {path: s.shape for path, s in by_path.items()}

        def place(path, leaf):
            keys = [k.key for k in path if isinstance(k, jax.tree_util.DictKey)]
            param = followed_param(keys, leaf.shape, shapes)
            return self.replicated if param is None else by_path[param].sharding

        return jax.tree_util.tree_map_with_path(place, abstract_tree)

    @property
    def batch_shards(self) -> int:
        """How many ways a batch is split."""
        return math.prod(self.mesh.shape[a] for a in _mesh_axes(self.spec(("batch",))[0]))

    @property
    def global_batch(self) -> int:
        """Sequences per micro-batch: per_replica_batch for each batch shard."""
        return self.cfg.per_replica_batch * self.batch_shards

    def batch_sharding(self, accumulated: bool = True) -> NamedSharding:
        """Token batches [G, B, T+1] (or [B, T+1]) split on the batch axis."""
        return self.sharding(("accumulation",) * accumulated + ACTIVATION_AXES["tokens"])

    # ------------------------------------------------------------------------------------------------ functions
    def _per_device(self, fn: Callable, in_specs, out_specs) -> Callable:
        return jax.shard_map(fn, mesh=self.mesh, in_specs=in_specs, out_specs=out_specs, check_vma=True)

    def _constrain(self, x: jax.Array, logical_axes: Sequence[str]) -> jax.Array:
        return lax.with_sharding_constraint(x, self.sharding(logical_axes))

    def _loss(self, model_loss: Callable, arg_specs: tuple) -> Callable:
        """(*param trees, tokens [B, T+1]) -> mean loss of `model_loss(*trees, tokens, cfg, ...)` (not jitted)."""
        cfg, tokens_spec = self.cfg, self.spec(ACTIVATION_AXES["tokens"])
        if self.tp_axis is not None:
            fn = partial(model_loss, cfg=cfg, tp_axis=self.tp_axis, dp_axis=self.dp_axis, policy=self.policy)
            return self._per_device(fn, (*arg_specs, tokens_spec), P())

        def loss(*args, **kw):
            *trees, tokens_BxT1 = args
            tokens_BxT1 = self._constrain(tokens_BxT1, ACTIVATION_AXES["tokens"])
            return model_loss(*trees, tokens_BxT1, cfg, constrain=self._constrain, policy=self.policy, **kw)

        return loss

    def _loss_and_grad(self, model_loss: Callable, arg_specs: tuple, accumulate: bool = False) -> Callable:
        """`_loss` with the gradients w.r.t. its first tree only, placed like that tree. With `accumulate`: one more
        argument after the tokens, a gradient sum placed like the first tree, and the gradients come out added to
        it (the layers' inside their backward, so no second set of layer gradients is held: `gptj.hidden`)."""
        if self.tp_axis is not None:
            loss = partial(model_loss, cfg=self.cfg, tp_axis=self.tp_axis, dp_axis=self.dp_axis, policy=self.policy)
        else:
            loss = self._loss(model_loss, arg_specs)
        shardings = jax.tree.map(partial(NamedSharding, self.mesh), arg_specs[0])

        def fn(*args):
            if accumulate:
                *args, grad_sum = args
                value, grads = _value_and_grad_into(loss, args, grad_sum, bool(self.cfg.lora_rank))
            else:
                value, grads = jax.value_and_grad(loss)(*args)
            return value, grads if self.tp_axis is not None else lax.with_sharding_constraint(grads, shardings)

        if self.tp_axis is None:
            return fn
        in_specs = (*arg_specs, self.spec(ACTIVATION_AXES["tokens"])) + ((arg_specs[0],) if accumulate else ())
        return self._per_device(fn, in_specs, (P(), arg_specs[0]))

    def loss_fn(self) -> Callable:
        """(params, tokens [B, T+1]) -> mean loss (not jitted)."""
        return self._loss(gptj.loss_fn, (self.param_specs(),))

    def loss_and_grad_fn(self, accumulate: bool = False) -> Callable:
        """(params, tokens [B, T+1]) -> (loss, grads), grads placed like their params (FSDP reduce-scatters them).
        With `accumulate`: (params, tokens, grad_sum) -> (loss, grad_sum + grads)."""
        return self._loss_and_grad(gptj.loss_fn, (self.param_specs(),), accumulate)

    def lora_loss_fn(self) -> Callable:
        """(adapters, base params, tokens [B, T+1]) -> mean loss of the adapted model (not jitted)."""
        return self._loss(_adapted_loss, (self.lora_specs(), self.param_specs()))

    def lora_loss_and_grad_fn(self, accumulate: bool = False) -> Callable:
        """(adapters, base params, tokens) -> (loss, grads of the adapters): the base is a constant of the loss,
        never differentiated. Under shard_map the adapters' partial sums join each block's one psum. With
        `accumulate`: (adapters, base, tokens, grad_sum) -> (loss, grad_sum + grads)."""
        return self._loss_and_grad(_adapted_loss, (self.lora_specs(), self.param_specs()), accumulate)

    def logits_fn(self) -> Callable:
        """Jitted (params, ids [B, T]) -> logits [B, T, V] in f32, placed by the rules (batch and vocab split)."""
        cfg, logits_spec = self.cfg, self.spec(ACTIVATION_AXES["logits"])
        if self.tp_axis is not None:
            fn = partial(gptj.forward, cfg=cfg, tp_axis=self.tp_axis, policy=self.policy)
            return jax.jit(self._per_device(fn, (self.param_specs(), self.spec(ACTIVATION_AXES["tokens"])),
                                            logits_spec))

        def logits(params, ids_BxT):
            return gptj.forward(params, self._constrain(ids_BxT, ACTIVATION_AXES["tokens"]), cfg,
                                constrain=self._constrain, policy=self.policy)

        return jax.jit(logits, in_shardings=(self.param_shardings(), self.sharding(ACTIVATION_AXES["tokens"])),
                       out_shardings=NamedSharding(self.mesh, logits_spec))


def _value_and_grad_into(loss: Callable, args: list, grad_sum: dict, adapters: bool):
    """(loss, grad_sum + the gradients of loss(*args) w.r.t. args[0]): the stacked layers' part is added inside
    their backward (`gptj.hidden`'s layer_grad_sum; the adapters are layers alone), the rest here."""
    layer_sum = grad_sum if adapters else grad_sum["layers"]
    value, grads = jax.value_and_grad(partial(loss, layer_grad_sum=layer_sum))(*args)
    if not adapters:
        grads = {k: v if k == "layers" else jax.tree.map(jnp.add, grad_sum[k], v) for k, v in grads.items()}
    return value, grads


def _adapted_loss(adapters: dict, base: dict, tokens_BxT1: jax.Array, cfg: Config, **kw) -> jax.Array:
    return gptj.loss_fn(lora.attach(base, adapters), tokens_BxT1, cfg, **kw)


def _check_gspmd(cfg: Config, mesh: Mesh, rules: Rules) -> None:
    """The mode must use every split mesh axis, and each split model dim must divide over its mesh axes."""
    ruled = {a for _, entry in rules for a in _mesh_axes(entry)}
    for axis in (DATA, FSDP, TENSOR):
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


def _check_axes(cfg: Config, mesh: Mesh) -> None:
    """The mesh must have the axes of the config's parallelism kind."""
    names = tuple(mesh.axis_names)
    if cfg.parallelism == SHARD_MAP and names != (DP, MP):
        raise ConfigError(f"config key 'parallelism' must be one of {', '.join(MODES)} for a {names} mesh, "
                          f"got {cfg.parallelism!r}")
    if cfg.parallelism != SHARD_MAP and names != (DATA, FSDP, TENSOR):
        raise ConfigError(f"config key 'parallelism' must be {SHARD_MAP!r} for a {names} mesh, got "
                          f"{cfg.parallelism!r}")


def gspmd_rules(cfg: Config) -> Rules:
    """The rule table of a GSPMD cfg.parallelism."""
    if cfg.parallelism not in GSPMD_RULES:
        raise ConfigError(f"config key 'parallelism' must be one of {', '.join(MODES)} for the GSPMD path, "
                          f"got {cfg.parallelism!r}")
    return GSPMD_RULES[cfg.parallelism]


def make_layout(cfg: Config, devices: Sequence[jax.Device] | None = None, mesh: Mesh | None = None) -> Layout:
    """The Layout of cfg.parallelism: on `mesh` when given, else on a mesh built from the devices (by default all)
    by the config: shard_map mp = cores_per_replica, GSPMD fsdp = mesh_fsdp and tensor = mesh_tensor, the remaining
    devices data parallel. The platform policy is the mesh's devices'; compute_dtype "auto" becomes the policy's."""
    if mesh is None:
        devices = list(jax.devices() if devices is None else devices)
        check_devices(cfg, len(devices))
        if cfg.parallelism == SHARD_MAP:
            shape = {DP: len(devices) // cfg.cores_per_replica, MP: cfg.cores_per_replica}
        else:
            group = cfg.mesh_fsdp * cfg.mesh_tensor
            shape = {DATA: len(devices) // group, FSDP: cfg.mesh_fsdp, TENSOR: cfg.mesh_tensor}
        mesh = make_mesh(shape, devices)
    _check_axes(cfg, mesh)
    policy = platforms.for_devices(list(mesh.devices.flat))
    if cfg.compute_dtype == "auto":
        cfg = dataclasses.replace(cfg, compute_dtype=policy.compute_dtype)
    if cfg.parallelism == SHARD_MAP:
        return Layout(cfg, mesh, MEGATRON_RULES, tp_axis=MP, dp_axis=DP, policy=policy)
    rules = gspmd_rules(cfg)
    _check_gspmd(cfg, mesh, rules)
    return Layout(cfg, mesh, rules, tp_axis=None, dp_axis=None, policy=policy)
