"""bench/device_suite.py --tiny runs on CPU inside the test suite, so the suite that is run when an accelerator
appears cannot rot unseen; its sizing for an accelerator is checked against a 16 GiB chip's memory."""
import dataclasses
import json
import math

import jax

from bench.suite_parts import (GPTJ_6B, HEADROOM, INT8, decode_bytes, device_sizes, model_config, one_device_layout,
                               train_bytes)
from bench.suite_serving import paged_capacity
from tests.helpers import run_script

RECORDS = {"meta", "device", "train", "train_lora_6b", "decode", "serving", "serving_speedup", "serving_paged",
           "serving_paged_capacity", "serving_adapters", "serving_adapters_ratio", "adapter_load", "compile", "memory"}
SECTIONS = {"device", "train", "train_lora", "decode", "decode_int8", "serving", "serving_paged", "serving_adapters"}
V5E_BYTES_LIMIT = 16_909_336_064  # what one TPU v5e chip's memory_stats() says


def numbers(record):
    """Every number in a record, nested ones too (booleans are not figures)."""
    for value in record.values():
        if isinstance(value, dict):
            yield from numbers(value)
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            yield value


def test_tiny_suite_emits_every_record_with_finite_positive_figures(tmp_path):
    out = tmp_path / "run.jsonl"
    result = run_script("bench/device_suite.py", "--tiny", "--out", str(out))
    assert result.returncode == 0, result.stderr[-2000:]
    records = [json.loads(line) for line in result.stdout.splitlines()]
    assert [json.loads(line) for line in out.read_text().splitlines()] == records
    assert {r["bench"] for r in records} == RECORDS
    assert not [r for r in records if "error" in r]
    meta = records[0]
    assert meta["bench"] == "meta" and meta["git_commit"] and meta["date_utc"] and meta["device_kind"] == "cpu"
    for record in records:
        if record["bench"] not in ("meta", "memory"):  # (counts of what happened in a pass may be 0)
            figures = list(numbers({k: v for k, v in record.items() if k not in ("preempted", "compiled_in_pass")}))
            assert figures and all(math.isfinite(x) and x > 0 for x in figures), record
    for weights in ("float32", "int8"):
        assert sorted(r["batch"] for r in records if r["bench"] == "decode" and r["weight_dtype"] == weights) == [1, 4]
    assert {r["mode"] for r in records if r["bench"] == "serving"} == {"concurrent", "one_at_a_time"}
    paged = [r for r in records if r["bench"] == "serving_paged"]
    assert [(r["page_policy"], r["concurrent"]) for r in paged] == [("grow", 1), ("grow", 8), ("reserve", 1),
                                                                     ("reserve", 8)]
    assert {r["kv_cache_dtype"] for r in paged} == {"int8"} and all(r["compiled_in_pass"] == 0 for r in paged)
    adapters = [r for r in records if r["bench"] == "serving_adapters"]
    assert [r["mode"] for r in adapters] == ["base", "adapters"]
    assert all(r["adapters"] == 8 and r["adapter_slots"] == 9 and len(r["rounds_tokens_per_s"]) == 3 for r in adapters)
    assert {r["section"] for r in records if r["bench"] == "compile"} == SECTIONS
    memory = [r for r in records if r["bench"] == "memory"]
    assert {r["section"] for r in memory} == SECTIONS
    assert all(r["live_arrays"] == 0 and r["live_bytes"] == 0 for r in memory), memory


def test_sizes_for_a_16_gib_chip_fit_its_memory():
    device = jax.devices("cpu")[0]
    sizes = device_sizes(device, V5E_BYTES_LIMIT, compute_dtype="bfloat16")
    plan = HEADROOM * V5E_BYTES_LIMIT
    assert sizes.decode_batches == (1, 8, 16) and sizes.decode_int8_batches == (1, 16, 32, 64)
    assert sizes.serving_slots == 8 and sizes.serving_model["seq"] == 2048
    assert sizes.train_model["layers"] == 10
    for model, batches in ((sizes.decode_model, sizes.decode_batches),
                           ({**sizes.decode_model, **INT8}, sizes.decode_int8_batches),
                           (sizes.serving_model, (sizes.serving_slots,))):
        layout = one_device_layout(model_config({**GPTJ_6B, **model}, compute_dtype="bfloat16"), device)
        assert decode_bytes(layout, max(batches))["total"] <= plan
        assert decode_bytes(layout, 2 * max(batches))["total"] > plan  # the next batch up would not fit
    cfg = model_config(sizes.train_model, compute_dtype="bfloat16")
    assert train_bytes(cfg, sizes.train_batch)["total"] <= plan
    paged = one_device_layout(model_config(sizes.serving_model, compute_dtype="bfloat16", kv_cache_dtype="int8"),
                              device)
    capacity = paged_capacity(paged, sizes, 16, V5E_BYTES_LIMIT)  # 256 + 128-token requests against 2048-slots
    assert capacity["slots_of_full_context"] == 8 and capacity["requests_that_fit"] >= 6 * 8
    assert train_bytes(dataclasses.replace(cfg, layers=cfg.layers + 1), sizes.train_batch)["total"] > plan


