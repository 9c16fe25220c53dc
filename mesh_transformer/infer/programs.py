"""The compiled decode programs of one Layout (prefill, prefill after a cached prefix, decode, the sampler's
generate loop) and the cache they run over, each shape compiled once and kept; the per-device functions they run
are decode.py's.
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import threading
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

from mesh_transformer.infer import paged
from mesh_transformer.infer.choose import Logprobs
from mesh_transformer.infer.decode import (KVCache, Slots, block_axes, block_shape, cache_dtype, decode_local,
                                           extend_local, generate_local, new_slots, prefill_local)
from mesh_transformer.model import gptj
from mesh_transformer.parallel.layout import Layout
from mesh_transformer.platforms import Policy


def checks_vma(policy) -> bool:
    """Whether shard_map checks how an inference program's values vary over the mesh: not where a Pallas kernel runs
    in it (a pallas_call declares no mesh axes its output varies over, which the check refuses). Inference has no
    gradients, whose collectives the check is for."""
    return "kernel" not in (policy.int8_dot, policy.decode_attention, policy.paged_attention)


class Programs:
    """The prefill and decode programs of one Layout (a shard_map one: see `params.make_inference_layout`), and the
    cache they run over. Engines and samplers given the same Programs share its compiles.

    prefill(params, cache, slots_N, ids [R, T], length [R], slot [R], Sampling [R]) -> (tokens [R], logprobs [R],
    slots_N, cache): R rows split over dp like the slots, each row's slot an index into its own dp group's slots.
    extend(params, cache, slots_N, ids [R, T], start [R], length [R], slot [R], source [R], Sampling [R])
    -> the same: prompt tails after cached prefixes (`decode.extend_local`). decode(params, cache, slots_N,
    Steps [N], rows=, n_blocks=) -> (tokens, logprobs [dp x rows], slots_N, Steps, cache).
    generate(params, cache, slots_N, Steps [N], live [N], stop ids, n_steps, rows=, n_blocks=, out_len=) -> (tokens,
    logprobs [dp x rows, out_len], cache): `generate_local`. slots_N is the slots' `decode.Slots`. The cache is
    donated, and to the step programs the Slots too.

    Each shape runs its own compiled executable, kept here: `compile` makes them ahead of time from the arguments'
    shapes alone (nothing runs, so a warm-up need not execute a 2048-token prefill to compile it), and a call with a
    shape not compiled yet compiles it first.
    """

    def __init__(self, layout: Layout):
        self.layout = layout
        self.vma = checks_vma(layout.policy)
        self.traces = 0  # programs compiled so far
        self.row_sharding = layout.sharding(("batch",))
        self.cache_sharding = layout.sharding(block_axes(layout.policy))
        self.jitted = {"prefill": jax.jit(self._prefill, static_argnames=("top",), donate_argnums=(1, 2)),
                       "extend": jax.jit(self._extend, static_argnames=("top",), donate_argnums=(1, 2)),
                       "decode": jax.jit(self._decode, static_argnames=("rows", "n_blocks", "top"),
                                         donate_argnums=(1, 2)),
                       "generate": jax.jit(self._generate, static_argnames=("rows", "n_blocks", "out_len"),
                                           donate_argnums=(1,)),
                       "paged_prefill": jax.jit(self._paged_prefill, static_argnames=("n_read", "top"),
                                                donate_argnums=(1, 2)),
                       "paged_decode": jax.jit(self._paged_decode, static_argnames=("rows", "n_read", "top"),
                                               donate_argnums=(1, 2)),
                       "move_slots": jax.jit(self._move_slots, donate_argnums=(0,))}
        self._executables: dict[tuple, Any] = {}
        self._lock = threading.Lock()
        # One jit kept for every cache shape, so each shape compiles once: a jit made per cache would compile anew.
        self._zeros = jax.jit(self._zero_cache, static_argnums=(0, 1), out_shardings=self.cache_sharding)
        self.page_specs = paged.cache_specs(layout)
        self._zero_pages = jax.jit(partial(paged.zero_cache, cfg=layout.cfg, policy=layout.policy),
                                   static_argnums=(0, 1),
                                   out_shardings=paged.PagedCache(*(NamedSharding(layout.mesh, spec)
                                                                    for spec in self.page_specs)))

    def prefill(self, params, cache, slots_N, ids_RxT, length_R, slot_R, sampling_R, *, top: int = 0):
        return self._run("prefill", (params, cache, slots_N, ids_RxT, length_R, slot_R, sampling_R), {"top": top})

    def extend(self, params, cache, slots_N, ids_RxT, start_R, length_R, slot_R, source_R, sampling_R, *,
               top: int = 0):
        return self._run("extend", (params, cache, slots_N, ids_RxT, start_R, length_R, slot_R, source_R, sampling_R),
                         {"top": top})

    def decode(self, params, cache, slots_N, steps_N, *, rows: int, n_blocks: int, top: int = 0):
        return self._run("decode", (params, cache, slots_N, steps_N), {"rows": rows, "n_blocks": n_blocks, "top": top})

    def generate(self, params, cache, slots_N, steps_N, live_N, stop_S, n_steps, *, rows: int, n_blocks: int,
                 out_len: int):
        return self._run("generate", (params, cache, slots_N, steps_N, live_N, stop_S, n_steps),
                         {"rows": rows, "n_blocks": n_blocks, "out_len": out_len})

    def paged_prefill(self, params, cache, slots_N, ids_RxT, start_R, length_R, table_RxM, slot_R, sampling_R,
                      index_R, *, n_read: int, top: int = 0):
        """Prompts, or prompt tails after cached prefixes, into the paged cache (`paged.prefill_local`): R rows split
        over dp like the slots, each row's table of its group's pages, its slot one of its group's, its token's
        index in its completion (its sampling key's: 0 but for a preempted completion's return)."""
        return self._run("paged_prefill", (params, cache, slots_N, ids_RxT, start_R, length_R, table_RxM, slot_R,
                                           sampling_R, index_R), {"n_read": n_read, "top": top})

    def paged_decode(self, params, cache, slots_N, steps_N, table_NxM, *, rows: int, n_read: int, top: int = 0):
        """One decode step of the first `rows` slots of each group over the paged cache (`paged.decode_local`)."""
        return self._run("paged_decode", (params, cache, slots_N, steps_N, table_NxM),
                         {"rows": rows, "n_read": n_read, "top": top})

    def move_slots(self, slots_N, source_N):
        """The Slots with each slot's row taken from slot source_N[i] of its own dp group (an index local to it)."""
        return self._run("move_slots", (slots_N, source_N), {})

    def lower(self, name: str, *args, **static):
        """The jitted program `name` lowered for these arguments (arrays or ShapeDtypeStructs); nothing runs."""
        return self.jitted[name].lower(*args, **static)

    def executable(self, name: str, args: tuple, static: dict | None = None):
        """The compiled program `name` for these arguments' shapes, compiled first where it is not yet (`compile`);
        its `memory_analysis()` says what it needs of a device."""
        static = static or {}
        self.compile(name, args, static)
        return self._executables[_signature(name, args, static)].result()

    def compile(self, name: str, args: tuple, static: dict | None = None) -> bool:
        """Compile program `name` for these arguments' shapes (arrays or ShapeDtypeStructs) unless it is compiled
        already; returns whether it compiled. Safe to call from several threads at once."""
        static = static or {}
        key = _signature(name, args, static)
        with self._lock:
            if key in self._executables:
                return False
            self._executables[key] = pending = concurrent.futures.Future()
            self.traces += 1
        try:
            options = self.compile_policy(name).compiler_options()
            pending.set_result(self.lower(name, *args, **static).compile(compiler_options=options))
        except BaseException as e:
            with self._lock:
                del self._executables[key]
            pending.set_exception(e)
            raise
        return True

    def compile_policy(self, name: str) -> Policy:
        """The policy program `name` compiles under: the layout's, except that the device loop over 16-bit weights
        where converts are ordered (CPU) has no loop-invariant code motion, which would hoist an f32 copy of every
        layer's weights out of the loop (GPT-J-6B bf16, one device: 35.5 GiB with it, 13.0 without: aot_check.py's
        sample_decode_step)."""
        policy = self.layout.policy
        if name == "generate" and policy.ordered_converts and gptj.precision(self.layout.cfg).compute.itemsize < 4:
            return dataclasses.replace(policy, loop_hoisting=False)
        return policy

    def _run(self, name: str, args: tuple, static: dict):
        return self.executable(name, args, static)(*args)

    def new_cache(self, n_slots: int, sizes: list[int]) -> KVCache:
        """An empty cache of n_slots slots in blocks of these lengths, made in its shards."""
        return KVCache(*self._zeros(n_slots, tuple(sizes)))

    def abstract_cache(self, n_slots: int, sizes: list[int]) -> KVCache:
        """`new_cache`'s result as ShapeDtypeStructs in its shards (for compiling; nothing is allocated)."""
        return KVCache(*jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=self.cache_sharding),
                                     jax.eval_shape(partial(self._zero_cache, n_slots, tuple(sizes)))))

    def _zero_cache(self, n_slots: int, sizes: tuple[int, ...]):
        cfg = self.layout.cfg
        dtype = cache_dtype(cfg, self.layout.policy)

        def zeros():
            return [[jnp.zeros(block_shape(n_slots, size, cfg, self.layout.policy), dtype) for size in sizes]
                    for _ in range(cfg.layers)]

        return zeros(), zeros()

    def new_pages(self, n_pages: int, page: int) -> paged.PagedCache:
        """An empty paged cache of n_pages pages of `page` positions (n_pages / dp a group), made in its shards."""
        return paged.PagedCache(*self._zero_pages(n_pages, page))

    def abstract_pages(self, n_pages: int, page: int) -> paged.PagedCache:
        """`new_pages`' result as ShapeDtypeStructs in its shards (for compiling; nothing is allocated)."""
        shapes = jax.eval_shape(partial(paged.zero_cache, n_pages, page, self.layout.cfg, self.layout.policy))
        return paged.PagedCache(*(jax.tree.map(lambda x, spec=spec: jax.ShapeDtypeStruct(
            x.shape, x.dtype, sharding=NamedSharding(self.layout.mesh, spec)), field)
            for field, spec in zip(shapes, self.page_specs)))

    def new_slots(self, n_slots: int) -> Slots:
        """The `decode.Slots` of n_slots empty slots, made in their shards."""
        return jax.device_put(new_slots(n_slots, self.layout.cfg.n_vocab), self.row_sharding)

    def abstract_slots(self, n_slots: int) -> Slots:
        """`new_slots`' result as ShapeDtypeStructs in their shards (for compiling; nothing is allocated)."""
        return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=self.row_sharding),
                            jax.eval_shape(partial(new_slots, n_slots, self.layout.cfg.n_vocab)))

    def _specs(self):
        return self.layout.placed_specs(), self.cache_sharding.spec, self.row_sharding.spec

    def _logprobs_spec(self) -> Logprobs:
        row, top = self.layout.spec(("batch",)), self.layout.spec(("batch", "top"))
        return Logprobs(row, top, top)

    def _prefill(self, params, cache, slots_N, ids_RxT, length_R, slot_R, sampling_R, *, top: int = 0):
        params_spec, cache_spec, row = self._specs()
        fn = partial(prefill_local, cfg=self.layout.cfg, policy=self.layout.policy, top=top,
                     tp_axis=self.layout.tp_axis)
        in_specs = (params_spec, cache_spec, row, self.layout.spec(("batch", "length")), row, row, row)
        return self.layout.per_device(fn, in_specs, (row, self._logprobs_spec(), row, cache_spec), self.vma)(
            params, cache, slots_N, ids_RxT, length_R, slot_R, sampling_R)

    def _extend(self, params, cache, slots_N, ids_RxT, start_R, length_R, slot_R, source_R, sampling_R, *,
                top: int = 0):
        params_spec, cache_spec, row = self._specs()
        fn = partial(extend_local, cfg=self.layout.cfg, policy=self.layout.policy, top=top,
                     tp_axis=self.layout.tp_axis)
        in_specs = (params_spec, cache_spec, row, self.layout.spec(("batch", "length")), row, row, row, row, row)
        return self.layout.per_device(fn, in_specs, (row, self._logprobs_spec(), row, cache_spec), self.vma)(
            params, cache, slots_N, ids_RxT, start_R, length_R, slot_R, source_R, sampling_R)

    def _decode(self, params, cache, slots_N, steps_N, *, rows: int, n_blocks: int, top: int = 0):
        params_spec, cache_spec, row = self._specs()
        fn = partial(decode_local, cfg=self.layout.cfg, policy=self.layout.policy, rows=rows, n_blocks=n_blocks,
                     top=top, tp_axis=self.layout.tp_axis)
        out_specs = (row, self._logprobs_spec(), row, row, cache_spec)
        return self.layout.per_device(fn, (params_spec, cache_spec, row, row), out_specs, self.vma)(
            params, cache, slots_N, steps_N)

    def _generate(self, params, cache, slots_N, steps_N, live_N, stop_S, n_steps, *, rows: int, n_blocks: int,
                  out_len: int):
        params_spec, cache_spec, row = self._specs()
        fn = partial(generate_local, cfg=self.layout.cfg, policy=self.layout.policy, rows=rows, n_blocks=n_blocks,
                     out_len=out_len, tp_axis=self.layout.tp_axis, dp_axis=self.layout.dp_axis)
        in_specs = (params_spec, cache_spec, row, row, row, P(), P())
        return self.layout.per_device(fn, in_specs, (row, row, cache_spec), self.vma)(
            params, cache, slots_N, steps_N, live_N, stop_S, n_steps)


    def _paged_prefill(self, params, cache, slots_N, ids_RxT, start_R, length_R, table_RxM, slot_R, sampling_R,
                       index_R, *, n_read: int, top: int = 0):
        params_spec, _, row = self._specs()
        pages = self.page_specs
        fn = partial(paged.prefill_local, cfg=self.layout.cfg, policy=self.layout.policy, n_read=n_read, top=top,
                     tp_axis=self.layout.tp_axis)
        rows_x = self.layout.spec(("batch", "length"))
        in_specs = (params_spec, pages, row, rows_x, row, row, rows_x, row, row, row)
        return self.layout.per_device(fn, in_specs, (row, self._logprobs_spec(), row, pages), self.vma)(
            params, cache, slots_N, ids_RxT, start_R, length_R, table_RxM, slot_R, sampling_R, index_R)

    def _move_slots(self, slots_N, source_N):
        row = self.row_sharding.spec
        return self.layout.per_device(lambda s, i: jax.tree.map(lambda x: x[i], s), (row, row), row, self.vma)(
            slots_N, source_N)

    def _paged_decode(self, params, cache, slots_N, steps_N, table_NxM, *, rows: int, n_read: int, top: int = 0):
        params_spec, _, row = self._specs()
        pages = self.page_specs
        fn = partial(paged.decode_local, cfg=self.layout.cfg, policy=self.layout.policy, rows=rows, n_read=n_read,
                     top=top, tp_axis=self.layout.tp_axis)
        in_specs = (params_spec, pages, row, row, self.layout.spec(("batch", "length")))
        check_vma = self.vma and not paged.kernel_pages(self.layout.policy)
        return self.layout.per_device(fn, in_specs, (row, self._logprobs_spec(), row, row, pages), check_vma)(
            params, cache, slots_N, steps_N, table_NxM)


def _signature(name: str, args: tuple, static: dict) -> tuple:
    """What picks a program's executable: its name, static values, the cache's block shapes (the params' shapes are
    the layout's) and the shapes and dtypes of the other arguments (of all, for move_slots: no params, no cache)."""
    if name == "move_slots":
        return name, (), tuple((x.shape, x.dtype) for x in jax.tree.leaves(args))
    cache = args[1]
    rest = tuple((x.shape, x.dtype) for x in jax.tree.leaves(args[2:]))  # arrays and numpy scalars
    return name, tuple(sorted(static.items())), tuple(b.shape for b in jax.tree.leaves(cache.k[0])), rest
