"""lm-eval loglikelihood throughput: our adapter against lm-eval's own `hf` model on the same weights and machine.

The requests are multiple-choice questions as HellaSwag's are: a context of 60 to 120 tokens with four endings of
15 to 40 tokens each, so each context is shared by four requests. Both models score the same token requests
(`_loglikelihood_tokens`, below lm-eval's tokenization); ours is timed after one warm-up pass (its compiles are
reported apart), theirs on its first pass (torch does not compile). The largest difference of the log-likelihoods
is reported too.

    python bench/bench_eval.py [--config configs/bench.json] [--questions 32] [--batch-size 8]
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax
import numpy as np
import torch

from bench.common import emit
from mesh_transformer import config
from mesh_transformer.platforms import keep_host_memory
from mesh_transformer.infer import harness
from mesh_transformer.infer.params import make_inference_layout, read_params
from mesh_transformer.tokenizer import load_tokenizer
from tests.helpers import random_eval_params, write_hf_dir


def requests(n_questions: int, vocab: int, seed: int = 0) -> list:
    """(cache key, context tokens, continuation tokens) of n_questions x 4 endings."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n_questions):
        context = rng.integers(0, vocab, rng.integers(60, 121)).tolist()
        for _ in range(4):
            out.append((None, context, rng.integers(0, vocab, rng.integers(15, 41)).tolist()))
    return out


def timed(fn) -> tuple[list, float]:
    start = time.perf_counter()
    result = fn()
    return result, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/bench.json")
    parser.add_argument("--questions", type=int, default=32)
    parser.add_argument("--batch-size", type=int, default=8)
    args = parser.parse_args()
    cfg = config.load(args.config, ["cores_per_replica=1"])
    reqs = requests(args.questions, 50257)
    with tempfile.TemporaryDirectory() as tmp:
        hf_dir = write_hf_dir(tmp, random_eval_params(cfg), cfg)
        layout = make_inference_layout(cfg)
        ours = harness.MeshTransformerLM(layout, read_params(layout, hf_dir), load_tokenizer(),
                                         batch_size=args.batch_size)
        _, cold_s = timed(lambda: ours._loglikelihood_tokens(reqs, disable_tqdm=True))
        our_results, our_s = timed(lambda: ours._loglikelihood_tokens(reqs, disable_tqdm=True))
        from lm_eval.models.huggingface import HFLM

        theirs = HFLM(pretrained=hf_dir, dtype="float32", device="cpu", batch_size=args.batch_size)
        their_results, their_s = timed(lambda: theirs._loglikelihood_tokens(reqs, disable_tqdm=True))
    diff = max(abs(a[0] - b[0]) for a, b in zip(our_results, their_results))
    common = {"requests": len(reqs), "batch_size": args.batch_size, "platform": jax.devices()[0].platform,
              "devices": len(jax.devices()), "torch_threads": torch.get_num_threads()}
    emit(bench="loglikelihood", impl="ours_jax", requests_per_s=round(len(reqs) / our_s, 1), seconds=round(our_s, 2),
         first_pass_s=round(cold_s, 2), compiles=ours.scorer.traces, **common)
    emit(bench="loglikelihood", impl="lm_eval_hf_torch", requests_per_s=round(len(reqs) / their_s, 1),
         seconds=round(their_s, 2), ours_speedup=round(their_s / our_s, 2), max_abs_diff=float(f"{diff:.2g}"),
         greedy_agree=all(a[1] == b[1] for a, b in zip(our_results, their_results)), **common)


if __name__ == "__main__":
    keep_host_memory()
    main()
