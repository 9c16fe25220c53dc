"""Ahead-of-time fit check: compile the train step (full, or LoRA when cfg.lora_rank > 0), the programs that place its
params before the first step, and the inference programs
(serving decode, prefill and prefix-cache extend, the sampler's decode, the scorer) for faked CPU devices or for a
real accelerator's compile-only devices (`targets`: a TPU slice through libtpu, NVIDIA GPUs through the CUDA
plugin), report per-device memory and, on an accelerator, the train step's estimated time (`estimate`).

Nothing is allocated: params, optimizer state, batch and KV cache are ShapeDtypeStructs with shardings. Reports
params and optimizer bytes from the arrays' shard sizes; arguments, outputs and temporaries from the compiler's
memory analysis; compile times; which compiler made each record. aot_check.py is its command line.
"""
from __future__ import annotations

import dataclasses
import math
import re
import time

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding

from mesh_transformer import estimate, platforms, targets
from mesh_transformer.config import Config, ConfigError, parse_size
from mesh_transformer.infer.choose import Sampling, fill_sampling
from mesh_transformer.infer.decode import (KVCache, Steps, block_shape, block_sizes, cache_dtype, default_block,
                                           new_slots)
from mesh_transformer.infer.programs import Programs
from mesh_transformer.infer.params import abstract_params, make_inference_layout
from mesh_transformer.infer.score import MAX_TOP, Rows, Scorer
from mesh_transformer.parallel.layout import MODES, SHARD_MAP, Layout, make_layout
from mesh_transformer.parallel.mesh import DP
from mesh_transformer.store import placing
from mesh_transformer.train import finetune, optim, state

def parse_mesh(text: str) -> dict[str, int]:
    """'data=1,fsdp=8,tensor=1' -> sizes; fsdp and tensor default to 1, data to None (the devices left)."""
    sizes: dict[str, int | None] = {"data": None, "fsdp": 1, "tensor": 1}
    for item in filter(None, text.split(",")):
        name, _, value = item.partition("=")
        if name not in sizes or not value.isdigit():
            raise ConfigError(f"--mesh must look like data=1,fsdp=8,tensor=1, got {text!r}")
        sizes[name] = int(value)
    return sizes


def start_devices(n: int) -> list[jax.Device]:
    """n CPU devices: faked when jax has not started yet, else the first n of those it already has."""
    try:
        jax.config.update("jax_platforms", "cpu")
        jax.config.update("jax_num_cpu_devices", n)
    except RuntimeError:
        pass  # jax already started (a test process): use its devices
    devices = jax.devices()
    if len(devices) < n:
        raise ConfigError(f"--devices {n}: jax already started with {len(devices)} devices")
    return devices[:n]


def shard_bytes(tree) -> int:
    """Bytes one device holds of a tree of ShapeDtypeStructs (the largest shard of each leaf; without a sharding,
    all of it)."""
    def leaf_bytes(s):
        shape = s.shape if s.sharding is None else s.sharding.shard_shape(s.shape)
        return jnp.dtype(s.dtype).itemsize * math.prod(shape)

    return sum(leaf_bytes(s) for s in jax.tree.leaves(tree))


def _abstract(shape, dtype, sharding: NamedSharding) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)


@dataclasses.dataclass(frozen=True)
class Refused:
    """A program the target's compiler refused for want of device memory (XLA:TPU does, where XLA:CPU compiles
    anything): what it said, the arguments' bytes and the temporaries beyond them that it said it needed."""
    message: str
    argument_bytes: int
    temp_bytes: int


_UNIT_BYTES = {"K": 2 ** 10, "M": 2 ** 20, "G": 2 ** 30, "T": 2 ** 40}


