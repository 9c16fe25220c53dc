"""Accuracy of int8 weights (model/quant.py) against bf16 and f32 on the same weights: logit error, top-1
agreement, greedy tokens shared with f32, and lm-eval loglikelihood on a multiple-choice task.

Two models: the bench config and an 8-layer d_model 1024 one, on one CPU device; random weights (`table.init_unsharded`,
GPT-J's init), or with --train-steps N those weights after N steps of AdamW on windows of Python's standard library
sources (demo_corpus.py's text; nothing is downloaded). Logits are the decode programs' own (the params placed for
inference, f32 logits) over --prompts prompts of --prompt-len tokens, every position: random tokens, or held-out
corpus text for a trained model. The loglikelihood part scores --questions multiple-choice questions (a context, four
endings; the first is the answer) through the lm-eval adapter (`infer/harness.py`, what device_eval.py runs) and
reports each dtype's accuracy and how often int8 picks bf16's ending: random tokens, or for a trained model a
held-out passage whose true continuation is the answer and three copies of it with four tokens changing places the
wrong endings.
Random weights make nearly flat logits (a top-1 choice often within a rounding step of the next), so their figures
are a floor; a trained model's logits are peaked as a real model's are.

    python bench/bench_int8.py [--prompts 16] [--prompt-len 64] [--new-tokens 64] [--questions 64] [--train-steps 0]
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax
import numpy as np
import optax

from bench.bench_eval import requests
from bench.common import emit
from demo_corpus import stdlib_sources
from mesh_transformer import config, platforms
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


def corpus_tokens(n_chars: int) -> np.ndarray:
    """The first n_chars of the standard library's sources (demo_corpus.py's order), as GPT-2 tokens."""
    texts, total = [], 0
    for path in stdlib_sources():
        with open(path, encoding="utf-8", errors="replace") as f:
            texts.append(f.read())
        total += len(texts[-1])
        if total >= n_chars:
            break
    return np.array(load_tokenizer().encode("".join(texts)[:n_chars]), np.int32)


def windows(tokens: np.ndarray, n: int, length: int, rng: np.random.Generator) -> np.ndarray:
    starts = rng.integers(0, len(tokens) - length, n)
    return np.stack([tokens[s:s + length] for s in starts])


def train(cfg: config.Config, params: dict, tokens: np.ndarray, args: argparse.Namespace) -> dict:
    """The params after args.train_steps of AdamW (f32, lr 1e-3 after 20 warm-up steps) on random windows of
    `tokens`, batch 8 x args.train_len; the loss is emitted every quarter of the way."""
    policy = platforms.for_devices(jax.devices()[:1])
    optimizer = optax.adamw(optax.linear_schedule(1e-4, 1e-3, 20), weight_decay=0.0)

    @jax.jit
    def step(params, state, batch):
        loss, grads = jax.value_and_grad(lambda p: gptj.loss_fn(p, batch, cfg, policy=policy))(params)
        updates, state = optimizer.update(grads, state, params)
        return optax.apply_updates(params, updates), state, loss

    state, rng = optimizer.init(params), np.random.default_rng(1)
    for i in range(args.train_steps):
        params, state, loss = step(params, state, windows(tokens, 8, args.train_len + 1, rng))
        if (i + 1) % max(1, args.train_steps // 4) == 0 or i + 1 == args.train_steps:
            emit(bench="int8_training", model=cfg.name, step=i + 1, loss=round(float(loss), 3))
    return jax.tree.map(np.asarray, params)


def text_requests(tokens: np.ndarray, n_questions: int, rng: np.random.Generator, moved: int = 4) -> list:
    """(cache key, context, continuation) of n_questions x 4 endings from text: a passage, then its own
    continuation (the answer, first) and three copies of that continuation with `moved` of its tokens changing
    places (each moved to where a different token was): close to the answer, so the choice is not always easy.
    Passages whose continuation repeats too much for that are passed over."""
    out: list = []
    while len(out) < 4 * n_questions:
        context_len, ending_len = int(rng.integers(60, 121)), int(rng.integers(15, 41))
        start = int(rng.integers(0, len(tokens) - context_len - ending_len))
        context = tokens[start:start + context_len].tolist()
        ending = tokens[start + context_len:start + context_len + ending_len]
        shuffled = []
        for _ in range(20):
            where = rng.choice(ending_len, moved, replace=False)
            e = ending.copy()
            e[where] = ending[rng.permutation(where)]
            if np.sum(e != ending) == moved:
                shuffled.append(e)
        if len(shuffled) >= 3:
            out += [(None, context, e.tolist()) for e in [ending, *shuffled[:3]]]
    return out


def measure(name: str, overrides: list[str], args: argparse.Namespace) -> None:
    base = config.load("configs/bench.json", ["cores_per_replica=1", *overrides])
    cfgs = {dtype: dataclasses.replace(base, **keys) for dtype, keys in DTYPES.items()}
    params = jax.tree.map(np.asarray, table.init_unsharded(base, jax.random.PRNGKey(0)))
    rng = np.random.default_rng(0)
    if args.train_steps:
        tokens = corpus_tokens(args.corpus_chars)
        held_out = tokens[int(0.9 * len(tokens)):]
        params = train(dataclasses.replace(base, name=name), params, tokens[:len(held_out) * 9], args)
        ids = windows(held_out, args.prompts, args.prompt_len, rng)
        reqs = text_requests(held_out, args.questions, rng)
    else:
        ids = rng.integers(0, 50257, (args.prompts, args.prompt_len)).astype(np.int32)
        reqs = requests(args.questions, 50257)
    weights = "trained" if args.train_steps else "random"
    logits = {dtype: all_logits(cfg, params, ids) for dtype, cfg in cfgs.items()}
    spread = logits["f32"].std()
    for dtype in ("bf16", "int8"):
        for against in ("f32", "bf16") if dtype == "int8" else ("f32",):
            error = np.sqrt(np.mean((logits[dtype] - logits[against]) ** 2))
            emit(bench="int8_logits", model=name, weights=weights, dtype=dtype, against=against,
                 rms_error_over_spread=round(float(error / spread), 4),
                 top1_agreement=round(float(np.mean(logits[dtype].argmax(-1) == logits[against].argmax(-1))), 4))
    prompts = ids[:, :16].tolist()
    greedy = {dtype: sampling.Sampler(make_inference_layout(cfg, mesh=make_dp_mp(1, 1)), params).generate(
        prompts, args.new_tokens, temperature=0.0, stop_token_ids=[]) for dtype, cfg in cfgs.items()}
    for dtype in ("bf16", "int8"):
        shared = [shared_prefix(a.tokens, b.tokens) for a, b in zip(greedy[dtype], greedy["f32"])]
        emit(bench="int8_greedy", model=name, weights=weights, dtype=dtype, new_tokens=args.new_tokens,
             mean_tokens_before_parting_from_f32=round(float(np.mean(shared)), 1),
             same_token_fraction=round(float(np.mean([x == y for a, b in zip(greedy[dtype], greedy["f32"])
                                                     for x, y in zip(a.tokens, b.tokens)])), 3))
    chosen, accuracy = {}, {}
    for dtype, cfg in cfgs.items():
        layout = make_inference_layout(cfg, mesh=make_dp_mp(1, 1))
        lm = harness.MeshTransformerLM(layout, params, load_tokenizer(), batch_size=8)
        scores = np.array([ll for ll, _ in lm._loglikelihood_tokens(reqs, disable_tqdm=True)]).reshape(-1, 4)
        chosen[dtype] = scores.argmax(-1)
        accuracy[dtype] = float(np.mean(chosen[dtype] == 0))
    emit(bench="int8_loglikelihood", model=name, weights=weights, questions=args.questions,
         accuracy={k: round(100 * v, 1) for k, v in accuracy.items()},
         int8_minus_bf16_points=round(100 * (accuracy["int8"] - accuracy["bf16"]), 1),
         int8_picks_bf16s_ending=round(float(np.mean(chosen["int8"] == chosen["bf16"])), 3))


def add_text_args(parser: argparse.ArgumentParser, train_steps: int) -> None:
    """The prompts and the training of an accuracy bench (this one's and bench_kv_int8.py's)."""
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--train-steps", type=int, default=train_steps, help="train the model this many steps first")
    parser.add_argument("--train-len", type=int, default=64, help="the training windows' length in tokens")
    parser.add_argument("--corpus-chars", type=int, default=3_000_000, help="the training text's length")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_text_args(parser, train_steps=0)
    parser.add_argument("--questions", type=int, default=64)
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    args = parser.parse_args()
    for name in args.models:
        measure(name, MODELS[name], args)


if __name__ == "__main__":
    keep_host_memory()
    main()
