"""The fit check's inference programs (aot.py), compiled from abstract shapes on the training devices: the serving
engine's decode step over a slot cache and over a paged cache, its prefill and prefix-cache extend, the offline
sampler's decode loop and the scorer, every slot busy and the whole context used. One record each, with the slots
(or, paged, the requests) that fit a device's memory; and device_serve.py's own verdict with its flags
(`measure_server`).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding

import time

from mesh_transformer import estimate, targets
from mesh_transformer.config import ConfigError
from mesh_transformer.aot_compile import Refused, _compile, memory_record, shard_bytes
from mesh_transformer.infer.choose import Sampling, fill_sampling
from mesh_transformer.infer.decode import KVCache, Steps, block_shape, block_sizes, cache_dtype, default_block
from mesh_transformer.infer.params import abstract_params, make_inference_layout
from mesh_transformer.infer.programs import Programs
from mesh_transformer.infer.score import MAX_TOP, Rows, Scorer
from mesh_transformer.parallel.layout import Layout
from mesh_transformer.parallel.mesh import DP
from mesh_transformer.serve import sizing


def _inference_layout(train_layout: Layout) -> Layout:
    """The shard_map Layout the sampling and serving tools run on these devices by default, whatever the training
    mode: mp = cores_per_replica where it fits, else the widest that does (`infer.params.choose_mp`)."""
    return make_inference_layout(train_layout.cfg, list(train_layout.mesh.devices.flat))


def _abstract_slots(programs: Programs, n_slots: int, sizes: list[int]) -> tuple:
    """(cache, `decode.Slots`, Steps) of n_slots slots whose cache blocks have these lengths, abstract."""
    cfg = programs.layout.cfg
    row = programs.row_sharding
    policy = programs.layout.policy
    block = [jax.ShapeDtypeStruct(block_shape(n_slots, size, cfg, policy), cache_dtype(cfg, policy),
                                  sharding=programs.cache_sharding) for size in sizes]
    ints = jax.ShapeDtypeStruct((n_slots,), jnp.int32, sharding=row)
    steps = Steps(ints, ints, _abstract_sampling(row, n_slots, adapters=bool(cfg.max_loras)))
    slots = programs.abstract_slots(n_slots)
    return KVCache([block] * cfg.layers, [block] * cfg.layers), slots, steps


def _abstract_like(tree, sharding: NamedSharding):
    """A tree of arrays as ShapeDtypeStructs with this sharding."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding), tree)


def _abstract_sampling(sharding: NamedSharding, n: int, bias: bool = False, adapters: bool = False) -> Sampling:
    return _abstract_like(fill_sampling(n, [], bias=bias, adapters=adapters), sharding)


