"""Compile-only accelerator targets: names to devices, the platform policy in the programs they get, the fit check's
records on real TPU and GPU compilers, and the step-time estimate against an analytic FLOP count."""
import dataclasses
import functools
import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from mesh_transformer import aot, config, estimate, platforms, targets
from mesh_transformer.config import ConfigError
from mesh_transformer.infer.decode import block_sizes, default_block
from mesh_transformer.infer.params import abstract_params
from mesh_transformer.infer.programs import Programs
from mesh_transformer.train import optim, state

CFG = config.load("configs/tiny_rot_partial.json", ["cores_per_replica=4", "warmup_steps=0"])


@pytest.fixture(scope="module")
def v3_8():
    return targets.target("v3-8").devices()


def test_cloud_names_map_to_libtpu_topologies():
    assert targets.target("v3-8").topology == "v3:2x2" and targets.target("v3-8").n_devices == 8
    assert targets.target("v4-8").topology == "v4:2x2x1" and targets.target("v4-8").n_devices == 4  # megacore
    assert targets.target("v5litepod-8").topology == "v5e:2x4" and targets.target("v5litepod-8").n_devices == 8
    one = targets.target("v5litepod-1")
    assert one.topology == "v5e:1x1" and dict(one.options)["chips_per_host_bounds"] == (1, 1, 1)
    assert targets.target("v6e-8").topology == "v6e:2x4" and targets.target("v3-32").n_devices == 32
    assert targets.target("V3-8").chip.memory_bytes == 16 * 2 ** 30
    with pytest.raises(ConfigError, match="unknown target 'v9-8'.*h100-8"):
        targets.target("v9-8")
    with pytest.raises(ConfigError, match="v3-7: a v3 slice counts 2 cores per chip"):
        targets.target("v3-7")


def test_a_device_kind_names_its_datasheet_and_the_cpu_none():
    assert targets.chip_of("TPU v5 lite").bandwidth == 819e9 and targets.chip_of("TPU v5").peak_flops == 459e12
    assert targets.chip_of("NVIDIA H200") == targets.target("h200-1").chip
    assert targets.chip_of(jax.devices("cpu")[0].device_kind) is None and targets.chip_of("NVIDIA B200") is None


def test_gpu_sets_name_their_spec_and_count():
    h100 = targets.target("h100-8")
    assert h100.platform == "gpu" and h100.n_devices == 8 and h100.chip.memory_bytes >= 80 * 10 ** 9
    assert targets.target("h200-1").chip.memory_bytes > h100.chip.memory_bytes
    assert targets.target("a100-80-8").chip.peak_flops < h100.chip.peak_flops


@pytest.mark.parametrize("name, kind", [("v3-8", "TPU v3"), ("v4-8", "TPU v4"), ("v5litepod-1", "TPU v5 lite"),
                                        ("h100-1", "H100")])
def test_targets_give_compile_only_devices_of_their_kind(name, kind):
    devices = targets.target(name).devices()
    assert len(devices) == targets.target(name).n_devices and kind in devices[0].device_kind
    assert targets.chip_of(devices[0].device_kind) == targets.target(name).chip  # the benchmarks' datasheet
    assert jax.make_mesh((len(devices),), ("x",), devices=devices).size == len(devices)  # whole chips on a v4
    policy = platforms.for_devices(devices)
    assert policy.platform == targets.target(name).platform and policy.compute_dtype == "bfloat16"


def _locations(lowered) -> set[str]:
    """The source names a lowered program's operations carry (function names, op names)."""
    return set(re.findall(r'^#loc\d+ = loc\("([^"]*)"', lowered.as_text(debug_info=True), re.M))


def _programs(cfg, devices):
    train = aot.training_programs(cfg, "shard_map", devices, None)
    layout = aot._inference_layout(train["layout"])
    programs = Programs(layout)
    cache, last, steps = aot._abstract_slots(programs, 8, block_sizes(cfg.seq, default_block(cfg.seq)))
    decode = programs.jitted["decode"].lower(abstract_params(layout), cache, last, steps, rows=4,
                                             n_blocks=1)
    return train, train["train"].lower(train["state"], train["tokens"], train["frozen"]), decode