def _compile(fn, *args, policy: platforms.Policy, **static) -> tuple[object, float]:
    start = time.perf_counter()
    options = policy.compiler_options()
    if policy.platform == platforms.CPU:
        # Only XLA's buffer assignment matters here, which comes before code generation: skip LLVM's optimizations.
        options["xla_backend_optimization_level"] = 0
    try:
        compiled = fn.lower(*args, **static).compile(compiler_options=options)
    except jax.errors.JaxRuntimeError as e:
        if "RESOURCE_EXHAUSTED" not in str(e):
            raise
        message = next((line.strip() for line in str(e).splitlines() if line.strip()), str(e))
        # XLA:TPU's "memory required for HLO temporaries" is the program's whole need, its arguments included.
        need = re.search(r"HLO temporaries \(([\d.]+)([KMGT])\)", message)
        arguments = shard_bytes([x for x in jax.tree.leaves(args) if isinstance(x, jax.ShapeDtypeStruct)])
        need_bytes = int(float(need.group(1)) * _UNIT_BYTES[need.group(2)]) if need else arguments
        compiled = Refused(message, arguments, max(0, need_bytes - arguments))
    return compiled, time.perf_counter() - start


def _memory(compiled) -> dict[str, float]:
    if isinstance(compiled, Refused):
        return {"argument_bytes": compiled.argument_bytes, "output_bytes": 0, "alias_bytes": 0,
                "temp_bytes": compiled.temp_bytes, "total_bytes": compiled.argument_bytes + compiled.temp_bytes,
                "refused": compiled.message}
    mem = compiled.memory_analysis()
    total = (mem.argument_size_in_bytes + mem.output_size_in_bytes + mem.temp_size_in_bytes
             - mem.alias_size_in_bytes)
    return {"argument_bytes": mem.argument_size_in_bytes, "output_bytes": mem.output_size_in_bytes,
            "alias_bytes": mem.alias_size_in_bytes, "temp_bytes": mem.temp_size_in_bytes, "total_bytes": total}


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
    steps = Steps(ints, ints, _abstract_sampling(row, n_slots))
    slots = _abstract_like(new_slots(n_slots, cfg.n_vocab), row)
    return KVCache([block] * cfg.layers, [block] * cfg.layers), slots, steps


