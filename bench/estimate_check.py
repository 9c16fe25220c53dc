"""The estimator (`mesh_transformer/estimate.py`) against a chip's measured figures: compiles, for the chip's target and
without it, the steps `bench/device_suite.py` timed there (its train, LoRA and decode sections' shapes) and prints,
in JSON lines, each one's estimated step time beside the newest matching record of a results file, and their ratio.
Runs on a CPU machine (the target's compiler, compile-only); the measured side is what the results file holds.

    python bench/estimate_check.py [--results bench/results/tpu-v5-lite_2026-12-06.jsonl] [--topology v5litepod-1]
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from mesh_transformer import aot, estimate, targets
from mesh_transformer.infer.params import abstract_params, make_inference_layout
from mesh_transformer.infer.programs import Programs
from mesh_transformer.parallel.mesh import make_dp_mp

from bench.common import emit, figure
from bench.suite_parts import (GPTJ_6B, GPTJ_TRAIN, INT8, decode_attention, decode_blocks, int8_products,
                               model_config)

TRAIN = {"layers": 10, "micro_batches": 16}  # the suite's train section on a v5e (layers: as many as fit)
DECODE = {"bfloat16": (16, (1, 16)), "int8": (64, (1, 16, 32, 64))}  # weights: (cache slots, batches), as on a v5e
DECODE_CONTEXT, DECODE_STEPS = 128, 36  # the suite's cached positions and steps run (n_blocks from them)


def newest(records: list[dict], **match) -> tuple[dict | None, str | None]:
    """The last record with these values (a tuple: any of its values) and a step time, and the commit of the run it
    is from (its `meta` record's)."""
    found, commit = (None, None), None
    for r in records:
        if r["bench"] == "meta":
            commit = r.get("git_commit", r.get("commit"))
        elif "step_s" in r and all(r.get(k) in (v if isinstance(v, tuple) else (v,)) for k, v in match.items()):
            found = (r, commit)
    return found


def train_cases(devices: list) -> list[tuple[dict, object, dict]]:
    """(what, compiled step, the record's match) of the suite's full-training and LoRA steps."""
    cases = []
    full = model_config({**GPTJ_TRAIN, "layers": TRAIN["layers"]}, remat=True, per_replica_batch=1,
                        gradient_accumulation_steps=TRAIN["micro_batches"], compute_dtype="bfloat16",
                        parallelism="dp")
    lora = model_config({**GPTJ_6B, "seq": GPTJ_TRAIN["seq"]}, remat=True, lora_rank=16, base_dtype="bfloat16",
                        per_replica_batch=1, compute_dtype="bfloat16", parallelism="dp")
    for bench, cfg in (("train", full), ("train_lora_6b", lora),
                       ("train_lora_6b", dataclasses.replace(lora, remat_policy="save_qkv"))):
        programs = aot.training_programs(cfg, "dp", devices, {"fsdp": 1, "tensor": 1, "data": None})
        compiled = programs["train"].lower(programs["state"], programs["tokens"], programs["frozen"]).compile()
        attention = programs["layout"].policy.attention
        match = {"bench": bench, "layers": cfg.layers, "micro_batches": cfg.gradient_accumulation_steps,
                 "attention": attention, "remat": True, "batch": 1, "seq": cfg.seq,
                 "remat_policy": (cfg.remat_policy, None) if cfg.remat_policy == "full" else cfg.remat_policy}
        if attention == "splash":
            match["splash_block"] = (512, None)  # None: records from before the field, at the default 512
        cases.append(({"step": bench, "layers": cfg.layers, "attention": attention, "remat_policy": cfg.remat_policy,
                       "tokens": cfg.gradient_accumulation_steps * cfg.seq}, compiled, match))
    return cases


def decode_cases(devices: list) -> list[tuple[dict, object, dict]]:
    """(what, compiled step, the record's match) of the suite's GPT-J-6B decode steps (seq 256)."""
    cases = []
    for weights, (n_slots, batches) in DECODE.items():
        cfg = model_config({**GPTJ_6B, "seq": 256, **(INT8 if weights == "int8" else {})}, compute_dtype="bfloat16")
        layout = make_inference_layout(cfg, mesh=make_dp_mp(1, 1, devices))
        programs, params = Programs(layout), abstract_params(layout)
        blocks, n_blocks = decode_blocks(cfg.seq, DECODE_CONTEXT + DECODE_STEPS)
        cache, last, steps = aot._abstract_slots(programs, n_slots, blocks)
        for batch in batches:
            compiled, _ = aot._compile(programs.jitted["decode"], params, cache, last, steps, policy=layout.policy,
                                       rows=batch, n_blocks=n_blocks)
            int8_dot = int8_products(layout.policy, batch) if weights == "int8" else "compute"
            attention = decode_attention(layout.policy, batch)
            match = {"bench": "decode", "weight_dtype": weights, "batch": batch, "cache_slots": n_slots,
                     "decode_attention": attention if attention == "kernel" else ("xla", None)}  # None: before
            # records named it (XLA's, the only one then)
            if weights == "int8":  # a record names the products that ran; earlier ones the policy's choice, which
                # at 64 rows was the kernel until f1c6293 made it XLA's (the newest record is the one taken)
                match["int8_dot"] = int8_dot if int8_dot == layout.policy.int8_dot else (int8_dot, "kernel")
            cases.append(({"step": f"decode_{weights}", "batch": batch, "int8_dot": int8_dot,
                           "decode_attention": attention, "tokens": batch},
                          compiled, match))
    return cases


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--results", default="bench/results/tpu-v5-lite_2026-12-06.jsonl")
    ap.add_argument("--topology", default="v5litepod-1")
    ap.add_argument("--only", default="train,decode", help="train, decode or both")
    args = ap.parse_args()
    with open(args.results) as f:
        records = [json.loads(line) for line in f if line.strip()]
    target = targets.target(args.topology)
    devices = targets.compile_devices(target)
    emit(bench="meta", script="estimate_check", target=target.name, results=args.results,
         attained=list(target.chip.attained))
    cases = (train_cases(devices) if "train" in args.only else []) + \
        (decode_cases(devices) if "decode" in args.only else [])
    for what, compiled, match in cases:
        est = estimate.step_estimate(compiled, target.chip, what["tokens"], 1.0)
        measured, commit = newest(records, **match)
        emit(bench="estimate_check", **what, estimated_step_s=figure(est["estimated_step_s"]),
             measured_step_s=measured and measured["step_s"], measured_commit=commit,
             estimated_over_measured=measured and figure(est["estimated_step_s"] / measured["step_s"], 3))


if __name__ == "__main__":
    main()
