"""Accuracy of int8 weights (model/quant.py) against bf16 and f32 on the same random weights: logit error, top-1
agreement, greedy tokens shared with f32, and lm-eval loglikelihood on a multiple-choice task.

Two models: the bench config and an 8-layer d_model 1024 one; random weights (`table.init_unsharded`, GPT-J's init)
on one CPU device. Logits are the decode programs' own (the params placed for inference, f32 logits) over
--prompts random prompts of --prompt-len tokens, every position. The loglikelihood part scores --questions
multiple-choice questions (a context, four endings; the first is taken as the answer) through the lm-eval adapter
(`infer/harness.py`, what device_eval.py runs) and reports each dtype's accuracy and how often int8 picks bf16's
ending. Random weights make nearly flat logits, so these figures are a floor for trained ones.

    python bench/bench_int8.py [--prompts 16] [--prompt-len 64] [--new-tokens 64] [--questions 64]
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax
import numpy as np

from bench.bench_eval import requests
from bench.common import emit
from mesh_transformer import config
from mesh_transformer.infer import harness, sampler as sampling
from mesh_transformer.infer.params import make_inference_layout, place_params
from mesh_transformer.model import gptj, table
from mesh_transformer.parallel.mesh import make_dp_mp
from mesh_transformer.platforms import keep_host_memory
from mesh_transformer.tokenizer import load_tokenizer

DTYPES = {"f32": {"compute_dtype": "float32"}, "bf16": {"compute_dtype": "bfloat16"},
          "int8": {"compute_dtype": "bfloat16", "weight_dtype": "int8"}}
MODELS = {"bench": [], "8x1024": ["layers=8", "d_model=1024", "n_heads=16"]}


def all_logits(cfg: config.Config, params: dict, ids: np.ndarray) -> np.ndarray:
    """Logits [B, T, V] of the params placed for inference in cfg's dtypes."""
    layout = make_inference_layout(cfg, mesh=make_dp_mp(1, 1))
    placed = place_params(params, layout)
    run = jax.jit(lambda p, x: gptj.run(p, x, gptj.positions(x), cfg, policy=layout.policy)[0])
    return np.asarray(run(placed, ids), np.float32)


def shared_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def measure(name: str, overrides: list[str], args: argparse.Namespace) -> None:
    base = config.load("configs/bench.json", ["cores_per_replica=1", *overrides])
    cfgs = {dtype: dataclasses.replace(base, **keys) for dtype, keys in DTYPES.items()}
    params = jax.tree.map(np.asarray, table.init_unsharded(base, jax.random.PRNGKey(0)))
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 50257, (args.prompts, args.prompt_len)).astype(np.int32)
    logits = {dtype: all_logits(cfg, params, ids) for dtype, cfg in cfgs.items()}
    spread = logits["f32"].std()
    for dtype in ("bf16", "int8"):
        for against in ("f32", "bf16") if dtype == "int8" else ("f32",):
            error = np.sqrt(np.mean((logits[dtype] - logits[against]) ** 2))
            emit(bench="int8_logits", model=name, dtype=dtype, against=against,
                 rms_error_over_spread=round(float(error / spread), 4),
                 top1_agreement=round(float(np.mean(logits[dtype].argmax(-1) == logits[against].argmax(-1))), 4))
    prompts = ids[:, :16].tolist()
    greedy = {dtype: sampling.Sampler(make_inference_layout(cfg, mesh=make_dp_mp(1, 1)), params).generate(
        prompts, args.new_tokens, temperature=0.0, stop_token_ids=[]) for dtype, cfg in cfgs.items()}
    for dtype in ("bf16", "int8"):
        shared = [shared_prefix(a.tokens, b.tokens) for a, b in zip(greedy[dtype], greedy["f32"])]
        emit(bench="int8_greedy", model=name, dtype=dtype, new_tokens=args.new_tokens,
             mean_tokens_before_parting_from_f32=round(float(np.mean(shared)), 1),
             same_token_fraction=round(float(np.mean([x == y for a, b in zip(greedy[dtype], greedy["f32"])
                                                     for x, y in zip(a.tokens, b.tokens)])), 3))
    reqs = requests(args.questions, 50257)
    chosen, accuracy = {}, {}
    for dtype, cfg in cfgs.items():
        layout = make_inference_layout(cfg, mesh=make_dp_mp(1, 1))
        lm = harness.MeshTransformerLM(layout, params, load_tokenizer(), batch_size=8)
        scores = np.array([ll for ll, _ in lm._loglikelihood_tokens(reqs, disable_tqdm=True)]).reshape(-1, 4)
        chosen[dtype] = scores.argmax(-1)
        accuracy[dtype] = float(np.mean(chosen[dtype] == 0))
    emit(bench="int8_loglikelihood", model=name, questions=args.questions,
         accuracy={k: round(100 * v, 1) for k, v in accuracy.items()},
         int8_minus_bf16_points=round(100 * (accuracy["int8"] - accuracy["bf16"]), 1),
         int8_picks_bf16s_ending=round(float(np.mean(chosen["int8"] == chosen["bf16"])), 3))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--questions", type=int, default=64)
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    args = parser.parse_args()
    for name in args.models:
        measure(name, MODELS[name], args)


if __name__ == "__main__":
    keep_host_memory()
    main()
