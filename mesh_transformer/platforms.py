"""What differs by platform, chosen once from the devices a program is for: one small named value (`Policy`) that a
Layout carries and the programs read. Model, infer and train code never ask JAX which backend it runs.

The CPU policy holds the workarounds for XLA's CPU backend, each measured where it is written: blocked training
attention (`model/attention.py`), the dense layers' hand-written backward (`model/layers.py`), weight converts
ordered layer by layer, a KV cache stored as bits and with its positions last (`infer/decode.py`). TPU and GPU
programs hold none of them.

Before JAX starts, what a process does is chosen from the platform JAX will start on (`expected_platform`): importing
the package pins a machine without an accelerator to the CPU (`pin_platform`), and every script's `__main__` calls
`platform_setup` (on CPU the glibc restart that keeps freed host memory, on GPU XLA's GPU flags).
"""
from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import glob
import importlib.util
import os
import sys
import tempfile
from collections.abc import Iterator, Sequence
from typing import Any
from platform import libc_ver

CPU, TPU, GPU = "cpu", "tpu", "gpu"


@dataclasses.dataclass(frozen=True)
class Policy:
    """The platform choices of one set of devices; a layout's (`for_layout`) adds where splash runs across its mesh,
    the one choice that depends on the layout, kept here because every layer already reads the policy."""
    platform: str  # "cpu", "tpu" or "gpu"
    device_kind: str
    compute_dtype: str  # what the config's compute_dtype "auto" means here
    attention: str  # training and prefill's causal attention: "blocked", "xla", "cudnn" (XLA's where refused) or
    # "splash" (TPU Pallas, under a GSPMD layout: `for_layout`; on a v5e 1.31x XLA's full-training step and 1.10x
    # the LoRA step at seq 2048, and the only one that fits seq 8192, docs/performance.md)
    dense_backward: str  # "ordered" (the CPU's weight-gradient product order) or "autodiff"
    ordered_converts: bool  # bf16 weights converted to f32 one layer at a time (XLA's CPU dot has no bf16 kernel)
    cache_bits: bool  # the KV cache stored as unsigned bits (XLA's CPU scatter has no bf16 kernel)
    cache_order: tuple  # a KV cache block's axes, as positions of [slots, positions, heads, head dim]
    loop_hoisting: bool = True  # XLA's loop-invariant code motion (the CPU fit check can turn it off)
    int8_dot: str = "compute"  # int8 weights enter their products as "compute" (the activations' dtype), "float32",
    # or "kernel": a decode step's few rows through model/quant_kernel.py (TPU Pallas; on a v5e GPT-J-6B's int8 decode
    # step 1.14x XLA's at batch 1 and 32, docs/performance.md), XLA's "compute" elsewhere
    dot_piece_bytes: int = 0  # inference products over bf16/int8 weights in pieces of this many f32 bytes (0: whole)
    dot_piece_tokens: int = 0  # ... where they are over at most this many tokens (`model.order.in_pieces`)
    host_loading: bool = False  # a checkpoint's layers joined, converted and quantized on the host, else on the devices
    attention_shards: Any = None  # splash on several devices: (mesh, PartitionSpec of q, k, v [B, T, H, K])
    decode_attention: str = "xla"  # a decode step's attention over the slot cache: "xla" (`model.attention.attend`)
    # or "kernel" (TPU Pallas: infer/decode_kernel.py, which reads the cache's rows in place; from 2 rows, and on a
    # v5e GPT-J-6B's int8 decode step 1.13x XLA's at batch 32, docs/performance.md)
    paged_attention: str = "gather"  # decode over a paged cache: "gather" its pages (pure JAX) or "kernel" (TPU Pallas:
    # infer/paged_kernel.py; on a v5e 3.3x the gather's tokens/s at 64 concurrent requests, docs/performance.md)

    def compiler_options(self) -> dict:
        """XLA options of this policy's programs."""
        return {} if self.loop_hoisting else {"xla_disable_hlo_passes": "while-loop-invariant-code-motion"}


_POLICIES = {
    CPU: Policy(CPU, "cpu", "float32", attention="blocked", dense_backward="ordered", ordered_converts=True,
                cache_bits=True, cache_order=(0, 2, 3, 1), int8_dot="float32",
                dot_piece_bytes=64 << 20, dot_piece_tokens=256, host_loading=True),
    TPU: Policy(TPU, "", "bfloat16", attention="splash", dense_backward="autodiff", ordered_converts=False,
                cache_bits=False, cache_order=(0, 1, 2, 3), decode_attention="kernel", paged_attention="kernel",
                int8_dot="kernel"),
    GPU: Policy(GPU, "", "bfloat16", attention="cudnn", dense_backward="autodiff", ordered_converts=False,
                cache_bits=False, cache_order=(0, 2, 1, 3)),
}
# TPUs whose Mosaic compiler has no bf16 matrix products (the Pallas kernels'): their paged cache is gathered, their
# attention (decode's too) and their int8 products are XLA's.
NO_PALLAS_BF16 = ("TPU v2", "TPU v3")
_PLATFORM_NAMES = {"cpu": CPU, "tpu": TPU, "gpu": GPU, "cuda": GPU, "rocm": GPU}


