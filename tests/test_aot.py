import dataclasses
import json
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest

from mesh_transformer import aot, config
from mesh_transformer.config import ConfigError
from mesh_transformer.infer.decode import block_sizes, default_block
from mesh_transformer.infer.params import abstract_params
from mesh_transformer.infer.programs import Programs

CFG = config.load("configs/tiny_rot_partial.json", ["cores_per_replica=1", "remat=false", "warmup_steps=0"])


def test_aot_check_reports_memory_and_whether_it_fits():
    # Inference on the same devices at the width the sampling and serving tools choose (cores_per_replica), not
    # the training mesh's tensor width.
    records = aot.run(dataclasses.replace(CFG, cores_per_replica=4), "fsdp_tp", "fsdp=4,tensor=2", 8, "1KiB")
    train, load, decode, prefill, extend, paged, sample, scorer, fit = json.loads(json.dumps(records))  # as printed
    assert load["check"] == "load_params" and load["programs"] > 0 and "refused" not in load
    assert [r["check"] for r in (decode, prefill, extend, paged, sample, scorer)] == [
        "serve_decode_step", "serve_prefill", "serve_extend", "serve_paged_decode_step", "sample_decode_step", "scorer"]
    # the paged cache holds the slots' bytes in pages; a page costs its keys and values, whatever else the step needs
    assert paged["kv_cache_bytes"] == pytest.approx(decode["kv_cache_bytes"], rel=0.01)
    # f32 keys and values, a device's heads (mp 4), its group's share of a page count (dp 2)
    page_bytes = 2 * CFG.layers * paged["page_size"] * (CFG.d_model // 4) * 4 / 2
    assert paged["per_page_bytes"] == pytest.approx(page_bytes, rel=0.25)
    assert extend["prompt_tokens"] == CFG.seq // 2 and extend["total_bytes"] >= extend["kv_cache_bytes"]
    assert train["compiler"] == scorer["compiler"] == "XLA:CPU (faked devices)" and train["target"] == "cpu-8"
    assert decode["decode_mesh"] == {"dp": 2, "mp": 4} and decode["slots"] == 8
    # The decode step holds the params and the cache, little else, and more slots fit more memory.
    assert decode["total_bytes"] <= 1.5 * (decode["params_bytes"] + decode["kv_cache_bytes"])
    fit_slots = decode["slots_that_fit"]
    assert 0 < fit_slots["16GiB"] <= fit_slots["24GiB"] <= fit_slots["80GiB"]
    assert train["mesh"] == {"data": 1, "fsdp": 4, "tensor": 2} and train["tokens"] == [1, 4, CFG.seq + 1]
    assert train["params_bytes"] == pytest.approx(4 * train["params"] / 8, rel=0.05)  # f32, split 8 ways
    assert 0 < train["temp_bytes"] < 2 ** 30 and decode["kv_cache_bytes"] > 0
    assert not fit["fits"] and "does NOT fit in 1.00 KiB" in aot.human_line(records)
    assert aot.verdict([train, decode], config.parse_size("1GiB"))["fits"]


def test_aot_check_rejects_a_gspmd_mesh_for_the_shard_map_path():
    with pytest.raises(ConfigError, match="--mesh is for the GSPMD modes"):
        aot.run(CFG, "shard_map", "fsdp=8", 8, "16GiB")


def test_aot_check_cli_reports_bad_input_on_one_line():
    result = subprocess.run([sys.executable, "aot_check.py", "--config", "configs/tiny_rot_partial.json", "--mode",
                             "shard_map", "--mesh", "fsdp=8"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == ["error: --mesh is for the GSPMD modes; the shard_map path takes mp "
                                                  "from cores_per_replica"]


def test_bf16_inference_programs_hold_one_layer_in_f32_at_a_time_not_the_model():
    # XLA's CPU dot converts bf16 weights to f32; untied, all layers' copies were alive at once (2x the params).
    cfg = config.from_dict({"layers": 8, "d_model": 256, "n_heads": 4, "n_vocab": 512, "pe_rotary_dims": 16,
                            "seq": 64, "cores_per_replica": 1, "per_replica_batch": 1,
                            "compute_dtype": "bfloat16"})
    records = aot.measure(cfg, "shard_map", aot.start_devices(1), {}, inference_only=True)
    assert [r["check"] for r in records[:4]] == ["serve_decode_step", "serve_prefill", "serve_extend",
                                                 "serve_paged_decode_step"]
    for record in records[:4]:  # the decode stack's programs (the scorer does not order its converts)
        assert record["temp_bytes"] < 0.7 * record["params_bytes"], record  # untied: 2.8x


def test_aot_check_reports_the_lora_train_step():
    cfg = dataclasses.replace(CFG, lora_rank=4, base_dtype="bfloat16", cores_per_replica=2)
    train, *_ = aot.run(cfg, "shard_map", "", 8, "16GiB", no_loop_hoisting=True, train_only=True)
    assert train["check"] == "lora_train_step" and train["lora_rank"] == 4 and train["base_dtype"] == "bfloat16"
    assert train["params_bytes"] == pytest.approx(2 * train["params"] / 2, rel=0.1)  # the base in bf16, mp 2
    assert train["adapters_bytes"] < train["params_bytes"] / 4 and train["opt_state_bytes"] < train["params_bytes"]
    assert "LoRA rank 4 train step" in aot.human_line([train, *_])


def test_a_prompts_rest_after_a_cached_prefix_updates_the_cache_in_place():
    # Its writes (the prefix copied in, the new keys) come after attention's reads of the slot; unordered, XLA kept
    # them apart by copying every block of the cache (192 MiB of the bench config's 32 slots).
    layout = aot._inference_layout(aot.training_programs(CFG, "shard_map", aot.start_devices(1), None)["layout"])
    programs = Programs(layout)
    cache, last, _ = aot._abstract_slots(programs, 8, block_sizes(CFG.seq, default_block(CFG.seq)))
    ids, rows = jax.ShapeDtypeStruct((1, 16), jnp.int32), jax.ShapeDtypeStruct((1,), jnp.int32)
    hlo = programs.jitted["extend"].lower(abstract_params(layout), cache, last, ids, rows, rows, rows,
                                          rows, aot._abstract_sampling(programs.row_sharding, 1, bias=True)).compile()
    block = ",".join(map(str, cache.k[0][0].shape))
    assert not re.findall(rf"= \w+\[{block}\]\S* copy\(", hlo.as_text())


def test_aot_check_reaches_the_servers_verdict_with_its_flags():
    """--inference-only with device_serve.py's cache flags: the pages the server would take in the given memory, the
    same as its own sizing there, and its refusal (a record that does not fit) where that memory is too small."""
    cfg = dataclasses.replace(CFG, cores_per_replica=4)
    server = {"n_pages": "auto", "page_size": 16, "memory_fraction": 0.9}
    *_, record, fit = aot.run(cfg, None, "", 8, "64MiB", n_slots=4, inference_only=True, server=server)
    assert record["check"] == "server" and fit["fits"] and "refused" not in record
    assert record["total_bytes"] <= record["budget_bytes"] == int(0.9 * 64 * 2 ** 20)
    assert record["kv_pages"] > 0 and record["kv_pages"] % 2 == 0  # dp 2 x mp 4 on the 8 devices
    *_, refused, fit = aot.run(cfg, None, "", 8, "64KiB", n_slots=4, inference_only=True, server=server)
    assert not fit["fits"] and "server" in fit["refused"] and "does not fit" in refused["refused"]
    result = subprocess.run([sys.executable, "aot_check.py", "--config", "configs/tiny_rot_partial.json",
                             "--kv-pages", "auto"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and "--kv-pages is device_serve.py's: give it with --inference-only" in result.stderr


def test_aot_check_counts_the_servers_lora_adapter_slots():
    """--max-loras / --max-lora-rank (device_serve.py's): the server's params hold the adapter slots beside the
    weights, every projection's A and B at the rank, per device as the Megatron rules split them."""
    from mesh_transformer.model import lora_slots

    cfg = config.load("configs/tiny_rot_partial.json", ["cores_per_replica=4"])
    base = {r["check"]: r for r in aot.run(cfg, None, "", 8, None, n_slots=4, inference_only=True,
                                          server={"n_pages": None, "page_size": 16, "memory_fraction": 0.9})}
    result = subprocess.run([sys.executable, "aot_check.py", "--config", "configs/tiny_rot_partial.json", "--set",
                             "cores_per_replica=4", "--inference-only", "--slots", "4", "--max-loras", "4",
                             "--max-lora-rank", "8"], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    served = {r["check"]: r for r in map(json.loads, filter(lambda line: line.startswith("{"),
                                                           result.stdout.splitlines()))}
    slots = lora_slots.slot_shapes(dataclasses.replace(cfg, max_loras=4, max_lora_rank=8), jnp.float32)
    mp = 4  # A of a row-split weight and B of a column-split one are split over mp; the rest is whole on each device
    per_device = sum(s.size * 4 // (mp if ("heads" in axes or "mlp" in axes) else 1)
                     for s, axes in zip(jax.tree.leaves(slots), jax.tree.leaves(
                         lora_slots.slot_axes(cfg), is_leaf=lambda x: isinstance(x, tuple))))
    assert served["server"]["params_bytes"] - base["server"]["params_bytes"] == per_device * cfg.layers
