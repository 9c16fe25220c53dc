"""How the server fits its devices, decided before any weights are read (vLLM's --gpu-memory-utilization): the
largest programs the engine can run are compiled from abstract arguments, and what each needs of a device (the
weights, the KV cache, the slots' state and the program's temporaries, by the compiler's memory analysis) is set
against `fraction` of one device's memory, beside the code of every program the engine can load (a TPU keeps a
loaded program's code in its memory, from the program's first run until the process ends).

A paged cache of `auto` pages takes what the largest need leaves: the programs are compiled over a cache of one
whole context per dp group (the probe), the pages that a page's bytes alone would leave room for are taken, and the
programs compiled again over that many, since their temporaries can grow with the cache (on a TPU, XLA copies each
layer's int8 scales between the runtime's layout and the attention kernel's: Llama-2-7B's 1 x 512 prefill holds
1.15 GB over the probe's 128 pages, 1.69 GB over 1,421); where the need measured there is over the budget, fewer
pages by the cost of a page between the two, until it fits (`_settle`). So `--kv-pages N` with the N that auto took
is the same verdict. Where the devices report no memory of their own (the CPU's devices share the
host's), `auto` is a whole context per slot, as many pages as the slot cache holds positions. A setting that cannot
fit is a ConfigError that names the flags that would reduce its memory; where the compiler itself refuses a program
for memory (XLA:TPU does), that is the same verdict.

The programs compiled here are the engine's own (one `Programs`), so a warm-up, or the first request, does not compile
them again where the cache has the pages they were compiled for.
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import os
from collections.abc import Callable, Sequence
from functools import partial

import jax

from mesh_transformer import config
from mesh_transformer.aot_compile import memory_record, refusal, shard_bytes, size_text
from mesh_transformer.flags import AUTO, MEMORY_FRACTION, OFF
from mesh_transformer.infer.pages import pages_for
from mesh_transformer.infer.params import abstract_params
from mesh_transformer.infer.programs import Programs
from mesh_transformer.parallel.mesh import DP, MP
from mesh_transformer.serve.schedule import Schedule, check_pages, engine_schedule
from mesh_transformer.serve.warmup import Program, paged_programs, slot_programs



@dataclasses.dataclass(frozen=True)
class Sizing:
    """What the server takes of one device: the paged cache's pages (None: the slot cache), the largest program's
    need with the programs' code against the budget (`fraction` of `device_bytes`), and the weights', the cache's
    and the code's shares of it."""
    n_pages: int | None
    need_bytes: int
    budget_bytes: int
    device_bytes: int
    weights_bytes: int
    cache_bytes: int
    largest: str  # the program of the largest need, as "name(static=value, ...)"
    code_bytes: int = 0  # the code of the engine's programs, each counted as the largest of its kind (`_code_bytes`)
    programs: int = 0  # how many programs the engine can load

    def summary(self) -> str:
        cache = f"{self.n_pages} pages" if self.n_pages else "slot cache"
        fraction = self.budget_bytes / self.device_bytes
        return (f"memory per device: {size_text(self.need_bytes)} of the {size_text(self.budget_bytes)} allowed "
                f"({size_text(self.device_bytes)} x fraction {fraction:.2f}): weights {size_text(self.weights_bytes)}, "
                f"KV cache {size_text(self.cache_bytes)} ({cache}), the code of {self.programs} programs "
                f"{size_text(self.code_bytes)}, the largest program {self.largest}")


SETTLE_PASSES = 3  # the most compiles of the largest programs over the pages taken, after the probe's


@dataclasses.dataclass(frozen=True)
class _Measured:
    """The largest need over a cache (the code of the engine's programs included), its program, that code, how
    many programs the engine lists and the cache's bytes, on one device."""
    need: int
    biggest: Program
    code: int
    programs: int
    cache: int


