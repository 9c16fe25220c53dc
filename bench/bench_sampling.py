"""Greedy decode tokens/s of our KV-cache sampler against HF GPTJForCausalLM.generate (torch), same weights.

Batch 1 is bound by reading the weights once per token, so it is also reported against the memory-bandwidth
roofline (measured here): bandwidth / bytes of weights read per token. One real CPU device, mp 1.

    python bench/bench_sampling.py [--config configs/bench.json] [--prompt-len 32] [--new-tokens 128]
        [--ab COMMIT [--ab-rounds 2]] [--dtype int8]

--dtype int8 measures ours with int8 weights (computed in bf16) against ours in bf16 instead of HF, batch by batch
in the same run, with the batch-1 roofline at int8's bytes.

--ab COMMIT runs the commit's copy of this bench and this tree's in alternating rounds (child processes, same
arguments) and prints each side's decode tokens/s per round and the median of the per-round ratios new / base, for
ours and, as the control for the machine's state, for HF's.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax
import numpy as np
import torch
from transformers import GPTJConfig, GPTJForCausalLM

from bench.ab import ab_rounds, median_ratios
from bench.common import best_time_s, emit, read_bandwidth_bytes_per_s
from mesh_transformer.model import table
from mesh_transformer.platforms import platform_setup
from mesh_transformer import config
from mesh_transformer.store import hf
from mesh_transformer.model import gptj as model
from mesh_transformer.infer import sampler as sampling
from mesh_transformer.infer.params import make_inference_layout
from mesh_transformer.parallel.mesh import make_dp_mp

BANDWIDTH_BYTES = 512 * 2 ** 20


def memory_bandwidth_bytes_per_s() -> dict[str, float]:
    """Streaming rates of a 512 MiB array: jax sum (reads) and numpy copy (reads + writes)."""
    a = np.ones(BANDWIDTH_BYTES // 4, np.float32)
    b = np.ones_like(a)
    copy_s = best_time_s(lambda: np.copyto(b, a), repeats=10)
    return {"jax_sum_read": read_bandwidth_bytes_per_s(BANDWIDTH_BYTES),
            "numpy_copy_read_write": 2 * BANDWIDTH_BYTES / copy_s}


def weight_bytes_per_token(cfg: config.Config, itemsize: int, matrix_itemsize: int | None = None) -> int:
    """Bytes read per decode step at batch 1: every weight except the embedding table, of which one row is read;
    the layers' matrices at `matrix_itemsize` bytes (int8: 1, plus a 4-byte scale per output) where given."""
    n_params = sum(int(np.prod(s.shape)) for s in jax.tree.leaves(table.param_shapes(cfg)))
    total = (n_params - cfg.n_vocab * cfg.d_model + cfg.d_model) * itemsize
    if matrix_itemsize is None:
        return total
    matrices = cfg.layers * (4 * cfg.d_model ** 2 + 2 * cfg.d_model * cfg.d_ff)
    scales = cfg.layers * (3 * cfg.d_model + cfg.d_ff + cfg.d_model)
    return total - matrices * (itemsize - matrix_itemsize) + scales * 4


def bench_ours(sampler: sampling.Sampler, prompts: list, new_tokens: int, repeats: int) -> tuple[float, float]:
    """(best seconds for all new tokens, best seconds for the first one: prefill)."""
    def run(n):
        results = sampler.generate(prompts, n, temperature=0.0, stop_token_ids=[])
        assert all(len(r.tokens) == n for r in results)

    return best_time_s(lambda: run(new_tokens), repeats), best_time_s(lambda: run(1), repeats)