def test_a_tpu_program_holds_none_of_the_cpu_workarounds(v3_8):
    cfg = dataclasses.replace(CFG, compute_dtype="auto")
    train, train_lowered, decode = _programs(cfg, v3_8)
    assert train["layout"].cfg.compute_dtype == "bfloat16"  # "auto" on a TPU
    assert train["layout"].policy == platforms.for_platform("tpu", v3_8[0].device_kind)
    names = _locations(train_lowered) | _locations(decode)
    assert "dot_product_attention" in names and not {"blocked_attention", "in_turn"} & names
    assert "ui16" not in decode.as_text()  # the cache holds bf16 values, not their bits
    # Every matrix product XLA:TPU made (a convolution on TPU) is fed bf16, but for the gradient of attention's
    # scores, which jax.nn.dot_product_attention's backward takes from the f32 softmax.
    hlo = train_lowered.compile().as_text()
    products = re.findall(r"= \w+\[[^\]]*\]\S* convolution\(%([\w.\-]+), %([\w.\-]+)\)[^\n]*op_name=\"([^\"]*)\"", hlo)
    dtypes = dict(re.findall(r"%([\w.\-]+) = (\w+)\[", hlo))
    wider = [name for a, b, name in products if {dtypes[a], dtypes[b]} != {"bf16"}]
    assert len(products) > 20 and all("BTNH,BSNH->BNTS" in name for name in wider), wider


def test_the_same_program_for_the_cpu_holds_them():
    cfg = dataclasses.replace(CFG, compute_dtype="bfloat16")
    _, train_lowered, decode = _programs(cfg, aot.start_devices(8))
    assert "blocked_attention" in _locations(train_lowered) and "in_turn" in _locations(decode)
    assert "ui16" in decode.as_text()


# A TPU and a GPU set, each split dp 2 x mp 4 (v5e chips: the splash and LoRA tests below)
@pytest.mark.parametrize("topology", ["v3-8", "h100-8"])
def test_fit_check_compiles_every_program_for_a_target(topology):
    cfg = dataclasses.replace(CFG, cores_per_replica=4)
    target = targets.target(topology)
    records = aot.run(cfg, None, "", 0, None, topology=topology)
    train, load, serve, prefill, extend, paged, sample, scorer, fit = records
    assert [r["check"] for r in records] == ["train_step", "load_params", "serve_decode_step", "serve_prefill",
                                             "serve_extend", "serve_paged_decode_step", "sample_decode_step", "scorer",
                                             "fit"]
    assert all(r["compiler"] == target.compiler and r["target"] == topology for r in records[:-1])
    assert fit["device_memory_bytes"] == target.chip.memory_bytes and fit["fits"]
    # Memory from the target's compiler, against the shard sizes: f32 params split over mp, Adam's two moments over
    # mp and the 2 data-parallel replicas (`shard_optimizer`).
    mp, dp = train["mesh"]["mp"], train["mesh"]["dp"]
    assert train["params_bytes"] == pytest.approx(4 * train["params"] / mp, rel=0.05)
    assert train["optimizer_split_over"] == "dp" and dp == 2
    assert train["opt_state_bytes"] == pytest.approx(2 * train["params_bytes"] / dp, rel=0.05)
    assert train["argument_bytes"] >= train["params_bytes"] + train["opt_state_bytes"]
    assert serve["argument_bytes"] >= serve["params_bytes"] + serve["kv_cache_bytes"]
    assert serve["params_bytes"] == pytest.approx(2 * train["params"] / serve["decode_mesh"]["mp"], rel=0.05)
    assert 0 < train["estimated_step_s"] and 0 < train["estimated_mfu"] < 1
    assert serve["estimated_tokens_per_s"] == pytest.approx(serve["slots"] / serve["estimated_step_s"])
    assert train["attention"] == ("cudnn" if topology.startswith("h100") else "xla")  # shard_map: never splash
    assert scorer["total_bytes"] > 0 and prefill["total_bytes"] > 0 and sample["total_bytes"] > 0
    assert extend["total_bytes"] >= extend["params_bytes"] + extend["kv_cache_bytes"]
    assert f"on {topology} ({target.compiler})" in aot.human_line(records) and "estimated" in aot.human_line(records)