def _within(left: int | float, per_page: float, dp: int) -> int:
    """The most pages, a multiple of dp, of `per_page` bytes each in `left` bytes."""
    return int(left // per_page) // dp * dp


def _settle(measure: Callable[[int], _Measured], at_probe: _Measured, probe: int, n_pages: int, budget: int,
            dp: int) -> tuple[int, _Measured]:
    """The pages `--kv-pages auto` takes, and the need measured over them: from `n_pages` (what the probe's cost of a
    page allows), while the need measured is over the budget, the count that the cost of a page between there and the
    probe allows (fewer each time), at most SETTLE_PASSES compiles; else the probe's count, whose need fits where auto
    takes more."""
    for _ in range(SETTLE_PASSES):
        at = measure(n_pages)
        if at.need <= budget:
            return n_pages, at
        per_page = (at.need - at_probe.need) / (n_pages - probe)
        n_pages = min(n_pages - dp, probe + _within(budget - at_probe.need, per_page, dp))
        if n_pages <= probe:
            break
    return probe, at_probe


def device_memory(devices: Sequence[jax.Device]) -> tuple[int, bool]:
    """One device's memory in bytes, and whether the device reports it (TPUs and GPUs do); else the host's memory
    shared by its devices."""
    stats = devices[0].memory_stats() or {}
    if "bytes_limit" in stats:
        return int(stats["bytes_limit"]), True
    host = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return host // max(1, sum(d.process_index == devices[0].process_index for d in devices)), False


def size(programs: Programs, schedule: Schedule, *, n_pages: int | str | None, page_size: int, prefix_cache: bool,
         device_bytes: int, fraction: float = MEMORY_FRACTION, fill: bool = True,
         flags: Sequence[str] = ()) -> Sizing:
    """The server's sizing (module docstring) for `schedule`'s slots: `n_pages` None for the slot cache, a number of
    pages, or "auto"; `fill`: whether auto pages fill the memory (else a whole context per slot, at most).
    `flags`: the memory-reducing flags to suggest on a refusal (`advice`). Raises ConfigError where it cannot fit."""
    layout, dp = programs.layout, schedule.dp
    budget = int(fraction * device_bytes)
    params, slots = abstract_params(layout), programs.abstract_slots(schedule.n_slots)
    width = pages_for(layout.cfg.seq, page_size)
    probe = None if n_pages is None else n_pages if isinstance(n_pages, int) else dp * width

    def measure(pages: int | None) -> _Measured:
        if pages is None:
            cache = programs.abstract_cache(schedule.n_slots, list(schedule.block_sizes))
            listed = slot_programs((params, cache, slots), schedule, extend=prefix_cache)
        else:
            cache = programs.abstract_pages(pages, page_size)
            listed = paged_programs((params, cache, slots), schedule, width, 0, reuse_pages=prefix_cache)
        candidates = largest(listed)
        with concurrent.futures.ThreadPoolExecutor(len(candidates)) as pool:  # XLA compiles them in parallel
            records = list(pool.map(partial(_need, programs), candidates))
        need, biggest = max(zip((r["total_bytes"] for r in records), candidates), key=lambda x: x[0])
        code_bytes = _code_bytes(listed, candidates, records)
        return _Measured(need + code_bytes, biggest, code_bytes, len(listed), shard_bytes(cache))

    measured = measure(probe)
    weights_bytes = shard_bytes(params)
    if n_pages == AUTO:
        fixed, per_page = measured.need - measured.cache, measured.cache / probe
        n_pages = _within(budget - fixed, per_page, dp)
        if not fill:
            n_pages = min(n_pages, schedule.n_slots * width)
        if n_pages < dp * width:
            left = size_text(max(0, budget - fixed))
            program = f"{_name(measured.biggest)}: {size_text(fixed - weights_bytes - measured.code)}"
            raise config.ConfigError(
                f"the KV cache does not fit: after the weights ({size_text(weights_bytes)} a device), the largest "
                f"program ({program} more) and the code of {measured.programs} programs ({size_text(measured.code)}), "
                f"{left} of the {size_text(budget)} allowed hold {max(0, n_pages)} pages of {page_size} tokens, fewer "
                f"than one context of {layout.cfg.seq} tokens per data-parallel group ({dp * width} pages in all); "
                f"{advice(flags)}")
        if fill and n_pages > probe:
            n_pages, measured = _settle(measure, measured, probe, n_pages, budget, dp)
        else:
            cache = round(n_pages * per_page)
            measured = dataclasses.replace(measured, need=fixed + cache, cache=cache)
    need, biggest, code_bytes, cache_bytes = measured.need, measured.biggest, measured.code, measured.cache
    if need > budget:
        parts = (f"weights {size_text(weights_bytes)}, KV cache {size_text(cache_bytes)}, "
                 f"the code of {measured.programs} programs {size_text(code_bytes)}")
        raise config.ConfigError(
            f"the server does not fit: {_name(biggest)} needs {size_text(need)} a device ({parts}) of the "
            f"{size_text(budget)} allowed ({size_text(device_bytes)} x {fraction:g}); {advice(flags)}")
    return Sizing(n_pages, need, budget, device_bytes, weights_bytes, cache_bytes, _name(biggest), code_bytes,
                  measured.programs)


def for_server(programs: Programs, *, max_batch: int, n_pages: int | str | None, page_size: int, prefix_cache: bool,
               memory_fraction: float, device_bytes: int | None = None) -> Sizing:
    """device_serve.py's sizing from its flags (`flags.paged_cache`): n_pages a number, "auto", "off", or None (the
    platform's default: auto where the paged attention is the TPU kernel, else the slot cache); the devices'
    memory as they report it unless `device_bytes` (a compile-only target's: aot_check.py)."""
    layout = programs.layout
    if n_pages is None:
        n_pages = AUTO if layout.policy.paged_attention == "kernel" else OFF
    paged = n_pages != OFF
    devices = list(layout.mesh.devices.flat)
    fill = True
    if device_bytes is None:
        device_bytes, fill = device_memory(devices)
    dp, mp = layout.mesh.shape[DP], layout.mesh.shape[MP]
    if isinstance(n_pages, int):
        check_pages(n_pages, page_size, dp)
    schedule = engine_schedule(max_batch, dp, layout.cfg.seq, page_size if paged else None)
    flags = memory_flags(layout.cfg, paged=paged, pages_given=isinstance(n_pages, int), n_slots=schedule.n_slots,
                         dp=dp, mp=mp, n_devices=len(devices), fraction=memory_fraction)
    return size(programs, schedule, n_pages=n_pages if paged else None, page_size=page_size,
                prefix_cache=prefix_cache, device_bytes=device_bytes, fraction=memory_fraction, fill=fill,
                flags=flags)


def memory_flags(cfg: config.Config, *, paged: bool, pages_given: bool, n_slots: int, dp: int, mp: int,
                 n_devices: int, fraction: float) -> list[str]:
    """The flags that would reduce the server's memory from where the user stands, most effective first."""
    flags = []
    if pages_given:
        flags.append("fewer --kv-pages (or --kv-pages auto: what fits)")
    if not paged:
        flags.append("--kv-pages auto (a paged cache: a request holds only the pages its tokens fill)")
    elif cfg.kv_cache_dtype != "int8":
        flags.append("--kv-cache-dtype int8")
    if cfg.weight_dtype != "int8":
        flags.append("--dtype int8")
    elif not cfg.quantize_head:
        flags.append("--quantize-head")
    if mp < n_devices:
        flags.append(f"a larger --mp (now {mp}, of {n_devices} devices)")
    if n_slots > dp:
        flags.append(f"a smaller --max-batch (now {n_slots})")
    if fraction < 0.95:
        flags.append(f"a larger --memory-fraction (now {fraction:g})")
    flags.append(f"a shorter context (--set seq=N, now {cfg.seq})")
    return flags


def advice(flags: Sequence[str]) -> str:
    return "try " + ", ".join(flags) if flags else "it needs more device memory"


def largest(listed: list[Program]) -> list[Program]:
    """Of the engine's programs, those whose temporaries can be the largest: the decode step of every row reading
    the most blocks or pages; of the prefills of whole prompts and of those after a prefix (which read the cache),
    the one of the longest prompt bucket and the one of the most tokens (rows x bucket)."""
    decodes = [p for p in listed if "decode" in p[0]]

    def reads(program: Program) -> bool:
        return program[0] == "extend" or program[2].get("n_read", 0) > 0

    def tokens(program: Program) -> tuple[int, int]:
        rows, width = program[1][3].shape
        return rows * width, width

    picks = [max(decodes, key=lambda p: (p[2]["rows"], p[2].get("n_read", p[2].get("n_blocks"))))]
    for kind in (False, True):
        prefills = [p for p in listed if ("prefill" in p[0] or p[0] == "extend") and reads(p) == kind]
        if prefills:
            picks += [max(prefills, key=lambda p: tokens(p)[::-1]), max(prefills, key=tokens)]
    return list({_name(p): p for p in picks}.values())


def _code_bytes(listed: list[Program], candidates: list[Program], records: list[dict]) -> int:
    """The code of every program the engine can load, which a TPU keeps in its memory once a program has run: each
    decode step as large as the largest decode compiled here, each prefill as the largest prefill (code grows with
    the rows, the tokens and the pages read: on a v5e Llama-2-7B int8's decode steps took 6.8 to 12.0 MB, its
    prefills 8.9 to 17.2)."""
    def decode(program: Program) -> bool:
        return "decode" in program[0]

    largest_code = max(r["code_bytes"] for r in records)
    total = 0
    for kind in (True, False):
        sizes = [r["code_bytes"] for p, r in zip(candidates, records) if decode(p) == kind]
        total += sum(decode(p) == kind for p in listed) * max(sizes, default=largest_code)
    return total


def _need(programs: Programs, program: Program) -> dict:
    """What one program needs of a device (`aot_compile.memory_record`): its arguments, outputs and temporaries less
    what the outputs reuse of the donated arguments (`total_bytes`), and its code; where the compiler refuses it for
    memory, the need it stated."""
    name, args, static = program
    try:
        compiled = programs.executable(name, args, static)
    except jax.errors.JaxRuntimeError as e:
        compiled = refusal(e, args)
        if compiled is None:
            raise
    return memory_record(compiled)


def _name(program: Program) -> str:
    name, args, static = program
    rows, width = args[3].shape if "decode" not in name else (None, None)
    shape = f"{rows} x {width} tokens, " if rows else ""
    return f"{name}({shape}" + ", ".join(f"{k}={v}" for k, v in static.items() if k != "top") + ")"
