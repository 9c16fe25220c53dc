"""Layout: what a parallelism mode decides, and nothing else: the mesh, where every param / optimizer leaf / batch /
activation lives, and the loss, loss-and-grad and logits functions that run there.

Both kinds place arrays by rule tables, t5x style: the model names logical axes only (model/table.py), and for each
dim of an array the first rule naming its logical axis whose mesh axes are still free in that array wins; a logical
axis with no usable rule is replicated. Each mode has two tables (`Mappings`, as levanter's parameter and compute
axis mappings): where params are stored, and where compute places activations, caches and batches.

- shard_map kind (the original's Megatron scheme) over ('dp', 'mp'): vocab, heads and MLP columns on 'mp', tokens
  on 'dp'. The layer functions run per device under `jax.shard_map(..., check_vma=True)` with tp_axis='mp', doing
  one psum per block; check_vma gives the matching backward collectives.
- GSPMD kind over ('data', 'fsdp', 'tensor'): the plain global layer functions under `jax.jit`, with shardings from
  the mode's tables and activations pinned through a `constrain` hook. Under fsdp the params' embed dim is split
  over 'fsdp' (ZeRO-3) while compute splits the batch over it and keeps embed whole: pinned so inside the layer
  scan, XLA gathers one layer's weights per iteration and keeps the batch split.

Everything above this (train state, steps, AOT, converters, inference placement) takes a Layout and never asks
which kind it is.
"""
from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Callable, Mapping, Sequence
from functools import partial
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from mesh_transformer import platforms
from mesh_transformer.config import Config, ConfigError, fit_devices
from mesh_transformer.model import fused, gptj, lora_slots, quant, table
from mesh_transformer.model.split import FULL, Split
from mesh_transformer.parallel.mesh import DATA, DP, FSDP, MP, TENSOR, make_mesh
from mesh_transformer.platforms import Policy

log = logging.getLogger(__name__)

Rules = list[tuple[str, str | tuple[str, ...] | None]]


class Mappings(NamedTuple):
    """A mode's two rule tables: where params (and their optimizer state) are stored, and where compute places
    activations, caches and batches."""
    params: Rules
    compute: Rules


SHARD_MAP = "shard_map"
# "shards": the device axis of inference's joined layers (`fused.FUSED_AXES`), one slice per 'mp' device.
MEGATRON_RULES: Rules = [("batch", DP), ("vocab", MP), ("heads", MP), ("kv_heads", MP), ("mlp", MP), ("shards", MP)]
MEGATRON = Mappings(params=MEGATRON_RULES, compute=MEGATRON_RULES)
BATCH_RULES: Rules = [("batch", (DATA, FSDP))]  # fsdp is data parallel for compute, so the batch splits over it too
ZERO3_RULES: Rules = [("embed", FSDP)]  # params only: ZeRO-3
TENSOR_RULES: Rules = [("vocab", TENSOR), ("heads", TENSOR), ("kv_heads", TENSOR), ("mlp", TENSOR)]
GSPMD: dict[str, Mappings] = {
    "dp": Mappings(params=BATCH_RULES, compute=BATCH_RULES),
    "fsdp": Mappings(params=ZERO3_RULES, compute=BATCH_RULES),
    "tp": Mappings(params=TENSOR_RULES, compute=BATCH_RULES + TENSOR_RULES),
    "fsdp_tp": Mappings(params=ZERO3_RULES + TENSOR_RULES, compute=BATCH_RULES + TENSOR_RULES),
}
MODES = tuple(GSPMD)


def kv_replicated(mappings: Mappings, cfg: Config, width: int) -> Mappings:
    """The mappings with the key and value heads held whole on every device where they are fewer than the `width`
    that splits the query heads (and that width a multiple of them): each device then computes all of them and
    attends with the one its query heads read (`layers.block`), the gradients of the replicated k and v weights
    summed over the devices as any replicated param's."""
    if cfg.kv_heads % width == 0:
        return mappings
    def drop(rules: Rules) -> Rules:
        return [(name, entry) for name, entry in rules if name != "kv_heads"]

    return Mappings(drop(mappings.params), drop(mappings.compute))