def test_the_lora_step_and_a_gspmd_mode_compile_for_a_tpu(v3_8):
    lora = dataclasses.replace(CFG, lora_rank=4, base_dtype="bfloat16")
    train = aot.measure(lora, "shard_map", v3_8, None, target=targets.target("v3-8"), train_only=True)[0]
    assert train["check"] == "lora_train_step" and train["params_bytes"] == pytest.approx(
        2 * train["params"] / 4, rel=0.1)
    fsdp = aot.measure(CFG, "fsdp", v3_8, None, target=targets.target("v3-8"), train_only=True)[0]
    assert fsdp["mesh"] == {"data": 1, "fsdp": 8, "tensor": 1}
    assert fsdp["params_bytes"] == pytest.approx(4 * fsdp["params"] / 8, rel=0.05)


def test_the_lora_step_takes_its_frozen_base_in_the_layouts_xla_tpu_chooses():
    # XLA:TPU wants q, k and v transposed for its products; given the base in default layouts it copies the whole
    # stacked q, k and v before the layer loop (2.63 GiB of GPT-J-6B's LoRA step on one v5e chip).
    cfg = config.load("configs/tiny_rot_partial.json", [
        "cores_per_replica=1", "layers=2", "d_model=512", "n_heads=4", "pe_rotary_dims=64", "seq=256", "n_vocab=1024",
        "lora_rank=8", "base_dtype=bfloat16", "compute_dtype=bfloat16"])
    layout = aot.training_programs(cfg, "shard_map", targets.target("v5litepod-1").devices(), None)["layout"]
    optimizer, schedule = optim.make_optimizer(layout.cfg), optim.lr_schedule(layout.cfg)
    compiled, formats = state.compile_train_step(layout, optimizer, schedule)
    assert "copy(%frozen" not in compiled.as_text()
    assert formats["layers"]["attn"]["q"].layout.major_to_minor == (0, 2, 1)  # transposed, as XLA:TPU chose
    default = state.make_train_step(layout, optimizer, schedule).lower(*state.abstract_step_args(layout, optimizer))
    assert "copy(%frozen__layers____attn____q__" in default.compile().as_text()


def test_the_sampler_loop_keeps_the_tpu_cache_where_it_lies():
    # XLA:TPU's decode loop wants a cache block's positions second: in the CPU's order ([N, H, K, S]) it copied every
    # block in and out around the loop (6.77 GiB of GPT-J-6B's 8 slots on a v5e chip).
    cfg = config.load("configs/tiny_rot_partial.json", [
        "cores_per_replica=1", "layers=2", "d_model=512", "n_heads=4", "pe_rotary_dims=64", "seq=256", "n_vocab=1024",
        "compute_dtype=bfloat16"])
    train = aot.training_programs(cfg, "shard_map", targets.target("v5litepod-1").devices(), None)
    tpu = aot._inference_layout(train["layout"])
    assert tpu.policy.cache_order != platforms.for_platform("cpu").cache_order
    copies = []
    for layout in (tpu, dataclasses.replace(tpu, policy=dataclasses.replace(tpu.policy, cache_order=(0, 2, 3, 1)))):
        programs = Programs(layout)
        cache, last, steps = aot._abstract_slots(programs, 8, [cfg.seq])
        live = jax.ShapeDtypeStruct((8,), jnp.bool_, sharding=programs.row_sharding)
        ints = [jax.ShapeDtypeStruct((4,), jnp.int32), jax.ShapeDtypeStruct((), jnp.int32)]
        compiled = programs.jitted["generate"].lower(abstract_params(layout), cache, last, steps, live,
                                                     *ints, rows=8, n_blocks=1, out_len=cfg.seq).compile()
        copies.append(len(re.findall(r"copy\(%cache", compiled.as_text())))
    assert copies[0] == 0 and copies[1] > 0