def _abstract_like(tree, sharding: NamedSharding):
    """A tree of arrays as ShapeDtypeStructs with this sharding."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding), tree)


def _abstract_sampling(sharding: NamedSharding, n: int, bias: bool = False) -> Sampling:
    return _abstract_like(fill_sampling(n, [], bias=bias), sharding)


def _measure_inference(train_layout: Layout, n_slots: int, common: dict,
                       chip: targets.Chip | None = None) -> list[dict]:
    """The programs inference really runs, every slot busy and the whole context used: the serving engine's decode
    step (block cache), prefill (one full-length prompt per dp group) and extend (half a context after a cached
    prefix per dp group), the offline sampler's decode loop (one
    block of seq) and the scorer (lm-eval, echo + logprobs: one full-length row per dp group, every position
    scored). The engine's decode is compiled at two slot counts too, which gives the slots that fit; with the
    target's chip, its estimated step time and tokens/s (every slot a token a step)."""
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
            _memory(compiled), compiled

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
    sampling = _abstract_sampling(programs.row_sharding, dp, bias=True)
    prefill, prefill_s = _compile(programs.jitted["prefill"], params, cache, last, ids, rows, rows, sampling,
                                  policy=policy)
    # A prompt's rest after a cached prefix (the prefix cache): half the context each, reading the whole slot.
    tail = jax.ShapeDtypeStruct((dp, cfg.seq // 2), jnp.int32, sharding=layout.sharding(("batch", "length")))
    extend, extend_s = _compile(programs.jitted["extend"], params, cache, last, tail, rows, rows, rows, rows,
                                sampling, policy=policy)
    paged = _measure_paged(programs, params, n_slots, base, common)
    score_rows = Rows(*[ids] * 6)
    scorer, scorer_s = _compile(Scorer(layout, None)._program, params, score_rows, policy=policy, top_k=MAX_TOP)
    return [{"check": "serve_decode_step", **serve, **serve_memory, "per_slot_bytes": round(per_slot),
             "slots_that_fit": fit},
            {"check": "serve_prefill", **base, "slots": n_slots, "prompt_tokens": cfg.seq,
             "compile_s": round(prefill_s, 1), "kv_cache_bytes": shard_bytes(cache), **_memory(prefill)},
            {"check": "serve_extend", **base, "slots": n_slots, "prompt_tokens": cfg.seq // 2,
             "compile_s": round(extend_s, 1), "kv_cache_bytes": shard_bytes(cache), **_memory(extend)},
            paged,
            {"check": "sample_decode_step", **sample, **_memory(generate)},
            {"check": "scorer", **base, "rows": dp, "row_tokens": cfg.seq, "top_k": MAX_TOP,
             "compile_s": round(scorer_s, 1), **_memory(scorer)}]


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
        return {**_memory(compiled), "kv_cache_bytes": shard_bytes(cache)}, seconds

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


def default_mesh(mode: str, n_devices: int) -> dict:
    """A GSPMD mode's mesh sizes when none is given: dp and fsdp over every device, tp over up to 8 (the rest
    data), fsdp_tp fsdp over all but a tensor width of 2."""
    tensor = {"tp": math.gcd(n_devices, 8), "fsdp_tp": 2 if n_devices % 2 == 0 else 1}.get(mode, 1)
    fsdp = n_devices // tensor if mode in ("fsdp", "fsdp_tp") else 1
    return {"data": None, "fsdp": fsdp, "tensor": tensor}


def training_programs(cfg: Config, mode: str, devices: list, sizes: dict) -> dict:
    """The Layout of `mode` on the devices, the abstract train state and batch, and the train step."""
    cfg = dataclasses.replace(cfg, parallelism=mode)
    if mode != SHARD_MAP:
        cfg = dataclasses.replace(cfg, mesh_fsdp=sizes["fsdp"], mesh_tensor=sizes["tensor"])
        if sizes["data"] is not None:
            needed = sizes["data"] * sizes["fsdp"] * sizes["tensor"]
            if needed > len(devices):
                raise ConfigError(f"mesh data={sizes['data']}, fsdp={sizes['fsdp']}, tensor={sizes['tensor']} "
                                  f"needs {needed} devices; {len(devices)} are available")
            devices = devices[:needed]
    layout = make_layout(cfg, devices)
    optimizer = optim.make_optimizer(cfg)
    train_state, tokens, frozen = state.abstract_step_args(layout, optimizer)
    # The frozen base in the layouts the compiler chooses, as the trainer places it (`state.compile_train_step`).
    train = state.make_train_step(layout, optimizer, optim.lr_schedule(layout.cfg),
                                  frozen_formats=state.auto_frozen_formats(layout))
    return {"layout": layout, "state": train_state, "tokens": tokens, "frozen": frozen, "train": train}


def _train_record(compiled: dict, common: dict, no_loop_hoisting: bool = False,
                  chip: targets.Chip | None = None) -> dict:
    """The train step's record: the full step's, or the LoRA step's (params = the frozen base, plus adapters);
    with the target's chip, the step's estimated time."""
    train_state, frozen, layout = compiled["state"], compiled["frozen"], compiled["layout"]
    policy = dataclasses.replace(layout.policy, loop_hoisting=not no_loop_hoisting)
    train, train_s = _compile(compiled["train"], train_state, compiled["tokens"], frozen, policy=policy)
    params = frozen or train_state["params"]
    cfg = layout.cfg
    record = {"check": "lora_train_step" if frozen else "train_step", **common, "mode": cfg.parallelism,
              "mesh": dict(layout.mesh.shape), "params": sum(x.size for x in jax.tree.leaves(params)),
              "tokens": list(compiled["tokens"].shape), "compute_dtype": cfg.compute_dtype, "remat": cfg.remat,
              "remat_policy": cfg.remat_policy,
              "attention": layout.policy.attention,
              "compile_s": round(train_s, 1), "params_bytes": shard_bytes(params),
              "opt_state_bytes": shard_bytes(train_state["opt_state"]), "no_loop_hoisting": no_loop_hoisting}
    if frozen:
        record.update(adapter_params=sum(x.size for x in jax.tree.leaves(train_state["params"])),
                      adapters_bytes=shard_bytes(train_state["params"]), lora_rank=cfg.lora_rank,
                      lora_targets=list(cfg.lora_targets), base_dtype=cfg.base_dtype)
    if chip is not None and not isinstance(train, Refused):
        n_tokens = math.prod(compiled["tokens"].shape[:2]) * cfg.seq
        n_devices = layout.mesh.devices.size
        model_flops = n_tokens * estimate.model_flops_per_token(cfg, lora=bool(frozen)) / n_devices
        record.update(estimate.step_estimate(train, chip, n_tokens, model_flops))
    return {**record, **_memory(train)}


def _loading_record(compiled: dict, common: dict) -> dict:
    """The programs that place a fine-tune's params or a LoRA base before the first step (each stacked param made
    and written a layer at a time: `store.placing`; a LoRA base's fingerprint), compiled for the target (those of
    params alike in shape, dtype and sharding once: they are one program): the largest one's memory, and any the
    compiler refused (a TPU core's 128 MiB VMEM, say)."""
    layout, policy = compiled["layout"], compiled["layout"].policy
    placed = compiled["frozen"] or compiled["state"]["params"]
    runs, distinct = 0, {}
    for like in jax.tree.leaves(placed):  # blocks of f32 layers: the largest a checkpoint gives
        for i, (fn, args) in enumerate(placing.programs(like, jnp.float32)):
            runs += 1
            key = (i, like.shape, like.dtype, like.sharding)
            if key not in distinct:
                distinct[key] = _compile(fn, *args, policy=policy)[0]
    programs = list(distinct.values())
    if compiled["frozen"]:
        programs.append(_compile(finetune.fingerprint_fn(layout.replicated), placed, policy=policy)[0])
        runs += 1
    memory = [_memory(program) for program in programs]
    largest = max(memory, key=lambda m: m["total_bytes"])
    record = {"check": "load_params", **common, "programs": runs, "distinct_programs": len(programs), **largest}
    refused = [m["refused"] for m in memory if "refused" in m]
    if refused:
        record["refused"] = refused[0]
    return record


def measure(cfg: Config, mode: str, devices: list, sizes: dict | None, n_slots: int = 8,
            no_loop_hoisting: bool = False, target: targets.Target | None = None,
            train_only: bool = False, inference_only: bool = False) -> list[dict]:
    """Compile the train step of `mode` (every mode's: "all"; none with `inference_only`) and, unless `train_only`,
    the inference programs on the same devices and measure their per-device memory: one JSON record each."""
    common = {"devices": len(devices), "target": target.name if target else f"cpu-{len(devices)}",
              "compiler": target.compiler if target else "XLA:CPU (faked devices)"}
    if target is not None:
        common["device_memory_bytes"] = target.chip.memory_bytes
    modes = [SHARD_MAP, *MODES] if mode == "all" else [mode]
    records, first = [], None
    for name in modes:
        mesh = sizes if sizes and name == mode else default_mesh(name, len(devices))
        compiled = training_programs(cfg, name, devices, mesh)
        first = first or compiled
        if not inference_only:
            records.append(_train_record(compiled, common, no_loop_hoisting, target.chip if target else None))
            records.append(_loading_record(compiled, common))
    return records if train_only else [*records, *_measure_inference(first["layout"], n_slots, common,
                                                                      target.chip if target else None)]


def verdict(records: list[dict], device_memory: int) -> dict:
    """The fit record: the largest per-device need of the programs against one device's memory (with several
    training modes, each mode's train step with the inference programs)."""
    inference = max((r["total_bytes"] for r in records if "train_step" not in r["check"]), default=0)
    by_mode = {r["mode"]: max(r["total_bytes"], inference) for r in records if "train_step" in r["check"]}
    need = max(by_mode.values(), default=inference)
    first = records[0]
    refused = [r["check"] for r in records if "refused" in r]  # a program the compiler would not make does not fit
    return {"check": "fit", "mode": first.get("mode"), "mesh": first.get("mesh"), "devices": first.get("devices"),
            "per_device_need_bytes": need, "device_memory_bytes": device_memory,
            "fits": need <= device_memory and not refused, "refused": refused,
            "fits_by_mode": {mode: n <= device_memory for mode, n in by_mode.items()}}


def _size(n_bytes: int) -> str:
    for unit, scale in (("GiB", 2 ** 30), ("MiB", 2 ** 20), ("KiB", 2 ** 10)):
        if n_bytes >= scale:
            return f"{n_bytes / scale:.2f} {unit}"
    return f"{n_bytes} B"


def _train_line(train: dict) -> str:
    mesh = " x ".join(f"{k}{v}" for k, v in train["mesh"].items())
    kind = f"LoRA rank {train['lora_rank']} train step" if "lora_rank" in train else "train step"
    line = (f"{train['mode']} on {mesh}: {kind} {_size(train['total_bytes'])} per device (params "
            f"{_size(train['params_bytes'])}, optimizer {_size(train['opt_state_bytes'])}, temporaries "
            f"{_size(train['temp_bytes'])}; compiled in {train['compile_s']:.0f} s)")
    if "refused" in train:
        line += f"; the compiler refused it: {train['refused']}"
    if "estimated_step_s" in train:
        line += (f", estimated {train['estimated_step_s']:.2f} s per step, {train['estimated_tokens_per_s']:,.0f} "
                 f"tokens/s, MFU {100 * train['estimated_mfu']:.0f}% (an estimate from the compiler's cost model)")
    return line


def human_line(records: list[dict]) -> str:
    """What a person reads: one line per train step, one for serving, one for the verdict."""
    fit = records[-1]
    trains = [r for r in records if "train_step" in r["check"]]
    lines = [_train_line(r) for r in trains]
    if decode := next((r for r in records if r["check"] == "serve_decode_step"), None):
        line = (f"serving decode step {_size(decode['total_bytes'])} for {decode['slots']} slots (params "
                f"{_size(decode['params_bytes'])}, KV cache {_size(decode['kv_cache_bytes'])})")
        if "estimated_step_s" in decode:
            line += (f", estimated {1e3 * decode['estimated_step_s']:.1f} ms a step, "
                     f"{decode['estimated_tokens_per_s']:,.0f} tokens/s with every slot busy over the whole context")
        lines.append(line)
    if paged := next((r for r in records if r["check"] == "serve_paged_decode_step"), None):
        request = "+".join(map(str, paged["request_tokens"]))
        lines.append(f"paged serving ({paged['kv_cache_dtype']} cache, pages of {paged['page_size']}): "
                     f"{_size(paged['per_page_bytes'])} a page; requests of {request} tokens that fit: "
                     + ", ".join(f"{k}: {v}" for k, v in paged["requests_that_fit"].items()))
    lines += [f"{r['check']}: the compiler refused it: {r['refused']}" for r in records[:-1]
              if "refused" in r and "train_step" not in r["check"]]
    largest = max(records[:-1], key=lambda r: r["total_bytes"])
    first = records[0]
    lines.append(f"on {first['target']} ({first['compiler']}): {'fits' if fit['fits'] else 'does NOT fit'} in "
                 f"{_size(fit['device_memory_bytes'])} (the largest need: {largest['check']}, "
                 f"{_size(largest['total_bytes'])})")
    return "\n".join(lines)


def run(cfg: Config, mode: str | None, mesh_text: str, n_devices: int, device_memory_text: str | None,
        n_slots: int = 8, no_loop_hoisting: bool = False, topology: str | None = None,
        train_only: bool = False, inference_only: bool = False) -> list[dict]:
    """The JSON records of a fit check (train step(s), serving decode step and prefill, sampler decode step, scorer,
    verdict) on `n_devices` faked CPU devices or the compile-only devices of `topology` (`targets.target`); the
    last says whether it fits."""
    mode = mode or cfg.parallelism
    if mode == "shard_map" and mesh_text:
        raise ConfigError("--mesh is for the GSPMD modes; the shard_map path takes mp from cores_per_replica")
    target = targets.target(topology) if topology else None
    if target is not None and no_loop_hoisting:
        raise ConfigError("--no-loop-hoisting is for the CPU's compile; a TPU or GPU program hoists no f32 copy")
    sizes = parse_mesh(mesh_text) if mesh_text else None
    if device_memory_text:
        device_memory = parse_size(device_memory_text, "--device-memory")
    else:
        device_memory = target.chip.memory_bytes if target else 16 * 2 ** 30
    devices = target.devices() if target else start_devices(n_devices)
    records = measure(cfg, mode, devices, sizes, n_slots, no_loop_hoisting, target, train_only, inference_only)
    return [*records, verdict(records, device_memory)]
