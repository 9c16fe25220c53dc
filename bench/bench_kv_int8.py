"""Accuracy of the int8 paged KV cache (`kv_cache_dtype: "int8"`, infer/paged.py) against the bf16 one on the same
weights: each of --prompts held-out passages prefilled into pages, then --new-tokens decode steps fed the passage's
own next tokens (teacher-forced, so both caches see the same inputs), the logits of every step compared (relative
RMS error, top-1 agreement), and greedy continuations from each cache compared (tokens shared before they differ).

The bench config's model on one CPU device, bf16 compute and weights, trained --train-steps of AdamW on Python's
standard library sources first (bench_int8.py's training: a trained model's logits are peaked as a real model's are;
random weights' are nearly flat, so their agreement is a floor).

    python bench/bench_kv_int8.py [--prompts 16] [--prompt-len 64] [--new-tokens 64] [--train-steps 100]
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax
import numpy as np

from bench.bench_int8 import add_text_args, corpus_tokens, shared_prefix, train, windows
from bench.common import emit, figure
from mesh_transformer import config
from mesh_transformer.infer import paged
from mesh_transformer.infer.params import make_inference_layout, place_params
from mesh_transformer.model import table
from mesh_transformer.parallel.mesh import make_dp_mp

PAGE = 16


def decode_logits(cfg: config.Config, params: dict, ids: np.ndarray, prompt_len: int,
                  greedy: bool) -> tuple[np.ndarray, np.ndarray]:
    """(logits [B, steps + 1, V] after the prompt and after each decode step, tokens fed [B, steps]): the rows'
    prompts prefilled into pages, then one token a step, the passage's own (teacher-forced) or the greedy choice."""
    layout = make_inference_layout(cfg, mesh=make_dp_mp(1, 1))
    placed = place_params(params, layout)
    rows, steps = len(ids), ids.shape[1] - prompt_len
    width = -(-ids.shape[1] // PAGE)
    table_RxM = np.arange(rows * width, dtype=np.int32).reshape(rows, width)
    cache = paged.zero_cache(rows * width, PAGE, cfg, layout.policy)
    run = jax.jit(lambda p, c, i, s, n, read: paged.paged_logits(p, c, i, s, n, table_RxM, cfg, read,
                                                                 policy=layout.policy), static_argnums=5)
    logits, cache = run(placed, cache, ids[:, :prompt_len], np.zeros(rows, np.int32),
                        np.full(rows, prompt_len, np.int32), 0)
    out, fed = [np.asarray(logits, np.float32)], []
    for t in range(steps):
        token = out[-1].argmax(-1).astype(np.int32) if greedy else ids[:, prompt_len + t]
        fed.append(token)
        position = np.full(rows, prompt_len + t, np.int32)
        logits, cache = run(placed, cache, token[:, None], position, np.ones(rows, np.int32),
                            -(-(prompt_len + t + 1) // PAGE))
        out.append(np.asarray(logits, np.float32))
    return np.stack(out, 1), np.stack(fed, 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_text_args(parser, train_steps=100)
    args = parser.parse_args()
    base = config.load("configs/bench.json", ["cores_per_replica=1", "compute_dtype=bfloat16"])
    tokens = corpus_tokens(args.corpus_chars)
    held_out, train_tokens = tokens[:len(tokens) // 10], tokens[len(tokens) // 10:]
    params = jax.tree.map(np.asarray, table.init_unsharded(base, jax.random.PRNGKey(0)))
    if args.train_steps:
        params = train(base, params, train_tokens, args)
    ids = windows(held_out, args.prompts, args.prompt_len + args.new_tokens, np.random.default_rng(2))
    runs = {name: config.from_dict({**base.to_dict(), "kv_cache_dtype": name}) for name in ("compute", "int8")}
    forced = {name: decode_logits(cfg, params, ids, args.prompt_len, greedy=False)[0] for name, cfg in runs.items()}
    ref, ours = forced["compute"], forced["int8"]
    error = np.sqrt(np.mean((ours - ref) ** 2, axis=-1)) / ref.std(axis=-1)
    emit(bench="kv_int8_logits", model=base.name, train_steps=args.train_steps, prompts=args.prompts,
         prompt_len=args.prompt_len, steps=args.new_tokens, relative_rms_error=figure(float(error.mean())),
         relative_rms_error_max=figure(float(error.max())),
         top1_agreement=figure(float(np.mean(ours.argmax(-1) == ref.argmax(-1)))),
         top1_agreement_after_prompt=figure(float(np.mean(ours[:, 1:].argmax(-1) == ref[:, 1:].argmax(-1)))))
    greedy = {name: decode_logits(cfg, params, ids, args.prompt_len, greedy=True)[1] for name, cfg in runs.items()}
    shared = [shared_prefix(a.tolist(), b.tolist()) for a, b in zip(greedy["compute"], greedy["int8"])]
    emit(bench="kv_int8_greedy", model=base.name, train_steps=args.train_steps, new_tokens=args.new_tokens,
         identical=int(sum(s == args.new_tokens for s in shared)), prompts=args.prompts,
         shared_tokens_mean=figure(float(np.mean(shared))), shared_tokens_min=int(min(shared)))


if __name__ == "__main__":
    main()