def test_a_v5e_decode_step_over_int8_weights_runs_the_int8_kernel_and_a_v3_xlas_products():
    # The TPU policy's int8 products (model/quant_kernel.py, by Mosaic) and decode attention (infer/decode_kernel.py)
    # in the decode step of 8 rows for a v5e; a v3, whose Mosaic has no bf16 products, keeps XLA's.
    cfg = config.load("configs/tiny_rot_partial.json", [
        "cores_per_replica=1", "layers=2", "d_model=512", "n_heads=4", "pe_rotary_dims=64", "seq=256", "n_vocab=1024",
        "compute_dtype=bfloat16", "weight_dtype=int8"])
    kernels = {}
    for name in ("v5litepod-1", "v3-8"):
        devices = targets.target(name).devices()[:1]
        layout = aot._inference_layout(aot.training_programs(cfg, "shard_map", devices, None)["layout"])
        programs = Programs(layout)
        cache, last, steps = aot._abstract_slots(programs, 8, [cfg.seq])
        compiled = programs.jitted["decode"].lower(abstract_params(layout), cache, last, steps, rows=8,
                                                   n_blocks=1).compile()
        calls = re.findall(r"%([\w.\-]+) = .*custom_call_target=\"tpu_custom_call\"", compiled.as_text())
        attention = [c for c in calls if c.startswith("decode_attention")]
        kernels[name] = (layout.policy.int8_dot, len(calls) - len(attention), len(attention))
    assert kernels["v5litepod-1"] == ("kernel", 2 * cfg.layers, cfg.layers)  # each layer's two products, attention
    assert kernels["v3-8"] == ("compute", 0, 0)


def test_the_estimate_counts_every_trip_of_the_loops(v3_8):
    # XLA's cost analysis counts each loop body once; the estimate multiplies by the trip counts (layers, micro
    # steps), which must agree with the analytic count of the step's matrix FLOPs (remat's recompute included).
    cfg = config.load("configs/tiny_rot_partial.json", ["cores_per_replica=4", "layers=4", "d_model=256",
                                                        "seq=64", "gradient_accumulation_steps=3"])
    for remat, policy in ((True, "full"), (False, "full"), (True, "save_qkv"), (True, "save_mlp_hidden")):
        changed = dataclasses.replace(cfg, remat=remat, remat_policy=policy)
        step = aot.training_programs(changed, "shard_map", v3_8, None)
        lowered = step["train"].lower(step["state"], step["tokens"], step["frozen"])
        weighted, once = estimate.loop_flops(lowered.compile().as_text())
        tokens = 3 * step["layout"].global_batch * cfg.seq
        analytic = estimate.executed_flops_per_token(changed, remat) * tokens / 8
        assert weighted == pytest.approx(analytic, rel=0.02), (remat, policy, weighted / analytic)
        assert weighted > 3 * once  # at least the micro-steps' three trips and the layers' four


def test_the_estimate_reads_one_layer_of_stacked_weights_per_trip(v3_8):
    # A layer loop over stacked weights [L, D, D] reads one layer's slice per trip: its estimated time grows as L,
    # not as L squared (which counting the whole stack at every trip would give).
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh, NamedSharding

    mesh = Mesh(v3_8, ("x",))

    def seconds(n_layers: int) -> float:
        def layers(h_BxD, w_LxDxD):
            return jax.lax.scan(lambda h, w: (jnp.tanh(h @ w), None), h_BxD, w_LxDxD)[0]

        h = jax.ShapeDtypeStruct((8 * 128, 1024), jnp.bfloat16, sharding=NamedSharding(mesh, P("x")))
        w = jax.ShapeDtypeStruct((n_layers, 1024, 1024), jnp.bfloat16, sharding=NamedSharding(mesh, P()))
        compiled = jax.jit(layers).lower(h, w).compile()
        chip = targets.target("v3-8").chip
        return estimate.step_estimate(compiled, chip, 1, 1.0)["estimated_step_s"]

    assert seconds(16) / seconds(4) == pytest.approx(4, rel=0.15)