def test_the_ab_flags_set_attention_layout_sequence_and_int8_products():
    """`--attention` (the A/B of training attention: both sides on the GSPMD layout, where splash runs),
    `--train-seq`, `--train-layers` and `--train-set` reach the train records, `--int8-dot` and `--cache-order` the
    int8 decode records (the tiny model's products are XLA's either way: 64 wide, not whole lanes; a bad order is a
    one-line error); on a chip the train model's layers are refitted to longer rows unless given."""
    result = run_script("bench/device_suite.py", "--tiny", "--only", "train,train_lora,decode_int8", "--attention",
                        "xla", "--train-seq", "32", "--train-layers", "3", "--int8-dot", "kernel", "--train-set",
                        "remat=false", "--splash-block", "256", "--cache-order", "0,1,2,3")
    assert result.returncode == 0, result.stderr[-2000:]
    records = [json.loads(line) for line in result.stdout.splitlines()]
    decodes = [r for r in records if r["bench"] == "decode"]
    assert decodes and all(r["int8_dot"] == "kernel" and r["tokens_per_s"] > 0 for r in decodes)
    assert all(r["cache_order"] == "0,1,2,3" for r in decodes)  # the TPU's order, where the CPU's is 0,2,3,1
    trains = [r for r in records if r["bench"] in ("train", "train_lora_6b")]
    assert [(r["attention"], r["parallelism"], r["seq"], r["remat"]) for r in trains] == [("xla", "dp", 32, False)] * 2
    assert all(r["splash_block"] is None for r in trains)  # XLA's attention has no blocks to report
    assert trains[0]["layers"] == 3
    longer = device_sizes(jax.devices("cpu")[0], V5E_BYTES_LIMIT, compute_dtype="bfloat16", train_seq=8192)
    assert longer.train_model["seq"] == longer.lora_model["seq"] == 8192
    assert 1 <= longer.train_model["layers"] < 10
    bad = run_script("bench/device_suite.py", "--tiny", "--only", "decode", "--cache-order", "1,0,2,3")
    assert bad.returncode == 2 and "--cache-order must be a permutation of 0,1,2,3 starting with 0" in bad.stderr


def test_model_serving_shape_and_concurrency_flags_reach_the_records():
    """`--model llama3_8b` (the tiny sizes take its family and grouped key heads), `--serving-shape`, `--concurrent`,
    `--memory-fraction`, `--page-policies` and `--profile-steps` (serving_paged traces a pass more: a CPU trace has
    no device ops, but the pass and its window run); a bad count, fraction or policy is a one-line error."""
    result = run_script("bench/device_suite.py", "--tiny", "--model", "llama3_8b", "--only", "decode,serving_paged",
                        "--serving-shape", "6,5", "--concurrent", "3", "--memory-fraction", "0.5",
                        "--profile-steps", "1", "--page-policies", "reserve")
    assert result.returncode == 0, result.stderr[-2000:]
    records = [json.loads(line) for line in result.stdout.splitlines()]
    decodes = [r for r in records if r["bench"] == "decode"]
    assert decodes and all((r["family"], r["kv_heads"]) == ("llama", 2) for r in decodes)
    paged = [r for r in records if r["bench"] == "serving_paged"]
    assert [(r["concurrent"], r["prompt_len"], r["new_tokens"], r["tokens"]) for r in paged] == [(3, 6, 5, 15)]
    assert paged[0]["memory_fraction"] == 0.5 and paged[0]["page_policy"] == "reserve"
    profiles = [r for r in records if r["bench"] == "serving_profile"]
    assert [(r["concurrent"], r["at_once"], r["ops"]) for r in profiles] == [(3, 3, 0)]
    assert profiles[0]["host_top"]  # the engine's thread traced
    bad = run_script("bench/device_suite.py", "--tiny", "--only", "decode", "--serving-shape", "1024")
    assert bad.returncode == 2 and "--serving-shape must be 2 positive integer(s)" in bad.stderr
    bad = run_script("bench/device_suite.py", "--tiny", "--only", "serving_paged", "--memory-fraction", "1.5")
    assert bad.returncode == 2 and "--memory-fraction must be in (0, 1], got 1.5" in bad.stderr
    bad = run_script("bench/device_suite.py", "--tiny", "--only", "serving_paged", "--page-policies", "grow,lazy")
    assert bad.returncode == 2 and "--page-policies must name some of grow, reserve once each" in bad.stderr


def test_a_trace_sums_the_hosts_events_and_a_cpu_trace_has_no_device_ops(tmp_path):
    import jax.numpy as jnp

    from bench.common import _kind, device_op_times

    square = jax.jit(lambda a: jnp.tanh(a @ a))
    a = jnp.ones((64, 64))
    square(a).block_until_ready()
    with jax.profiler.trace(str(tmp_path)):
        for _ in range(2):
            square(a).block_until_ready()
    got = device_op_times(str(tmp_path), steps=2)
    assert got["ops"] == 0 and got["top_ops"] == [] and got["modules_us_per_step"] == 0
    calls = [h for h in got["host_top"] if h["event"].startswith("PjitFunction(")]  # the jitted calls, on the host
    assert calls and all(h["us_per_step"] > 0 for h in calls), got["host_top"]
    # A TPU op's kind: its name less the number, its result's type, a custom call's target.
    assert _kind('%_decode.80 = bf16[32,28672]{1,0:T(8,128)} custom-call(s8[28672,4096]{1,0} %b.3), '
                 'custom_call_target="tpu_custom_call"') == "_decode bf16[32,28672] tpu_custom_call"
    assert _kind("%fusion.30 = bf16[28672]{0:T(1024)} fusion(%p), kind=kLoop") == "fusion bf16[28672]"
