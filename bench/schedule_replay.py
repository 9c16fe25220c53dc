"""The paged serving engine's schedule at a serving shape, replayed on the CPU with a tiny model: the real engine
(admission, preemption, slots moved down, the decode row ladder) over the same pages and slots as the chip's run, its
tokens meaningless. One JSON line: the decode steps by the rows they compute, the requests live in them, the prompt
tokens prefilled (rows x bucket) and the preemptions; and the seconds a cost model gives that schedule
on one v5e for Llama-2-7B int8 with int8 pages (`COST`, fitted to the chip's two serving_paged runs at 1,024 + 1,024:
467.2 tokens/s under the reserve policy, 456.2 under grow; docs/performance.md). A model, not a measurement.

    python bench/schedule_replay.py --pages 1627 --policy grow    # 32 requests of 1,024 + 1,024, 64 slots
"""
from __future__ import annotations

import argparse
import collections
import os
import sys
import threading

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax
import numpy as np

from bench.common import emit, figure
from bench.suite_serving import _CharPerToken
from mesh_transformer import config
from mesh_transformer.infer.params import make_inference_layout
from mesh_transformer.model import table
from mesh_transformer.parallel.mesh import make_dp_mp
from mesh_transformer.serve.completion import GenerationRequest
from mesh_transformer.serve.engine import Engine

# Llama-2-7B int8, int8 pages of 16, one v5e: a decode step's fixed seconds by the rows it computes (16 and 64 fitted
# to the two runs, 32 and the small ones by decode_int8's measured differences), seconds per cached token it reads,
# and a prefill's seconds per prompt token.
COST = {"step_s": {1: 0.0136, 4: 0.0141, 16: 0.0156, 32: 0.0180, 64: 0.0221}, "cached_token_s": 0.38e-6,
        "prefill_token_s": 0.12 / 1024}
TINY = {"layers": 1, "d_model": 32, "n_heads": 2, "n_vocab": 256, "pe_rotary_dims": 4, "cores_per_replica": 1,
        "remat": False}


def step_s(rows: int) -> float:
    """A decode step's fixed seconds at this many rows: those of the fewest rows priced that hold them."""
    priced = sorted(COST["step_s"])
    return COST["step_s"][next((n for n in priced if n >= rows), priced[-1])]


def replay(pages: int, policy: str, requests: int, prompt: int, new: int, slots: int, page_size: int) -> dict:
    cfg = config.from_dict({**TINY, "seq": max(prompt + new, 64)})
    layout = make_inference_layout(cfg, mesh=make_dp_mp(1, 1, jax.devices()[:1]))
    steps, prefills = [], []

    class Traced(Engine):
        def _run_decode(self, steps_N, rows, n_blocks, live):
            steps.append((rows, len(live), sum(len(self._slots[i].context) for i in live)))
            return super()._run_decode(steps_N, rows, n_blocks, live)

        def _prefill(self, rows_per_group, width, batch, placements=None, ends=None):
            prefills.append(rows_per_group * width)
            return super()._prefill(rows_per_group, width, batch, placements, ends)

    rng = np.random.default_rng(0)
    params = jax.tree.map(lambda s: (rng.normal(size=s.shape) * 0.2).astype(np.float32), table.param_shapes(cfg))
    engine = Traced(layout, params, _CharPerToken(), max_batch=slots, max_queue=4 * requests, stop_token_ids=(),
                    prefix_cache=True, n_pages=pages, page_size=page_size, reserve_pages=policy == "reserve")
    done, failed = threading.Semaphore(0), []

    def on_event(event):
        if event.error:
            failed.append(event.error)
        if event.finish_reason or event.error:
            done.release()

    engine.submit([GenerationRequest(rng.integers(1, cfg.n_vocab, prompt).tolist(), new, on_event, temperature=0.0,
                                     logprobs=False) for _ in range(requests)])
    for _ in range(requests):
        done.acquire()
    preempted = engine.stats()["requests"]["preempted"]
    engine.close()
    if failed:
        raise RuntimeError(failed[0])
    seconds = (sum(step_s(rows) + cached * COST["cached_token_s"] for rows, _, cached in steps)
               + sum(prefills) * COST["prefill_token_s"])
    return {"bench": "schedule_replay", "policy": policy, "pages": pages, "page_size": page_size, "slots": slots,
            "requests": requests, "prompt_len": prompt, "new_tokens": new, "preempted": preempted,
            "decode_steps": len(steps),
            "steps_by_rows": dict(sorted(collections.Counter(rows for rows, _, _ in steps).items())),
            "mean_live": figure(sum(n for _, n, _ in steps) / max(1, len(steps))),
            "prefilled_tokens": sum(prefills), "model_s": figure(seconds),
            "model_tokens_per_s": figure(requests * new / seconds), "cost": COST}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pages", type=int, default=1627)
    parser.add_argument("--policy", choices=("grow", "reserve"), default="grow")
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--prompt", type=int, default=1024)
    parser.add_argument("--new", type=int, default=1024)
    parser.add_argument("--slots", type=int, default=64)
    parser.add_argument("--page-size", type=int, default=16)
    args = parser.parse_args()
    emit(**replay(args.pages, args.policy, args.requests, args.prompt, args.new, args.slots, args.page_size))


if __name__ == "__main__":
    main()