def test_the_programs_that_place_gpt_j_6b_s_lora_base_compile_for_one_v5e_chip():
    # A strided slice of the whole embedding (the base's fingerprint) was staged in the core's 128 MiB VMEM, and
    # XLA:TPU refused it: the run died while loading, after a fit check that compiled only the train step.
    cfg = config.load("configs/6B_lora_v5litepod-1.json")
    devices = targets.target("v5litepod-1").devices()
    programs = aot.training_programs(cfg, "shard_map", devices, None)
    record = aot._loading_record(programs, {})
    # each made, then written a layer at a time
    matrices = [x for x in jax.tree.leaves(programs["frozen"]) if x.ndim >= 2]
    assert record["programs"] == 2 * len(matrices) + 1 and "refused" not in record, record  # + the fingerprint
    assert record["temp_bytes"] < 2 ** 20
    # The refusal, as the fit check reports it, of such a slice of an embedding-sized f32 array (the base's own bf16
    # one is refused too, after 45 s of the compiler's tries).
    wte = programs["frozen"]["embed"]["wte"]
    whole = jax.ShapeDtypeStruct(wte.shape, jnp.float32, sharding=wte.sharding)
    strided = jax.jit(lambda w: w[::12600, ::1024])
    refused, _ = aot._compile(strided, whole, policy=platforms.for_devices(devices))
    assert isinstance(refused, aot.Refused) and "vmem" in refused.message.lower()


def test_a_program_the_tpu_compiler_refuses_for_memory_is_a_record_that_does_not_fit():
    # XLA:TPU refuses to compile what exceeds the chip's memory; the fit check reports it instead of failing.
    import jax
    import jax.numpy as jnp
    from jax.sharding import SingleDeviceSharding

    devices = targets.target("v5litepod-1").devices()
    x = jax.ShapeDtypeStruct((40000,), jnp.float32, sharding=SingleDeviceSharding(devices[0]))
    big = jax.jit(lambda x: jnp.sort(jnp.outer(x, x).ravel()) + jnp.outer(x + 1, x).ravel())  # ~19 GB of temps
    refused, _ = aot._compile(big, x, policy=platforms.for_devices(devices))
    memory = aot.memory_record(refused)
    assert isinstance(refused, aot.Refused) and "RESOURCE_EXHAUSTED" in memory["refused"]
    assert memory["temp_bytes"] > 16 * 2 ** 30 and memory["argument_bytes"] == 4 * 40000
    assert not aot.verdict([{"check": "scorer", **memory}], targets.target("v5litepod-1").chip.memory_bytes)["fits"]


