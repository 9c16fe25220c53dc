"""Descriptions of NVIDIA GPUs for the CUDA plugin's compile-only devices, and each GPU's datasheet figures.

`target_config(kind)` is the text of an XLA `GpuTargetConfigProto` for one GPU kind, read from `<kind>.txtpb` next to
this module; given to `jax.experimental.topologies.get_topology_desc(topology_name="", platform="cuda",
target_config=..., topology="1x1xN")` it yields N devices of that GPU that can be compiled for on a machine with no
GPU. The files hold the `gpu_device_info` fields up to `registers_per_block_limit`, `platform_name`,
`dnn_version_info` (cuDNN 9.8, the oldest jax-cuda12-plugin 0.10.2 accepts) and `device_description_str`, which is
what the devices report as `device_kind`. jaxlib 0.10.2's parser refuses any field it does not know (XLA's newer
`collective_memory_granularity`, `mem_clock_ghz`, `max_blocks_per_multiprocessor`): keep the files to these.

Memory (`memory_bytes`, and `device_memory_size` in the files) is the total CUDA reports for the device
(cuDeviceTotalMem, PyTorch's "total capacity"), a little below the nominal figure: XLA's measured spec for h100,
a100-80, a100-40, a6000 and v100; elsewhere PyTorch's reported GiB (two decimals) rounded to whole MiB. `peak_flops`
is the datasheet's dense (no sparsity) bf16 tensor-core rate with fp32 accumulation, or fp16 on V100 and T4, which have
no bf16 units (XLA still compiles bf16 programs for them). `bandwidth` is the datasheet's memory bandwidth; the files'
`memory_bandwidth` is what CUDA derives (2 x memory clock x bus width), H200's being the datasheet's.

Compiling needs a ptxas for any program with a generated kernel (XLA takes pip's `nvidia-cuda-nvcc-cu12` where it is
installed, else one on the machine). CUDA 13's ptxas has dropped sm_70, so v100 programs fail with "ptxas too old"
unless a CUDA 12 ptxas is found (that package, or `XLA_FLAGS=--xla_gpu_cuda_data_dir=DIR` with `DIR/bin/ptxas`); with
one, bf16 compiles for v100 as it does for t4 (XLA widens it to f32 and calls cuBLAS).
"""
from __future__ import annotations

import dataclasses
import pathlib

@dataclasses.dataclass(frozen=True)
class GpuSpec:
    """One GPU kind: the name CUDA gives it, datasheet figures, and its target description file."""
    name: str
    memory_bytes: int
    peak_flops: float  # dense bf16 tensor-core FLOP/s (fp16 on V100 / T4)
    bandwidth: float  # memory bytes/s
    file: str


SPECS: dict[str, GpuSpec] = {
    "h100": GpuSpec("NVIDIA H100 80GB HBM3", 84942979072, 989.4e12, 3.35e12, "h100.txtpb"),  # SXM5
    "h200": GpuSpec("NVIDIA H200", 150119383040, 989.4e12, 4.8e12, "h200.txtpb"),  # SXM, 141 GB
    "a100-80": GpuSpec("NVIDIA A100-SXM4-80GB", 85100068864, 312e12, 2.039e12, "a100-80.txtpb"),
    "a100-40": GpuSpec("NVIDIA A100-SXM4-40GB", 42331013120, 312e12, 1.555e12, "a100-40.txtpb"),
    "l40s": GpuSpec("NVIDIA L40S", 47695527936, 362.05e12, 864e9, "l40s.txtpb"),
    "a6000": GpuSpec("NVIDIA RTX A6000", 51041271808, 154.8e12, 768e9, "a6000.txtpb"),
    "rtx4090": GpuSpec("NVIDIA GeForce RTX 4090", 25382879232, 165.2e12, 1008e9, "rtx4090.txtpb"),  # fp32 accum.
    "l4": GpuSpec("NVIDIA L4", 23654825984, 121e12, 300e9, "l4.txtpb"),
    "a10": GpuSpec("NVIDIA A10", 23686283264, 125e12, 600e9, "a10.txtpb"),
    "v100": GpuSpec("Tesla V100-SXM2-16GB", 16935682048, 125e12, 900e9, "v100.txtpb"),  # fp16
    "t4": GpuSpec("Tesla T4", 15827206144, 65e12, 320e9, "t4.txtpb"),  # fp16
}


def target_config(kind: str) -> str:
    """The `GpuTargetConfigProto` text of a GPU kind (a key of `SPECS`)."""
    if kind not in SPECS:
        raise KeyError(f"unknown GPU kind {kind!r}: one of {', '.join(sorted(SPECS))}")
    return (pathlib.Path(__file__).with_name(SPECS[kind].file)).read_text()
