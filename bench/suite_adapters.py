"""The device suite's serving_adapters section: the paged engine (int8 weights, int8 pages, the pages device_serve.py
takes by default) serving `n_adapters` random LoRA adapters of `rank` on every projection from its slots
(`max_loras`, model/lora_slots.py), the concurrent requests spread over them against all on the base, alternately
`rounds` times (medians compared); and one more adapter read from a PEFT directory on disk and written into a free
slot while the engine runs, timed (read, and read + written)."""
from __future__ import annotations

import dataclasses
import os
import statistics
import tempfile
import time

import numpy as np

from bench.suite_parts import random_decode_params
from bench.suite_serving import _CharPerToken, _run_together, _serving_record
from mesh_transformer import config
from mesh_transformer.flags import AUTO, MEMORY_FRACTION
from mesh_transformer.infer.programs import Programs
from mesh_transformer.model import gptj, lora
from mesh_transformer.parallel.layout import Layout
from mesh_transformer.serve import sizing
from mesh_transformer.serve.engine import Engine
from mesh_transformer.store import peft
from mesh_transformer.store.adapters import read_adapters

ADAPTERS_GOAL = 0.85  # spread over the adapters, the share of all-on-the-base tokens/s (issue 57)


def random_adapter(cfg: config.Config, rank: int, seed: int) -> dict:
    """A random LoRA adapter of `rank` on every projection: {target: {"a", "b"}}, f32, as the slots take it."""
    shapes = lora.lora_shapes(dataclasses.replace(cfg, lora_rank=rank, lora_targets=list(config.LORA_TARGETS)))
    rng = np.random.default_rng(seed)
    return {t: {w: (rng.standard_normal(s.shape) * 0.02).astype(np.float32) for w, s in ab.items()}
            for t, ab in shapes.items()}


def serving_adapters_records(layout: Layout, sizes, page: int, n_adapters: int = 8, rank: int = 16,
                             rounds: int = 3) -> list[dict]:
    cfg = dataclasses.replace(layout.cfg, max_loras=n_adapters + 1, max_lora_rank=rank)
    layout = dataclasses.replace(layout, cfg=cfg)
    programs = Programs(layout)
    clients = sizes.serving_clients
    n_pages = sizing.for_server(programs, max_batch=clients, n_pages=AUTO, page_size=page, prefix_cache=False,
                                memory_fraction=MEMORY_FRACTION).n_pages
    engine = Engine(layout, random_decode_params(layout), _CharPerToken(), max_batch=clients, max_queue=4 * clients,
                    stop_token_ids=(), prefix_cache=False, n_pages=n_pages, page_size=page, programs=programs)
    precision = gptj.precision(cfg)
    described = dict(slots=engine.n_slots, pages=n_pages, page_size=page, prompt_len=sizes.serving_prompt_len,
                     seq=cfg.seq, layers=cfg.layers, d_model=cfg.d_model, dtype=precision.compute.name,
                     weight_dtype=precision.weights.name, kv_cache_dtype=cfg.kv_cache_dtype, adapters=n_adapters,
                     adapter_rank=rank, adapter_slots=cfg.max_loras, int8_dot=layout.policy.int8_dot)
    records = []
    try:
        for slot in range(n_adapters):
            engine.write_adapter(slot, random_adapter(cfg, rank, 100 + slot), float(rank) / rank).result()
        with tempfile.TemporaryDirectory() as root:  # one more, from a PEFT directory, into the last slot
            path = os.path.join(root, "adapter")
            peft.write_peft(path, random_adapter(cfg, rank, 99), cfg, rank, float(rank))
            start = time.perf_counter()
            adapters, scale = read_adapters(path, cfg)
            read_s = time.perf_counter() - start
            engine.write_adapter(n_adapters, adapters, scale).result()
            loaded_s = time.perf_counter() - start
            adapter_mb = sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path)) / 1e6
        records.append({"bench": "adapter_load", "read_s": round(read_s, 3), "load_s": round(loaded_s, 3),
                        "adapter_mb": round(adapter_mb, 1), "adapter_rank": rank, "goal_s": 2.0,
                        "met": loaded_s <= 2.0})
        rng = np.random.default_rng(0)
        prompts = rng.integers(0, cfg.n_vocab, (clients, sizes.serving_prompt_len)).tolist()
        spread = [i % n_adapters for i in range(clients)]
        new_tokens = sizes.serving_new_tokens
        _run_together(engine, prompts, new_tokens)  # compiles every page count the timed passes read
        _run_together(engine, prompts, new_tokens, spread)
        base, mixed = [], []
        for _ in range(rounds):
            base.append(_serving_record("base", [_run_together(engine, prompts, new_tokens)], new_tokens))
            mixed.append(_serving_record("adapters", [_run_together(engine, prompts, new_tokens, spread)],
                                         new_tokens))
    finally:
        engine.close()
    for name, runs in (("base", base), ("adapters", mixed)):
        records.append({**runs[len(runs) // 2], "bench": "serving_adapters", "mode": name, "concurrent": clients,
                        "rounds_tokens_per_s": [r["tokens_per_s"] for r in runs], **described})
    ratio = statistics.median(r["tokens_per_s"] for r in mixed) / statistics.median(r["tokens_per_s"] for r in base)
    records.append({"bench": "serving_adapters_ratio", "adapters_over_base": round(ratio, 3), "goal": ADAPTERS_GOAL,
                    "met": ratio >= ADAPTERS_GOAL})
    return records