def test_aot_check_cli_tells_an_unknown_topology_on_one_line():
    result = subprocess.run([sys.executable, "aot_check.py", "--config", "configs/tiny_rot_partial.json", "--set",
                             "cores_per_replica=4", "--topology", "v9-8"], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 2 and result.stderr.strip().startswith("error: unknown target 'v9-8'")


def test_a_machine_with_the_plugins_and_no_accelerator_is_a_cpu_machine():
    # libtpu and the CUDA plugin are installed here (the dev requirements) and no TPU or GPU is attached: importing
    # the package pins JAX to the CPU, quietly.
    assert platforms.installed("libtpu") and platforms.installed("jax_plugins.xla_cuda12")
    env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
    result = subprocess.run([sys.executable, "-c", "import mesh_transformer, jax; print(jax.devices()[0].platform)"],
                            capture_output=True, text=True, timeout=120, env=env)
    assert result.returncode == 0 and result.stdout.strip() == "cpu"
    assert result.stderr == ""


def test_the_estimate_counts_device_memory_traffic_once():
    # An asynchronous slice moves its slice once (its done moves nothing); arrays in a TPU core's VMEM (S(1)) are
    # not device-memory traffic, but what a slice reads into VMEM is.
    hlo = """HloModule m

ENTRY %main (p: bf16[16,64]) -> f32[4,64] {
  %p = bf16[16,64]{1,0} parameter(0)
  %slice-start.1 = ((bf16[16,64]{1,0}), bf16[4,64]{1,0:S(1)}, s32[]{:S(2)}) slice-start(%p), slice={[0:4], [0:64]}
  %slice-done.1 = bf16[4,64]{1,0:S(1)} slice-done(%slice-start.1)
  ROOT %convert.1 = f32[4,64]{1,0} convert(%slice-done.1)
}
"""
    module = estimate._Module(hlo)
    _, _, memory_s = module.times_s(1.0, 1.0)
    read = 4 * 64 * 2 + 4  # the slice (and the start's s32 counter)
    assert memory_s == read + 4 * 64 * 4  # the slice, then the convert's f32 result (its VMEM operand is free)
    prefetch = """HloModule m

ENTRY %main (p: bf16[16,64]) -> f32[16,64] {
  %p = bf16[16,64]{1,0} parameter(0)
  %copy-start.1 = (bf16[16,64]{1,0:S(1)}, bf16[16,64]{1,0}, u32[]{:S(2)}) copy-start(%p)
  %copy-done.1 = bf16[16,64]{1,0:S(1)} copy-done(%copy-start.1)
  ROOT %convert.1 = f32[16,64]{1,0} convert(%copy-done.1)
}
"""
    # A prefetch into VMEM reads its source once and writes no device memory.
    assert estimate._Module(prefetch).times_s(1.0, 1.0)[2] == (16 * 64 * 2 + 4) + 16 * 64 * 4
    assert estimate._bytes("bf16[4,64]{1,0:T(8,128)(2,1)S(1)}") == 0
    assert estimate._bytes("bf16[4,64]{1,0:T(8,128)(2,1)S(1)}", vmem=True) == estimate._bytes("bf16[4,64]{1,0}") == 512


def test_the_estimate_counts_an_in_place_scatter_as_its_updates_and_takes_the_rates_a_chip_attains():
    # A KV cache's scatter (fused or not) updates its operand in place: it moves its updates, not the cache.
    hlo = """HloModule m

%fused (param_0: bf16[64,256], param_1: s32[2,1], param_2: bf16[2,256]) -> bf16[64,256] {
  %param_0 = bf16[64,256]{1,0} parameter(0)
  %param_1 = s32[2,1]{1,0} parameter(1)
  %param_2 = bf16[2,256]{1,0} parameter(2)
  ROOT %scatter.1 = bf16[64,256]{1,0} scatter(%param_0, %param_1, %param_2), ATTRS
}

ENTRY %main (c: bf16[64,256], i: s32[2,1], u: bf16[2,256]) -> bf16[64,256] {
  %c = bf16[64,256]{1,0} parameter(0)
  %i = s32[2,1]{1,0} parameter(1)
  %u = bf16[2,256]{1,0} parameter(2)
  %scatter_fusion = bf16[64,256]{1,0} fusion(%c, %i, %u), kind=kCustom, calls=%fused
  ROOT %scatter.2 = bf16[64,256]{1,0} scatter(%scatter_fusion, %i, %u), ATTRS
}
"""
    hlo = hlo.replace("ATTRS", "update_window_dims={1}, inserted_window_dims={0}, scatter_dims_to_operand_dims={0}, "
                      "index_vector_dim=1, to_apply=%region")
    update = 2 * 256 * 2
    fused = 2 * 4 + update + update  # the indices and the updates read, the updates written
    assert estimate._Module(hlo).times_s(1.0, 1.0)[2] == fused + 2 * update
    # A v5e's estimate takes the measured fractions of its datasheet: a memory-bound program's time over 0.90.
    chip = targets.target("v5litepod-1").chip
    assert chip.attained == (0.86, 0.90) and targets.target("v3-8").chip.attained == (1.0, 1.0)


def test_the_estimate_counts_splash_attentions_products():
    """A Pallas call carries no FLOPs XLA can see: the estimate counts the splash kernels' products (q's shape by
    the keys' length, over the causal blocks computed) in the v5e's one-device GSPMD train step, where the TPU policy
    runs splash, so the step's FLOPs are the analytic count."""
    cfg = config.from_dict({"layers": 1, "d_model": 256, "n_heads": 2, "n_vocab": 256, "pe_rotary_dims": 16,
                            "seq": 256, "cores_per_replica": 1, "compute_dtype": "bfloat16", "remat": False})
    programs = aot.training_programs(cfg, "dp", targets.compile_devices(targets.target("v5litepod-1")),
                                     {"fsdp": 1, "tensor": 1, "data": None})
    assert programs["layout"].policy.attention == "splash"
    compiled = programs["train"].lower(programs["state"], programs["tokens"], programs["frozen"]).compile()
    assert "splash_mha_dkv" in compiled.as_text()
    rows = cfg.per_replica_batch * cfg.gradient_accumulation_steps
    dense = 6 * (12 * cfg.d_model ** 2 + cfg.d_model * cfg.n_vocab) * rows * cfg.seq
    # One block of 256 positions (the causal half computed whole), 2 heads of 128: forward 2 products, dq 3, dkv 4.
    product = 2.0 * rows * cfg.n_heads * cfg.seq * cfg.seq * 128
    assert estimate._Module(compiled.as_text()).weighted()[0] == pytest.approx(dense + 9 * product, rel=0.02)


def test_splash_over_a_gspmd_slice_compiles_for_a_v5e_with_each_device_its_rows_and_heads():
    """fsdp 4 x tensor 2 on a v5litepod-8: the TPU compiler takes the shard_map around splash, each device's kernel
    over its 2 of the 8 sequences (2 per fsdp replica) and 1 of the 2 heads."""
    cfg = config.from_dict({"layers": 1, "d_model": 256, "n_heads": 2, "n_vocab": 256, "pe_rotary_dims": 16,
                            "seq": 256, "cores_per_replica": 1, "compute_dtype": "bfloat16", "remat": False,
                            "per_replica_batch": 2})
    programs = aot.training_programs(cfg, "fsdp_tp", targets.compile_devices(targets.target("v5litepod-8")),
                                     {"fsdp": 4, "tensor": 2, "data": None})
    assert programs["layout"].policy.attention == "splash"
    hlo = programs["train"].lower(programs["state"], programs["tokens"], programs["frozen"]).compile().as_text()
    calls = re.findall(r"%splash_mha_fwd\S* = \(.*?\) custom-call\(([^)]*)\)", hlo)
    q_shapes = set(re.findall(r"bf16\[(\d+),(\d+),256,128\]", hlo))
    assert calls and ("2", "1") in q_shapes  # [rows, heads, positions, head dim] on one device


@functools.cache
def _v5e_sharding():
    from jax.sharding import SingleDeviceSharding

    return SingleDeviceSharding(targets.compile_devices(targets.target("v5litepod-1"))[0])


def _on_a_v5e(*shape, dtype) -> jax.ShapeDtypeStruct:
    """An abstract array on a compile-only v5e chip (one for the whole module: a program's arrays share it)."""
    return jax.ShapeDtypeStruct(shape, dtype, sharding=_v5e_sharding())


@pytest.mark.parametrize("rows", [8, 32])
def test_the_estimate_counts_the_decode_kernels_reads_of_the_rows_it_reads(rows):
    """The decode attention kernel's cache operands hold every slot, of which it reads the first R: the estimate's
    bytes for the call are the rows' share of the blocks (and the queries, the lengths and the outputs), compiled for
    a v5e."""
    from mesh_transformer.infer import decode_kernel

    shaped = functools.partial(_on_a_v5e, dtype=jnp.bfloat16)
    blocks = [shaped(32, 64, 16, 256)] * 3
    compiled = jax.jit(decode_kernel.cached_partial).lower(shaped(rows, 16, 256), blocks, blocks,
                                                          _on_a_v5e(rows, dtype=jnp.int32)).compile()
    module = estimate._Module(compiled.as_text())
    calls = [(m.group(1), estimate._operands(m.group(2))) for m in
             re.finditer(rf"%({decode_kernel.NAME}[\w.]*) = \(.*?\) custom-call\((.*)", compiled.as_text())]
    assert len(calls) == 1
    shapes = {name: shape for name, shape in re.findall(r"%([\w.\-]+) = (\S+) ", compiled.as_text())}
    (name, operands), = calls
    read = estimate._operand_bytes(name, shapes, operands)
    cache_rows = 2 * 3 * rows * 64 * 16 * 256 * 2
    assert cache_rows < read < cache_rows + 2 * rows * 16 * 256 * 4 + 4096  # the rows' keys and values, and q
    assert module.times_s(1.0, 1.0)[2] >= read


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_the_decode_kernel_compiles_for_a_v5e_under_the_highest_matmul_precision(dtype):
    """Mosaic refuses bf16 products at "highest" (the device tier's f32 comparisons set it): the kernel's bf16
    products keep the default, its f32 ones take the caller's."""
    from mesh_transformer.infer import decode_kernel

    shaped = functools.partial(_on_a_v5e, dtype=dtype)
    blocks = [shaped(16, 64, 16, 256)] * 2
    assert decode_kernel.form_for(16, dtype) == "mxu"
    with jax.default_matmul_precision("highest"):
        compiled = jax.jit(decode_kernel.attend).lower(shaped(8, 16, 256), blocks, blocks,
                                                       _on_a_v5e(8, dtype=jnp.int32), shaped(8, 16, 256),
                                                       shaped(8, 16, 256)).compile()
    assert decode_kernel.NAME in compiled.as_text()


def test_the_estimate_counts_the_collectives_a_ring_sends(v3_8):
    # A psum of N bytes over g devices sends 2 (g - 1) / g N from each, a reduce-scatter from N and an all-gather to
    # N (g - 1) / g N each, counted once per trip of the loop around them, at the chip's ICI bandwidth.
    mesh = jax.sharding.Mesh(np.array(v3_8).reshape(2, 4), ("dp", "mp"))
    n_bytes = 1024 * 1024 * 4  # the f32 [1024, 1024] each device holds

    def body(x, y, z):
        def trip(carry, _):
            x, y, z = carry
            return (jax.lax.psum(x, "mp"), jax.lax.psum_scatter(y, "dp", tiled=True).repeat(2, 0),
                    jax.lax.all_gather(z[:512], "dp", tiled=True) * 2), None
        return jax.lax.scan(trip, (x, y, z), None, length=3)[0]

    step = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(), out_specs=P(), check_vma=False))
    like = jax.ShapeDtypeStruct((1024, 1024), jnp.float32)
    compiled = step.lower(like, like, like).compile()
    sent = estimate._Module(compiled.as_text()).collective_bytes()
    assert sent == pytest.approx(3 * (2 * 3 / 4 + 1 / 2 + 1 / 2) * n_bytes)
    record = estimate.step_estimate(compiled, targets.TPU_CHIPS["v3"], 1, 1.0)
    assert record["estimated_collective_s"] == pytest.approx(sent / targets.TPU_CHIPS["v3"].ici_bandwidth)
    assert record["estimated_tokens_per_s_with_collectives"] < record["estimated_tokens_per_s"]