def for_platform(platform: str, device_kind: str = "") -> Policy:
    """The policy of a platform name as JAX devices give it ("cpu", "tpu", "gpu", "cuda", "rocm")."""
    name = _PLATFORM_NAMES.get(platform.lower())
    if name is None:
        raise ValueError(f"no platform policy for {platform!r}")
    policy = dataclasses.replace(_POLICIES[name], device_kind=device_kind or name)
    if name == TPU and device_kind.startswith(NO_PALLAS_BF16):
        policy = dataclasses.replace(policy, paged_attention="gather", attention="xla", int8_dot="compute",
                                     decode_attention="xla")
    return policy


def for_layout(policy: Policy, gspmd: bool, mesh: Any = None, heads_spec: Any = None) -> Policy:
    """The policy of a layout's programs. Splash attention runs under a GSPMD layout: on several devices each runs it
    on its rows and heads (`heads_spec`, how q, k and v [B, T, H, K] are split over `mesh`), so neither positions
    nor the head dim may be split. Under shard_map (its output carries no mesh typing for check_vma) XLA's runs."""
    if policy.attention != "splash":
        return policy
    if not gspmd or (mesh is not None and mesh.size > 1 and (heads_spec is None or any(heads_spec[1::2]))):
        return dataclasses.replace(policy, attention="xla", attention_shards=None)
    if mesh is None or mesh.size == 1:
        return dataclasses.replace(policy, attention_shards=None)
    return dataclasses.replace(policy, attention_shards=(mesh, heads_spec))


def for_devices(devices: Sequence) -> Policy:
    """The policy of the devices a program is for (all of one platform)."""
    platforms = {d.platform for d in devices}
    if len(platforms) != 1:
        raise ValueError(f"the devices of one program must be of one platform, got {sorted(platforms)}")
    return for_platform(platforms.pop(), devices[0].device_kind)


def default() -> Policy:
    """The policy of the devices JAX has, for code called outside a Layout (tests, tools on one device)."""
    import jax

    return for_devices(jax.devices())


# ---------------------------------------------------------------------------------------- before JAX starts
# A TPU VM's chips: /dev/accel* (v2 to v5e), /dev/vfio/<n> (v5p, v6e).
TPU_DEVICE_FILES = ("/dev/accel*", "/dev/vfio/[0-9]*")
CUDA_PLUGINS = ("jax_plugins.xla_cuda12", "jax_plugins.xla_cuda13")


def installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # its parent package is not installed
        return False


def expected_platform() -> str:
    """The backend JAX will start on ("cpu", "gpu", "tpu"), told without starting it, for what must happen before it
    starts: JAX_PLATFORMS when set; else "tpu" where libtpu is installed and a TPU is attached (its device files),
    "gpu" where a CUDA plugin is installed and an NVIDIA device is present; else "cpu". libtpu or the CUDA plugin
    without such a device (installed for compile-only targets: `targets`) make a CPU machine."""
    requested = os.environ.get("JAX_PLATFORMS", "").split(",")[0].strip().lower()
    if requested:
        return {"cuda": "gpu", "rocm": "gpu"}.get(requested, requested)
    if installed("libtpu") and any(glob.glob(pattern) for pattern in TPU_DEVICE_FILES):
        return TPU
    if os.path.exists("/dev/nvidiactl") and any(installed(m) for m in CUDA_PLUGINS):
        return GPU
    return CPU


# JAX_PLATFORMS for the platform JAX will start on: that backend and the CPU's (the host's own arrays), no other.
JAX_PLATFORMS = {CPU: "cpu", TPU: "tpu,cpu", GPU: "cuda,cpu"}


def pin_platform() -> None:
    """Start JAX on the platform this machine has and the CPU, whatever plugins are installed (called when the
    package is imported). JAX would try libtpu or the CUDA plugin where no such device is attached (the dev install
    has both, for compile-only targets), print their start-up failures and fall back: so JAX_PLATFORMS is set
    (`JAX_PLATFORMS`) unless the user set it, and where a CUDA plugin is installed without a GPU, JAX's plugin
    discovery (whose import of the plugin prints "could not find cuda drivers" lines) runs with stderr held."""
    if "JAX_PLATFORMS" not in os.environ:
        os.environ["JAX_PLATFORMS"] = JAX_PLATFORMS[expected_platform()]
    if "jax" in sys.modules or os.path.exists("/dev/nvidiactl") or not any(installed(m) for m in CUDA_PLUGINS):
        return
    with quiet_stderr():
        import jax  # noqa: F401
        from jax._src import xla_bridge

        getattr(xla_bridge, "_discover_and_register_pjrt_plugins", lambda: None)()