def bench_hf(hf_model, prompts: np.ndarray, new_tokens: int, repeats: int) -> tuple[float, float]:
    ids = torch.from_numpy(prompts).long()

    def run(n):
        with torch.no_grad():
            out = hf_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                                    pad_token_id=0)
        assert out.shape[1] == ids.shape[1] + n

    return best_time_s(lambda: run(new_tokens), repeats), best_time_s(lambda: run(1), repeats)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/bench.json")
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--ab", metavar="COMMIT", help="A/B against this commit's copy of the bench")
    parser.add_argument("--ab-rounds", type=int, default=2)
    parser.add_argument("--dtype", choices=("int8",), help="int8 weights against bf16 (ours both), not HF")
    args = parser.parse_args()
    if args.ab:
        return ab(args)
    if args.dtype:
        return int8_against_bf16(args)
    cfg = config.load(args.config, ["cores_per_replica=1"])
    # Measured again after the decode runs, and the best kept: on a shared machine a low first reading would
    # flatter the fraction of the roofline.
    bandwidth = memory_bandwidth_bytes_per_s()
    emit(bench="memory_bandwidth", when="before", **{f"{k}_gb_per_s": round(v / 1e9, 2) for k, v in bandwidth.items()},
         devices=jax.device_count(), platform=jax.devices()[0].platform)

    params = jax.tree.map(np.asarray, table.init_unsharded(cfg, jax.random.PRNGKey(0)))
    sampler = sampling.Sampler(make_inference_layout(cfg, mesh=make_dp_mp(1, 1)), params)
    hf_cfg = GPTJConfig(**hf.hf_config(cfg))
    hf_model = GPTJForCausalLM(hf_cfg).eval()
    hf_model.load_state_dict({k: torch.from_numpy(v.copy()) for k, v in hf.params_to_hf(params, cfg).items()},
                             strict=False)
    hf_model.generation_config.eos_token_id = None  # random weights: decode all tokens on both sides
    itemsize = model.precision(cfg).compute.itemsize
    bytes_per_token = weight_bytes_per_token(cfg, itemsize)
    rng = np.random.default_rng(0)
    decode_steps = args.new_tokens - 1
    rows = []
    for batch in args.batches:
        prompts = rng.integers(0, 50257, (batch, args.prompt_len)).astype(np.int32)
        start_s = time.perf_counter()
        ours_total_s, ours_prefill_s = bench_ours(sampler, prompts.tolist(), args.new_tokens, args.repeats)
        ours_decode = batch * decode_steps / (ours_total_s - ours_prefill_s)
        rows.append(dict(bench="greedy_decode", impl="ours_jax", batch=batch, prompt_len=args.prompt_len,
                         new_tokens=args.new_tokens, decode_tokens_per_s=round(ours_decode, 1),
                         end_to_end_tokens_per_s=round(batch * args.new_tokens / ours_total_s, 1),
                         prefill_s=round(ours_prefill_s, 4), total_s=round(ours_total_s, 4),
                         compiles=sampler.compile_count, bench_wall_s=round(time.perf_counter() - start_s, 1)))
        hf_total_s, hf_prefill_s = bench_hf(hf_model, prompts, args.new_tokens, args.repeats)
        hf_decode = batch * decode_steps / (hf_total_s - hf_prefill_s)
        rows.append(dict(bench="greedy_decode", impl="hf_torch_generate", attn=hf_model.config._attn_implementation,
                         batch=batch, torch_threads=torch.get_num_threads(), decode_tokens_per_s=round(hf_decode, 1),
                         end_to_end_tokens_per_s=round(batch * args.new_tokens / hf_total_s, 1),
                         prefill_s=round(hf_prefill_s, 4), total_s=round(hf_total_s, 4),
                         ours_decode_speedup=round(ours_decode / hf_decode, 2)))
    after = memory_bandwidth_bytes_per_s()
    emit(bench="memory_bandwidth", when="after", **{f"{k}_gb_per_s": round(v / 1e9, 2) for k, v in after.items()})
    roofline = max(*bandwidth.values(), *after.values()) / bytes_per_token
    for row in rows:
        if row["batch"] == 1:
            row.update(roofline_tokens_per_s=round(roofline, 1), weight_mb_per_token=round(bytes_per_token / 1e6, 1),
                       fraction_of_roofline=round(row["decode_tokens_per_s"] / roofline, 3))
        emit(**row)


def int8_against_bf16(args) -> None:
    """Decode tokens/s of ours with int8 weights and with bf16 ones, each batch measured on both in turn."""
    cfg = config.load(args.config, ["cores_per_replica=1", "compute_dtype=bfloat16"])
    bandwidth = memory_bandwidth_bytes_per_s()
    params = jax.tree.map(np.asarray, table.init_unsharded(cfg, jax.random.PRNGKey(0)))
    samplers = {name: sampling.Sampler(make_inference_layout(c, mesh=make_dp_mp(1, 1)), params)
                for name, c in [("bf16", cfg), ("int8", dataclasses.replace(cfg, weight_dtype="int8"))]}
    bytes_per_token = {"bf16": weight_bytes_per_token(cfg, 2), "int8": weight_bytes_per_token(cfg, 2, 1)}
    rng, decode_steps = np.random.default_rng(0), args.new_tokens - 1
    for batch in args.batches:
        prompts = rng.integers(0, 50257, (batch, args.prompt_len)).tolist()
        decode = {}
        for name, sampler in samplers.items():
            total_s, prefill_s = bench_ours(sampler, prompts, args.new_tokens, args.repeats)
            decode[name] = batch * decode_steps / (total_s - prefill_s)
            row = dict(bench="greedy_decode", impl=f"ours_jax_{name}", batch=batch, prompt_len=args.prompt_len,
                       new_tokens=args.new_tokens, decode_tokens_per_s=round(decode[name], 1),
                       prefill_s=round(prefill_s, 4), total_s=round(total_s, 4))
            if batch == 1:
                roofline = max(bandwidth.values()) / bytes_per_token[name]
                row.update(roofline_tokens_per_s=round(roofline, 1),
                           weight_mb_per_token=round(bytes_per_token[name] / 1e6, 1),
                           fraction_of_roofline=round(decode[name] / roofline, 3))
            emit(**row)
        emit(bench="int8_over_bf16", batch=batch, decode_ratio=round(decode["int8"] / decode["bf16"], 3),
             goal=1.0 if batch == 1 else None)


def ab(args) -> None:
    passed = ["--config", args.config, "--prompt-len", str(args.prompt_len), "--new-tokens", str(args.new_tokens),
              "--repeats", str(args.repeats), "--batches", *map(str, args.batches)]

    def pick(record):
        if record.get("bench") == "greedy_decode":
            yield (record["impl"], record["batch"]), record["decode_tokens_per_s"]

    values = ab_rounds(args.ab, "bench/bench_sampling.py", passed, args.ab_rounds, pick)
    for (impl, batch), ratios, median in sorted(median_ratios(values), key=lambda r: (r[0][1], r[0][0])):
        sides = values[(impl, batch)]
        emit(bench="greedy_decode_ab", impl=impl, batch=batch, base=args.ab, base_decode_tokens_per_s=sides["base"],
             new_decode_tokens_per_s=sides["new"], new_over_base=[round(r, 3) for r in ratios],
             median_new_over_base=round(median, 3))


if __name__ == "__main__":
    platform_setup()
    main()