# Logical axes of activations and caches (K head dim and length are never split).
ACTIVATION_AXES = {
    "tokens": ("batch", "length"),
    "hidden": ("batch", "length", "embed"),
    "heads": ("batch", "length", "heads", "head_dim"),
    "mlp": ("batch", "length", "mlp"),
    "logits": ("batch", "length", "vocab"),
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


def tree_specs(axes_tree: Any, rules: Rules) -> Any:
    """PartitionSpecs of a tree of logical axes under a rule table."""
    return jax.tree.map(lambda axes: logical_to_spec(axes, rules), axes_tree, is_leaf=table.is_axes)


def param_specs(mappings: Mappings, cfg: Config) -> dict:
    """PartitionSpecs of the config's param tree under a mode's mappings (no mesh needed: converters write pieces
    by them)."""
    return tree_specs(table.param_axes(cfg), mappings.params)


def followed_param(key_path: Sequence[str], shape: Sequence[int],
                   param_shapes: Mapping[table.Path, Sequence[int]]) -> table.Path | None:
    """The param an optimizer leaf is placed like: the one whose path ends the leaf's key path and whose shape is the
    leaf's (an Adam moment); None for the rest (counters), which are replicated or kept whole."""
    for start in range(len(key_path)):
        param = tuple(key_path[start:])
        if param in param_shapes and tuple(param_shapes[param]) == tuple(shape):
            return param
    return None


def zero_spec(spec: P, shape: Sequence[int], axis: str, size: int) -> P:
    """Where an optimizer leaf of a param with `spec` lives when the optimizer is split over `axis` (`size` devices):
    that axis on the largest dim the spec leaves whole and `size` divides (the first of equals); `spec` where none
    does (a leaf too small to matter, kept whole on every replica)."""
    entries = list(spec) + [None] * (len(shape) - len(spec))
    free = [i for i, (entry, n) in enumerate(zip(entries, shape)) if entry is None and n % size == 0]
    if not free:
        return P(*entries)
    entries[max(free, key=lambda i: shape[i])] = axis
    return P(*entries)


class GradFlow(NamedTuple):
    """How a train step gets the trainable tree's gradients on a Layout (`Layout.grad_flow`): micro-batches' sums
    in f32, then one `reduce` to what the optimizer takes."""
    loss_and_grad: Callable  # (trainable, frozen, tokens) -> (loss, a gradient sum of this batch)
    loss_and_grad_into: Callable | None  # (trainable, frozen, tokens, grad_sum) -> (loss, grad_sum + this batch's)
    zeros: Callable  # trainable -> an empty gradient sum
    reduce: Callable  # a gradient sum -> the gradients, placed like the optimizer state


def unstacked(specs: dict, n_layers: int) -> dict:
    """A param-shaped tree of specs with "layers" as a list of per-layer trees (the leading L dropped), as
    `table.unstack_layers` makes of the params."""
    layer = jax.tree.map(lambda spec: P(*spec[1:]), specs["layers"], is_leaf=lambda x: isinstance(x, P))
    return {**specs, "layers": [layer] * n_layers}


@dataclasses.dataclass(frozen=True, eq=False)
class Layout:
    """One parallelism mode on one mesh. Build it with `make_layout`."""
    cfg: Config  # compute_dtype "auto" resolved for the mesh's devices
    mesh: Mesh
    mappings: Mappings
    tp_axis: str | None  # the tensor-parallel axis the layers reduce over (shard_map kind), else None
    dp_axis: str | None  # the batch axis a per-device loss is averaged over (shard_map kind), else None
    policy: Policy  # the platform choices of the mesh's devices (mesh_transformer.platforms)
    zero_axis: str | None = None  # the data-parallel axis the optimizer state is split over (shard_map kind), else None

    def __post_init__(self):
        if self.policy.attention == "splash" and (self.tp_axis is not None or (
                self.mesh.size > 1 and self.policy.attention_shards is None)):
            raise ValueError("splash attention runs under a GSPMD layout (`with_attention`): under shard_map its "
                             "output carries no mesh typing for check_vma, and GSPMD does not partition a Pallas "
                             "call, so on several devices each runs it on its own rows and heads")

    def with_attention(self, kernel: str) -> Layout:
        """This layout with training attention `kernel` (an A/B of the platform policy's), as its policy runs it
        (`platforms.for_layout`: splash only under GSPMD, split over the devices by rows and heads)."""
        policy = dataclasses.replace(self.policy, attention=kernel)
        policy = platforms.for_layout(policy, self.tp_axis is None, self.mesh, self.spec(ACTIVATION_AXES["heads"]))
        return dataclasses.replace(self, policy=policy)

    # ----------------------------------------------------------------------------------------------- placement
    def spec(self, logical_axes: Sequence[str]) -> P:
        """Where compute places an array with these logical axes (activations, caches, batches, per-row values)."""
        return logical_to_spec(logical_axes, self.mappings.compute)

    def sharding(self, logical_axes: Sequence[str]) -> NamedSharding:
        """Where an array with these logical axes lives (activations, caches, per-row values)."""
        return NamedSharding(self.mesh, self.spec(logical_axes))

    @property
    def replicated(self) -> NamedSharding:
        return NamedSharding(self.mesh, P())

    def specs(self, axes_tree: Any) -> Any:
        """Where a tree of params is stored, by its logical axes (`table.param_axes`, the adapters', a Split's)."""
        return tree_specs(axes_tree, self.mappings.params)

    def shardings(self, axes_tree: Any) -> Any:
        return jax.tree.map(partial(NamedSharding, self.mesh), self.specs(axes_tree),
                            is_leaf=lambda x: isinstance(x, P))

    def abstract(self, axes_tree: Any, dtype=jnp.float32) -> Any:
        """Shapes, dtypes and shardings of a tree of logical axes, allocating nothing."""
        return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                            table.shapes_of(axes_tree, table.axis_sizes(self.cfg), dtype), self.shardings(axes_tree))

    def init(self, init_fn: Callable, axes_tree: Any, key: jax.Array) -> Any:
        """init_fn(cfg, key)'s tree made directly in its shards (no device holds the whole of it)."""
        return jax.jit(partial(init_fn, self.cfg), out_shardings=self.shardings(axes_tree))(key)

    def param_specs(self) -> dict:
        return param_specs(self.mappings, self.cfg)

    def placed_specs(self, slots: bool = True) -> dict:
        """Specs of the params placed for inference (infer/params.py): layers unstacked into a list, each joined by
        `fused.fuse_layer` (shard_map kind), with int8 weights' scales (and the head's, with quantize_head), and the
        served adapters' slots where the config holds some (`max_loras`) unless `slots` is False (the loaders')."""
        joined, specs = fused.fused_axes(table.param_axes(self.cfg)["layers"]), self.param_specs()
        if gptj.precision(self.cfg).int8:
            joined = {**joined, "fused": {**joined["fused"], **quant.SCALE_AXES}}
        if gptj.precision(self.cfg).int8_head:
            specs = {**specs, "lm_head": {**specs["lm_head"], **self.specs(quant.HEAD_SCALE_AXES)}}
        layer = self.specs(joined)
        if slots and self.cfg.max_loras:  # served LoRA adapters' slots beside the layer (model/lora_slots.py)
            layer = {**layer, "lora": self.specs(lora_slots.slot_axes(self.cfg))}
        return {**specs, "layers": [layer] * self.cfg.layers}

    def param_shardings(self) -> dict:
        return self.shardings(table.param_axes(self.cfg))

    def abstract_params(self, dtype=jnp.float32) -> dict:
        """Shapes, dtypes and shardings of the params, allocating nothing."""
        return self.abstract(table.param_axes(self.cfg), dtype)

    def init_params(self, key: jax.Array) -> dict:
        """Random params made directly in their shards; the same numbers as `table.init_unsharded` with the same
        key."""
        return self.init(table.init_params, table.param_axes(self.cfg), key)

    def follow_params(self, abstract_tree, abstract_params: dict):
        """Shardings of a tree of optimizer leaves: a leaf at a param's path and of its shape (an Adam moment) sits
        like that param; the rest (counters) is replicated."""
        flat = jax.tree_util.tree_flatten_with_path(abstract_params)[0]
        by_path = {tuple(k.key for k in path): s for path, s in flat}
        shapes = {path: s.shape for path, s in by_path.items()}

        def place(path, leaf):
            keys = [k.key for k in path if isinstance(k, jax.tree_util.DictKey)]
            param = followed_param(keys, leaf.shape, shapes)
            return self.replicated if param is None else self.optimizer_sharding(by_path[param].sharding, leaf.shape)

        return jax.tree_util.tree_map_with_path(place, abstract_tree)

    def optimizer_sharding(self, param_sharding: NamedSharding, shape: Sequence[int]) -> NamedSharding:
        """Where an optimizer leaf shaped like a param (an Adam moment, a gradient) lives: like the param, and split
        over `zero_axis` too where the optimizer is (`zero_spec`)."""
        if self.zero_axis is None:
            return param_sharding
        spec = zero_spec(param_sharding.spec, shape, self.zero_axis, self.mesh.shape[self.zero_axis])
        return NamedSharding(self.mesh, spec)

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
    def per_device(self, fn: Callable, in_specs, out_specs, check_vma: bool = True) -> Callable:
        """fn run per device under shard_map on this mesh, its arguments and results split by these specs (JAX
        checking how each value varies over the mesh axes, unless `check_vma` is False)."""
        return jax.shard_map(fn, mesh=self.mesh, in_specs=in_specs, out_specs=out_specs, check_vma=check_vma)

    def _constrain(self, x: jax.Array, logical_axes: Sequence[str]) -> jax.Array:
        return lax.with_sharding_constraint(x, self.sharding(logical_axes))

    def _split_specs(self, split: Split) -> tuple[Any, Any]:
        return self.specs(split.trainable_axes(self.cfg)), self.specs(split.frozen_axes(self.cfg))

    def _model_loss(self, split: Split) -> Callable:
        """(trainable, frozen, tokens, **kw) -> loss: per device under shard_map, else global with activations
        pinned."""
        cfg = self.cfg
        if self.tp_axis is not None:
            return partial(_split_loss, split, cfg=cfg, tp_axis=self.tp_axis, dp_axis=self.dp_axis, policy=self.policy)

        def loss(trainable, frozen, tokens_BxT1, **kw):
            tokens_BxT1 = self._constrain(tokens_BxT1, ACTIVATION_AXES["tokens"])
            return _split_loss(split, trainable, frozen, tokens_BxT1, cfg, constrain=self._constrain,
                               policy=self.policy, **kw)

        return loss

    def loss_fn(self, split: Split = FULL) -> Callable:
        """(trainable, frozen, tokens [B, T+1]) -> mean loss of the model on the split's trees (not jitted)."""
        loss = self._model_loss(split)
        if self.tp_axis is None:
            return loss
        return self.per_device(loss, (*self._split_specs(split), self.spec(ACTIVATION_AXES["tokens"])), P())

    def loss_and_grad_fn(self, split: Split = FULL, into: Callable | None = None, local: bool = False) -> Callable:
        """(trainable, frozen, tokens [B, T+1]) -> (loss, grads of the trainable tree), placed like it (FSDP
        reduce-scatters them); the frozen tree is a constant of the loss, never differentiated. Under shard_map a
        LoRA adapter's partial sums join each block's one psum. With `into` (train/accumulate.py: (loss, trainable,
        frozen, tokens, grad_sum) -> (loss, grad_sum + grads)) one more argument, a gradient sum placed like the
        trainable tree. `local` (shard_map kind): each data-parallel replica's gradients of the mean loss left
        unsummed over `dp_axis`, stacked on a leading axis split over it, as the gradient sum is too (`grad_flow`)."""
        trainable_specs, frozen_specs = self._split_specs(split)
        loss = self._model_loss(split)
        shardings = jax.tree.map(partial(NamedSharding, self.mesh), trainable_specs,
                                 is_leaf=lambda x: isinstance(x, P))
        local = local and self.tp_axis is not None and self.dp_axis is not None

        def fn(trainable, frozen, tokens_BxT1, *grad_sum):
            if local:  # the params as each replica's own: their gradients are not summed over the replicas
                trainable = lax.pcast(trainable, (self.dp_axis,), to="varying")
                grad_sum = tuple(jax.tree.map(lambda g_1x: g_1x[0], g) for g in grad_sum)
            if into is not None:
                value, grads = into(loss, trainable, frozen, tokens_BxT1, *grad_sum)
            else:
                value, grads = jax.value_and_grad(loss)(trainable, frozen, tokens_BxT1)
            if local:
                return value, jax.tree.map(lambda g: g[None], grads)
            return value, grads if self.tp_axis is not None else lax.with_sharding_constraint(grads, shardings)

        if self.tp_axis is None:
            return fn
        grad_specs = self._local_specs(trainable_specs) if local else trainable_specs
        in_specs = (trainable_specs, frozen_specs, self.spec(ACTIVATION_AXES["tokens"]))
        return self.per_device(fn, in_specs + (grad_specs,) * (into is not None), (P(), grad_specs))

    def _local_specs(self, specs: Any) -> Any:
        return jax.tree.map(lambda spec: P(self.dp_axis, *spec), specs, is_leaf=lambda x: isinstance(x, P))

    def grad_flow(self, split: Split = FULL, into: Callable | None = None) -> GradFlow:
        """The train step's gradients (`GradFlow`). Where the optimizer is split over data parallel (`zero_axis`),
        each replica sums its micro-batches' gradients on its own and a step reduce-scatters the sum once, onto
        the optimizer state's split (ZeRO-2: the original summed over replicas once a step too); else the gradients
        come summed over the replicas from each micro-batch, placed like the trainable tree."""
        def zeros_like(trainable, leading=()):
            return jax.tree.map(lambda p: jnp.zeros((*leading, *p.shape), jnp.float32), trainable)

        if self.zero_axis is None:
            return GradFlow(self.loss_and_grad_fn(split), into and self.loss_and_grad_fn(split, into), zeros_like,
                            lambda grads: grads)
        trainable_specs = self._split_specs(split)[0]
        local_specs = self._local_specs(trainable_specs)
        n_replicas = self.mesh.shape[self.zero_axis]

        def zeros(trainable):
            placed = jax.tree.map(partial(NamedSharding, self.mesh), local_specs, is_leaf=lambda x: isinstance(x, P))
            return lax.with_sharding_constraint(zeros_like(trainable, (n_replicas,)), placed)

        def reduce(grad_sum):
            out_specs = jax.tree.map(lambda g, spec: zero_spec(spec, g.shape[1:], self.zero_axis, n_replicas),
                                     grad_sum, trainable_specs)
            flat_out, tree = jax.tree.flatten(out_specs, is_leaf=lambda x: isinstance(x, P))
            dims = [next((i for i, entry in enumerate(spec) if entry == self.zero_axis), None) for spec in flat_out]

            def sum_over_replicas(grads_1x):
                return tree.unflatten([
                    lax.psum(g_1x[0], self.zero_axis) if dim is None else
                    lax.psum_scatter(g_1x[0], self.zero_axis, scatter_dimension=dim, tiled=True)
                    for g_1x, dim in zip(tree.flatten_up_to(grads_1x), dims)])

            return self.per_device(sum_over_replicas, (local_specs,), out_specs)(grad_sum)

        return GradFlow(self.loss_and_grad_fn(split, local=True),
                        into and self.loss_and_grad_fn(split, into, local=True), zeros, reduce)

    def logits_fn(self) -> Callable:
        """Jitted (params, ids [B, T]) -> logits [B, T, V] in f32, placed by the rules (batch and vocab split)."""
        cfg, logits_spec = self.cfg, self.spec(ACTIVATION_AXES["logits"])
        if self.tp_axis is not None:
            fn = partial(gptj.forward, cfg=cfg, tp_axis=self.tp_axis, policy=self.policy)
            return jax.jit(self.per_device(fn, (self.param_specs(), self.spec(ACTIVATION_AXES["tokens"])),
                                            logits_spec))

        def logits(params, ids_BxT):
            return gptj.forward(params, self._constrain(ids_BxT, ACTIVATION_AXES["tokens"]), cfg,
                                constrain=self._constrain, policy=self.policy)

        return jax.jit(logits, in_shardings=(self.param_shardings(), self.sharding(ACTIVATION_AXES["tokens"])),
                       out_shardings=NamedSharding(self.mesh, logits_spec))