@contextlib.contextmanager
def quiet_stderr() -> Iterator[None]:
    """Hold back what C++ libraries print on file descriptor 2 while inside (libtpu's and the CUDA plugin's start-up
    lines on a machine without such a device); shown after all if the block raises."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as held:
        os.dup2(held.fileno(), 2)
        try:
            yield
        except BaseException:
            os.dup2(saved, 2)
            held.seek(0)
            sys.stderr.write(held.read().decode(errors="replace"))
            raise
        finally:
            os.dup2(saved, 2)
            os.close(saved)


# XLA's flags for GPUs, set here and nowhere else (`platform_setup`): the latency-hiding scheduler moves collectives
# and their waits so they overlap compute (NVIDIA's JAX images set it), and collectives get the highest-priority
# stream, so a compute kernel does not hold one back. A flag the user set in XLA_FLAGS is left as the user set it.
GPU_XLA_FLAGS = ("--xla_gpu_enable_latency_hiding_scheduler=true",
                 "--xla_gpu_enable_highest_priority_async_stream=true")


def platform_setup() -> None:
    """What every script does first thing in its `__main__`, before JAX starts: on CPU the glibc restart
    (`keep_host_memory`), on GPU XLA's GPU flags (GPU_XLA_FLAGS) added to XLA_FLAGS. (Importing the package has
    pinned JAX to the CPU where no accelerator is attached: `pin_platform`.)"""
    if expected_platform() == GPU:
        flags = os.environ.get("XLA_FLAGS", "")
        missing = [f for f in GPU_XLA_FLAGS if f.partition("=")[0] not in flags]
        os.environ["XLA_FLAGS"] = " ".join([flags, *missing]).strip()
    keep_host_memory()


# glibc malloc told to keep freed memory: no mmap'd blocks, no trimming, one arena for every thread.
KEEP_HOST_MEMORY = "glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold=1099511627776:glibc.malloc.arena_max=1"


def keep_host_memory() -> None:
    """Restart this script once with glibc malloc set to keep the memory it frees (call it from `__main__` only).

    XLA's CPU backend allocates its large buffers (logits, gradients, optimizer updates) afresh every step, and
    glibc returns such blocks to the kernel when they are freed (mmap'd chunks, per-thread arenas), so each step
    page-faults them all in again: an elementwise pass over the bench config's [1024, 50400] logits takes 0.105 s
    that way and 0.017 s with the memory kept. GLIBC_TUNABLES is only read at process start, hence the re-exec.
    Nothing happens when GLIBC_TUNABLES is already set (set it to anything, even empty, to opt out), the C library
    is not glibc, or JAX will run on an accelerator (its buffers are on the device, and the restart would cost a
    second start of the interpreter). The cost: the process keeps its peak host memory until it exits.
    """
    if "GLIBC_TUNABLES" in os.environ or libc_ver()[0] != "glibc" or expected_platform() != CPU:
        return
    os.environ["GLIBC_TUNABLES"] = KEEP_HOST_MEMORY
    os.execv(sys.executable, sys.orig_argv)


M_MMAP_THRESHOLD, M_MMAP_MAX = -3, -4  # mallopt's parameters, from glibc's malloc.h


@contextlib.contextmanager
def host_memory_returned(threshold: int = 1 << 20) -> Iterator[None]:
    """While inside, undo `keep_host_memory`: blocks of `threshold` bytes or more are mmap'd, so freeing one gives
    it back to the kernel. Loading a model reads, joins and places one layer at a time; with the memory kept, every
    layer's host buffers stay resident after they are freed (GPT-J-6B in bf16: 17.8 GB resident for a 12.1 GB
    model, 13.8 GB without the restart). The buffers allocated meanwhile (the params) outlive it; that is fine.
    Nothing happens unless this process runs with KEEP_HOST_MEMORY."""
    if os.environ.get("GLIBC_TUNABLES") != KEEP_HOST_MEMORY:
        yield
        return
    libc = ctypes.CDLL(None)
    libc.malloc_trim(0)  # what was freed before (a compile's working memory) goes back first
    libc.mallopt(M_MMAP_THRESHOLD, threshold)
    libc.mallopt(M_MMAP_MAX, 1 << 20)
    try:
        yield
    finally:
        libc.mallopt(M_MMAP_MAX, 0)
        libc.malloc_trim(0)