def measure_inference(train_layout: Layout, n_slots: int, common: dict,
                      chip: targets.Chip | None = None) -> list[dict]:
    """The programs inference really runs, every slot busy and the whole context used: the serving engine's decode
    step (block cache), prefill (one full-length prompt per dp group) and extend (half a context after a cached
    prefix per dp group), the offline sampler's decode loop (one block of seq) and the scorer (lm-eval, echo +
    logprobs: one full-length row per dp group, every position scored). The engine's decode is compiled at two
    slot counts too, which gives the slots that fit; with the target's chip, its estimated step time and tokens/s
    (every slot a token a step)."""
    cfg, layout = train_layout.cfg, _inference_layout(train_layout)
    programs, dp, policy = Programs(layout), layout.mesh.shape[DP], layout.policy
    params = abstract_params(layout)
    n_slots = -(-n_slots // dp) * dp
    serve_blocks = block_sizes(cfg.seq, default_block(cfg.seq))
    base = {**common, "decode_mesh": dict(layout.mesh.shape), "params_bytes": shard_bytes(params),
            "cache_length": cfg.seq}

    def decode(slots: int, sizes: list[int]) -> tuple[dict, dict, object]:
        cache, last, steps = _abstract_slots(programs, slots, sizes)
        compiled, seconds = _compile(programs.jitted["decode"], params, cache, last, steps, policy=policy,
                                     rows=slots // dp, n_blocks=len(sizes))
        return {**base, "slots": slots, "compile_s": round(seconds, 1), "kv_cache_bytes": shard_bytes(cache)}, \
            memory_record(compiled), compiled

    serve, serve_memory, serve_step = decode(n_slots, serve_blocks)
    if chip is not None and not isinstance(serve_step, Refused):
        est = estimate.step_estimate(serve_step, chip, n_slots, 0.0)
        serve.update(estimated_step_s=est["estimated_step_s"], estimated_tokens_per_s=est["estimated_tokens_per_s"])
    _, double_memory, _ = decode(2 * n_slots, serve_blocks)
    per_slot = (double_memory["total_bytes"] - serve_memory["total_bytes"]) / n_slots
    fixed = serve_memory["total_bytes"] - per_slot * n_slots
    gibs = {16, 24, 80, round(common.get("device_memory_bytes", 16 * 2 ** 30) / 2 ** 30, 2)}
    fit = {f"{gib:g}GiB": max(0, int((gib * 2 ** 30 - fixed) // per_slot) // dp * dp) for gib in sorted(gibs)}
    cache, last, steps = _abstract_slots(programs, n_slots, [cfg.seq])
    live = jax.ShapeDtypeStruct((n_slots,), jnp.bool_, sharding=programs.row_sharding)
    generate, generate_s = _compile(programs.jitted["generate"], params, cache, last, steps, live,
                                    jax.ShapeDtypeStruct((4,), jnp.int32), jax.ShapeDtypeStruct((), jnp.int32),
                                    policy=programs.compile_policy("generate"), rows=n_slots // dp, n_blocks=1,
                                    out_len=cfg.seq)
    sample = {**base, "slots": n_slots, "compile_s": round(generate_s, 1), "kv_cache_bytes": shard_bytes(cache)}
    cache, last, _ = _abstract_slots(programs, n_slots, serve_blocks)
    ids = jax.ShapeDtypeStruct((dp, cfg.seq), jnp.int32, sharding=layout.sharding(("batch", "length")))
    rows = jax.ShapeDtypeStruct((dp,), jnp.int32, sharding=programs.row_sharding)
    sampling = _abstract_sampling(programs.row_sharding, dp, bias=True, adapters=bool(cfg.max_loras))
    prefill, prefill_s = _compile(programs.jitted["prefill"], params, cache, last, ids, rows, rows, sampling,
                                  policy=policy)
    # A prompt's rest after a cached prefix (the prefix cache): half the context each, reading the whole slot.
    tail = jax.ShapeDtypeStruct((dp, cfg.seq // 2), jnp.int32, sharding=layout.sharding(("batch", "length")))
    extend, extend_s = _compile(programs.jitted["extend"], params, cache, last, tail, rows, rows, rows, rows,
                                sampling, policy=policy)
    paged = _measure_paged(programs, params, n_slots, base, common)
    score_rows = Rows(*[ids] * 6)
    scorer, scorer_s = _compile(Scorer(layout, None)._program, params, score_rows, rows, policy=policy,
                                top_k=MAX_TOP)
    return [{"check": "serve_decode_step", **serve, **serve_memory, "per_slot_bytes": round(per_slot),
             "slots_that_fit": fit},
            {"check": "serve_prefill", **base, "slots": n_slots, "prompt_tokens": cfg.seq,
             "compile_s": round(prefill_s, 1), "kv_cache_bytes": shard_bytes(cache), **memory_record(prefill)},
            {"check": "serve_extend", **base, "slots": n_slots, "prompt_tokens": cfg.seq // 2,
             "compile_s": round(extend_s, 1), "kv_cache_bytes": shard_bytes(cache), **memory_record(extend)},
            paged,
            {"check": "sample_decode_step", **sample, **memory_record(generate)},
            {"check": "scorer", **base, "rows": dp, "row_tokens": cfg.seq, "top_k": MAX_TOP,
             "compile_s": round(scorer_s, 1), **memory_record(scorer)}]


PAGE = 16  # the paged cache's page in the fit check (device_serve.py --page-size's default)
PAGED_REQUEST = (256, 128)  # the request the paged capacity is counted in: prompt and new tokens


def _measure_paged(programs: Programs, params, n_slots: int, base: dict, common: dict) -> dict:
    """The serving decode step over a paged cache (device_serve.py --kv-pages, the layout's kv_cache_dtype):
    n_slots rows each reading a whole context of pages, compiled with as many pages as the slot cache's bytes and
    with twice that: the bytes a page costs, hence how many requests of PAGED_REQUEST tokens fit a device's memory
    (rows past n_slots cost their sampling state too: about 2 x vocab x 4 bytes each, not counted)."""
    cfg, dp = programs.layout.cfg, programs.layout.mesh.shape[DP]
    width = -(-cfg.seq // PAGE)
    _, last, steps = _abstract_slots(programs, n_slots, [PAGE])
    table = jax.ShapeDtypeStruct((n_slots, width), jnp.int32, sharding=programs.layout.sharding(("batch", "length")))

    def decode(n_pages: int) -> tuple[dict, float]:
        cache = programs.abstract_pages(n_pages, PAGE)
        compiled, seconds = _compile(programs.jitted["paged_decode"], params, cache, last, steps, table,
                                     policy=programs.layout.policy, rows=n_slots // dp, n_read=width)
        return {**memory_record(compiled), "kv_cache_bytes": shard_bytes(cache)}, seconds

    n_pages = n_slots * width
    memory, seconds = decode(n_pages)
    double, _ = decode(2 * n_pages)
    per_page = (double["total_bytes"] - memory["total_bytes"]) / n_pages
    fixed = memory["total_bytes"] - per_page * n_pages
    pages_per_request = -(-sum(PAGED_REQUEST) // PAGE)
    gibs = {16, 24, 80, round(common.get("device_memory_bytes", 16 * 2 ** 30) / 2 ** 30, 2)}
    fit = {f"{gib:g}GiB": max(0, int((gib * 2 ** 30 - fixed) // (per_page * pages_per_request)) // dp * dp)
           for gib in sorted(gibs)}
    return {"check": "serve_paged_decode_step", **base, "slots": n_slots, "pages": n_pages, "page_size": PAGE,
            "kv_cache_dtype": cfg.kv_cache_dtype, "compile_s": round(seconds, 1), **memory,
            "per_page_bytes": round(per_page), "request_tokens": list(PAGED_REQUEST), "requests_that_fit": fit}


def measure_server(train_layout: Layout, max_batch: int, server: dict, common: dict, device_bytes: int) -> dict:
    """device_serve.py's verdict on these devices (serve/sizing.py, with its flags `server`: `flags.paged_cache`'s
    n_pages, page_size and memory_fraction, the prefix cache on): the pages it would take and its largest need, or
    the refusal it would print."""
    layout = _inference_layout(train_layout)
    start = time.perf_counter()
    record = {"check": "server", **common, "max_batch": max_batch, "page_size": server["page_size"],
              "memory_fraction": server["memory_fraction"], "kv_cache_dtype": layout.cfg.kv_cache_dtype}
    try:
        fit = sizing.for_server(Programs(layout), max_batch=max_batch, prefix_cache=True, device_bytes=device_bytes,
                                **server)
    except ConfigError as e:
        return {**record, "compile_s": round(time.perf_counter() - start, 1), "total_bytes": 0, "refused": str(e)}
    return {**record, "compile_s": round(time.perf_counter() - start, 1), "kv_pages": fit.n_pages,
            "total_bytes": fit.need_bytes, "budget_bytes": fit.budget_bytes, "params_bytes": fit.weights_bytes,
            "kv_cache_bytes": fit.cache_bytes, "code_bytes": fit.code_bytes, "programs": fit.programs,
            "largest_program": fit.largest}