def test_the_servers_sizing_on_a_v5e_counts_the_code_of_every_program_its_engine_can_load():
    """A TPU keeps a program's code in its memory once the program has run (5-9 MB each for the device tier's model,
    measured on a v5e): the sizing counts every program the engine can load, each decode step as large as the
    largest it compiled, each prefill as its largest prefill, and the auto pages fill what is left."""
    from mesh_transformer.infer.params import make_inference_layout
    from mesh_transformer.parallel.mesh import make_dp_mp
    from mesh_transformer.serve import sizing

    cfg = dataclasses.replace(CFG, cores_per_replica=1)
    layout = make_inference_layout(cfg, mesh=make_dp_mp(1, 1, [_v5e_sharding()._device]))
    fit = sizing.for_server(Programs(layout), max_batch=4, n_pages="auto", page_size=16, prefix_cache=True,
                            memory_fraction=0.9, device_bytes=1 << 30)
    assert fit.programs >= 10 and fit.code_bytes >= fit.programs << 20
    assert fit.weights_bytes + fit.cache_bytes + fit.code_bytes < fit.need_bytes <= fit.budget_bytes
    assert f"the code of {fit.programs} programs" in fit.summary()


def test_the_servers_auto_pages_on_a_v5e_are_measured_where_they_are_taken():
    """An int8 paged cache's programs on a v5e hold temporaries that grow with the cache (XLA copies each layer's
    scales to the attention kernel's layout): auto pages are sized by the programs compiled over them, so giving
    their count as --kv-pages is the same verdict, within the budget."""
    from mesh_transformer.infer.params import make_inference_layout
    from mesh_transformer.parallel.mesh import make_dp_mp
    from mesh_transformer.serve import sizing

    cfg = dataclasses.replace(CFG, cores_per_replica=1, kv_cache_dtype="int8")
    layout = make_inference_layout(cfg, mesh=make_dp_mp(1, 1, [_v5e_sharding()._device]))
    assert layout.policy.paged_attention == "kernel"
    programs = Programs(layout)

    def fit(n_pages):
        return sizing.for_server(programs, max_batch=4, n_pages=n_pages, page_size=16, prefix_cache=True,
                                 memory_fraction=0.9, device_bytes=1 << 29)

    auto = fit("auto")
    given = fit(auto.n_pages)
    assert auto.n_pages > 64 and given.need_bytes == auto.need_bytes <= auto.budget_bytes