def _split_loss(split: Split, trainable: Any, frozen: Any, tokens_BxT1: jax.Array, cfg: Config, **kw) -> jax.Array:
    params, adapters = split.model(trainable, frozen)
    return gptj.loss_fn(params, tokens_BxT1, cfg, adapters=adapters, **kw)


def _check_gspmd(cfg: Config, mesh: Mesh, mappings: Mappings) -> None:
    """The mode must use every split mesh axis, and each split model dim must divide over its mesh axes."""
    rules = mappings.params + mappings.compute
    ruled = {a for _, entry in rules for a in _mesh_axes(entry)}
    for axis in (DATA, FSDP, TENSOR):
        if mesh.shape[axis] > 1 and axis not in ruled:
            raise ConfigError(f"parallelism {cfg.parallelism!r} does not use mesh axis '{axis}' of size "
                              f"{mesh.shape[axis]}; choose a mode that does ({', '.join(MODES)}) or size it 1")
    sizes = {"embed": ("d_model", cfg.d_model), "heads": ("n_heads", cfg.n_heads),
             "kv_heads": ("n_kv_heads", cfg.kv_heads), "mlp": ("d_ff", cfg.d_ff), "vocab": ("n_vocab", cfg.n_vocab)}
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


def gspmd_mappings(cfg: Config) -> Mappings:
    """The rule tables of a GSPMD cfg.parallelism."""
    if cfg.parallelism not in GSPMD:
        raise ConfigError(f"config key 'parallelism' must be one of {', '.join(MODES)} for the GSPMD path, "
                          f"got {cfg.parallelism!r}")
    return GSPMD[cfg.parallelism]


