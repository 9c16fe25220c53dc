"""The serving engine's programs: every (name, arguments, static arguments) it can dispatch, for the slot cache and
the paged cache, and their compile ahead of time (the engine's `warm_up`, `start`), so that no request waits for a
compile.

A program is one per shape: each prompt bucket x its prefill row counts (schedule.py's ladder), and each decode row
count x cache blocks (or pages) read. The arguments are placeholders of the right shapes
(zeros, padding rows, empty page tables); `Programs.compile` lowers and compiles them, nothing runs.
"""
from __future__ import annotations

import concurrent.futures
import logging
import os
import threading
import time

import numpy as np

from mesh_transformer.infer.choose import fill_sampling
from mesh_transformer.infer.decode import Steps
from mesh_transformer.infer.programs import Programs
from mesh_transformer.infer.score import MAX_TOP
from mesh_transformer.serve.schedule import Schedule

log = logging.getLogger(__name__)

Program = tuple[str, tuple, dict]  # a program's name in `Programs`, its arguments and its static arguments


def slot_programs(state: tuple, schedule: Schedule, extend: bool) -> list[Program]:
    """The programs of a slot cache, `state` the engine's (params, cache, slot state): prefills of whole prompts
    and, with `extend` (a prefix cache), of the rest after a cached prefix; decodes reading each block count."""
    prefills = [("prefill", (*state, np.zeros((r, width), np.int32), np.ones(r, np.int32),
                             np.full(r, -1, np.int32), _sampling(state, r)), {"top": MAX_TOP})
                for width, r in _prefill_shapes(schedule)]
    if extend:
        prefills += [("extend", (*state, np.zeros((r, width), np.int32), np.zeros(r, np.int32),
                                 np.ones(r, np.int32), np.full(r, -1, np.int32), np.full(r, -1, np.int32),
                                 _sampling(state, r)), {"top": MAX_TOP})
                     for width, r in _prefill_shapes(schedule)]
    decode_args = (*state, _idle_steps(state, schedule.n_slots))
    decodes = [("decode", decode_args, {"rows": rows, "n_blocks": count, "top": MAX_TOP})
               for rows, count in _decode_shapes(schedule)]
    return prefills + decodes


def paged_programs(state: tuple, schedule: Schedule, table_width: int, pad_page: int,
                   reuse_pages: bool) -> list[Program]:
    """The programs of a paged cache, `state` the engine's (params, pages, slot state), page tables `table_width`
    wide: prefills reading no pages (whole prompts) and, with `reuse_pages` or prompts prefilled in pieces (the
    schedule's chunk), the whole table (tails after a prefix or the pieces before them: a row a dp group); decodes
    reading each page count; the slots' moves (`compaction`)."""
    def table(rows: int) -> np.ndarray:
        return np.full((rows, table_width), pad_page, np.int32)

    tails = reuse_pages or bool(schedule.chunk)
    prefills = [("paged_prefill", (*state, np.zeros((r, width), np.int32), np.zeros(r, np.int32),
                                   np.ones(r, np.int32), table(r), np.full(r, -1, np.int32),
                                   _sampling(state, r), np.zeros(r, np.int32)), {"n_read": n_read, "top": MAX_TOP})
                for width, r in _prefill_shapes(schedule)
                for n_read in ([0, table_width] if tails and r == schedule.dp else [0])]
    decode_args = (*state, _idle_steps(state, schedule.n_slots), table(schedule.n_slots))
    decodes = [("paged_decode", decode_args, {"rows": rows, "n_read": count, "top": MAX_TOP})
               for rows, count in _decode_shapes(schedule)]
    moves = [("move_slots", (state[2], np.zeros(schedule.n_slots, np.int32)), {})]
    return prefills + decodes + moves


def start(programs: Programs, listed: list[Program]) -> threading.Event:
    """The engine's warm-up: compile every listed program before returning. The event is set once they are."""
    compile_all(programs, listed)
    done = threading.Event()
    done.set()
    return done


def compile_all(programs: Programs, listed: list[Program]) -> None:
    """Compile every listed program ahead of time (nothing runs), a few at once."""
    log.info("compiling %d programs (%d prefill, %d decode)", len(listed),
             sum("decode" not in name for name, _, _ in listed), sum("decode" in name for name, _, _ in listed))
    start_s = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(min(4, os.cpu_count() or 1)) as pool:
        list(pool.map(lambda program: programs.compile(*program), listed))
    log.info("compiled them in %.1f s", time.perf_counter() - start_s)


def _prefill_shapes(schedule: Schedule) -> list[tuple[int, int]]:
    """(prompt bucket, rows over every dp group) of each prefill program."""
    return [(width, n * schedule.dp) for width, group_rows in schedule.prefill_rows.items() for n in group_rows]


def _decode_shapes(schedule: Schedule) -> list[tuple[int, int]]:
    """(rows per dp group, cache blocks or pages read) of each decode program."""
    return [(rows, count) for rows in schedule.decode_rows for count in schedule.block_counts]


def _idle_steps(state: tuple, n_slots: int) -> Steps:
    """A decode step's inputs for n_slots slots, all at position 0."""
    zeros = np.zeros(n_slots, np.int32)
    return Steps(zeros, zeros, fill_sampling(n_slots, [], adapters=serves_adapters(state[0])))


def _sampling(state: tuple, rows: int):
    """A prefill's sampling rows, with the logit bias (and where the params serve adapters, each row's slot)."""
    return fill_sampling(rows, [], bias=True, adapters=serves_adapters(state[0]))


def serves_adapters(params: dict) -> bool:
    """Whether placed params (or their shapes) hold served LoRA adapters' slots (infer/adapter_slots.py)."""
    return "lora" in params["layers"][0]