def make_layout(cfg: Config, devices: Sequence[jax.Device] | None = None, mesh: Mesh | None = None) -> Layout:
    """The Layout of cfg.parallelism: on `mesh` when given, else on a mesh built from the devices (by default all)
    by the config: shard_map mp = cores_per_replica (fitted to the devices present: `config.fit_devices`), GSPMD
    fsdp = mesh_fsdp and tensor = mesh_tensor, the remaining devices data parallel. The platform policy is the
    mesh's devices'; compute_dtype "auto" becomes the policy's."""
    if mesh is None:
        devices = list(jax.devices() if devices is None else devices)
        fitted = fit_devices(cfg, len(devices))
        if fitted.cores_per_replica != cfg.cores_per_replica:
            log.warning("cores_per_replica %d does not divide the %d devices present: model-parallel width %d",
                        cfg.cores_per_replica, len(devices), fitted.cores_per_replica)
        cfg = fitted
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
        zero_axis = DP if cfg.shard_optimizer and mesh.shape[DP] > 1 else None
        return Layout(cfg, mesh, kv_replicated(MEGATRON, cfg, mesh.shape[MP]), tp_axis=MP, dp_axis=DP,
                      policy=platforms.for_layout(policy, gspmd=False), zero_axis=zero_axis)
    mappings = kv_replicated(gspmd_mappings(cfg), cfg, mesh.shape[TENSOR])
    _check_gspmd(cfg, mesh, mappings)
    heads_spec = logical_to_spec(ACTIVATION_AXES["heads"], mappings.compute)
    return Layout(cfg, mesh, mappings, tp_axis=None, dp_axis=None,
                  policy=platforms.for_layout(policy, True, mesh, heads_spec))
