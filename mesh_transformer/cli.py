"""What every command-line script shares: config flags, multi-host start-up, one-line errors for user mistakes."""
from __future__ import annotations

import argparse
import contextlib
import ctypes
import os
import platform
import sys
from collections.abc import Callable, Iterator

from mesh_transformer import config, platforms


class Parser(argparse.ArgumentParser):
    """An argument parser whose errors are one-line ConfigErrors (exit status 2 through run_main, no usage dump)."""

    def error(self, message: str) -> None:
        raise config.ConfigError(message)


def add_config_args(parser: argparse.ArgumentParser, required: bool = True) -> None:
    parser.add_argument("--config", required=required,
                        help="flat JSON config file" + ("" if required else " (default: the checkpoint's own)"))
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override a config key (value parsed as JSON, else a string); repeatable")




def add_inference_args(parser: argparse.ArgumentParser) -> None:
    """The model flags of the sampling and serving tools: where the weights are, the config, mesh and dtype."""
    add_config_args(parser, required=False)
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--ckpt", help="our checkpoint (root or step dir), an original mesh-transformer-jax one or an "
                                       "HF GPT-J directory; default: the config's model_dir")
    source.add_argument("--hf", help="an HF GPT-J directory (config.json and safetensors weights); as --ckpt")
    parser.add_argument("--lora", help="LoRA adapters merged into the weights at load: a LoRA run of ours or an HF "
                                       "PEFT adapter directory (a LoRA run given as --ckpt needs none)")
    parser.add_argument("--mp", type=int, help="model-parallel width (default: the checkpoint's cores_per_replica "
                                               "where it divides the devices, else the widest that fits)")
    parser.add_argument("--dtype", choices=tuple(config.DTYPE_FLAGS), help="compute dtype the weights are held in "
                                                                          "(default: the config's compute_dtype)")


CONVERT_DTYPES = tuple(config.DTYPE_FLAGS)  # --dtype of the checkpoint converters


def add_convert_args(parser: argparse.ArgumentParser) -> None:
    """The input, config and output flags of resharding_example.py and slim_model.py."""
    parser.add_argument("--input-ckpt", required=True,
                        help="our checkpoint (root or step dir), an original step_N dir, or an HF directory")
    add_config_args(parser)
    parser.add_argument("--output-ckpt", required=True, help="checkpoint root to write step_N under (local or gs://)")


def add_distributed_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("multi-host (omit to auto-detect, e.g. on TPU VMs and SLURM)")
    group.add_argument("--coordinator", help="host:port of process 0")
    group.add_argument("--num-processes", type=int, help="number of processes in the run")
    group.add_argument("--process-id", type=int, help="this process's index, 0 .. num-processes - 1")


def start_distributed(args: argparse.Namespace) -> None:
    """Join the multi-process run the flags (or the environment) describe, before any device is touched."""
    from mesh_transformer.parallel import mesh

    try:
        mesh.init_distributed(args.coordinator, args.num_processes, args.process_id)
    except ValueError as e:
        raise config.ConfigError(str(e)) from None


def load_config(args: argparse.Namespace) -> config.Config:
    return config.load(args.config, args.overrides)


def inference_config(args: argparse.Namespace) -> tuple[config.Config, str]:
    """(config, checkpoint path) of the sampling and serving tools: --config when given, else the config the
    checkpoint carries (ours: its metadata; HF: config.json; original layout: a config.json beside or above its
    step directory); --set and --dtype applied on top."""
    from mesh_transformer import storage
    from mesh_transformer.store import convert

    source = args.hf or args.ckpt
    overrides = config.parse_overrides(args.overrides)
    if args.dtype:
        overrides["compute_dtype"] = config.DTYPE_FLAGS[args.dtype]

    def file_config(path: str) -> config.Config:
        return config.from_dict({**config.load(path).to_dict(), **overrides})

    if args.config:
        cfg = file_config(args.config)
        return cfg, source or cfg.model_path
    if source is None:
        raise config.ConfigError("give --ckpt (or --hf) with the weights, or --config naming their model_dir")
    cfg = convert.source_config(source, **overrides)
    if cfg is not None:
        return cfg, source
    path = source.rstrip("/")
    for candidate in (storage.join(path, "config.json"), storage.join(path.rpartition("/")[0] or ".", "config.json")):
        if storage.exists(candidate):
            return file_config(candidate), source
    raise config.ConfigError(f"{source} carries no config (no config.json beside or above it): give --config")


def load_for_inference(args: argparse.Namespace) -> tuple:
    """(layout, tokenizer, params) for the sampling and serving tools, the params read straight into the decode
    programs' form on a mesh fitted to the devices."""
    from mesh_transformer.infer import params as infer_params
    from mesh_transformer.tokenizer import load_tokenizer

    cfg, source = inference_config(args)
    layout = infer_params.make_inference_layout(cfg, mp=args.mp)
    try:
        tokenizer = load_tokenizer(cfg.tokenizer)
    except ValueError as e:
        raise config.ConfigError(str(e)) from None
    with host_memory_returned():
        return layout, tokenizer, infer_params.read_params(layout, source, lora=args.lora)


def stdin_lines() -> Iterator[str]:
    """Lines typed (or piped) on stdin, prompted with '> ' on a terminal; blank lines are skipped."""
    while True:
        if sys.stdin.isatty():
            print("> ", end="", file=sys.stderr, flush=True)
        line = sys.stdin.readline()
        if not line:
            return
        if line.strip():
            yield line.rstrip("\n")


def user_errors() -> tuple[type[BaseException], ...]:
    """Exceptions that mean bad input, not a bug: reported on one line without a traceback."""
    from mesh_transformer.store import checkpoint, tfrecord
    from mesh_transformer.train import trainer

    return (config.ConfigError, tfrecord.DataError, checkpoint.CorruptCheckpointError, trainer.TrainingError,
            FileNotFoundError, FileExistsError, PermissionError)


OUT_OF_MEMORY_HINT = ("the model does not fit: try --dtype bf16, a larger --mp (more devices per model copy), fewer "
                      "slots (--max-batch) or a shorter context (--set seq=N)")


def out_of_memory_message(e: BaseException) -> str | None:
    """A one-line account of a device out-of-memory error (how much was asked, what to change), else None."""
    import jax

    text = str(e)
    if not isinstance(e, jax.errors.JaxRuntimeError) or "RESOURCE_EXHAUSTED" not in text:
        return None
    first = next((line.strip() for line in text.splitlines() if "RESOURCE_EXHAUSTED" in line), text.splitlines()[0])
    return f"out of device memory ({first.partition('RESOURCE_EXHAUSTED:')[2].strip() or first}); {OUT_OF_MEMORY_HINT}"


def run_main(fn: Callable[[], int]) -> int:
    """Run a CLI body; user errors and device out-of-memory print one line on stderr and give exit status 2."""
    try:
        return fn()
    except user_errors() as e:
        print(f"error: {str(e).splitlines()[0] if str(e) else type(e).__name__}", file=sys.stderr, flush=True)
        return 2
    except Exception as e:
        message = out_of_memory_message(e)
        if message is None:
            raise
        print(f"error: {message}", file=sys.stderr, flush=True)
        return 2


expected_platform = platforms.expected_platform


# XLA's flags for GPUs, set here and nowhere else (`platform_setup`): the latency-hiding scheduler moves collectives
# and their waits so they overlap compute (NVIDIA's JAX images set it), and collectives get the highest-priority
# stream, so a compute kernel does not hold one back. A flag the user set in XLA_FLAGS is left as the user set it.
GPU_XLA_FLAGS = ("--xla_gpu_enable_latency_hiding_scheduler=true",
                 "--xla_gpu_enable_highest_priority_async_stream=true")


def platform_setup() -> None:
    """What every script does first thing in its `__main__`, before JAX starts: on CPU the glibc restart
    (`keep_host_memory`), on GPU XLA's GPU flags (GPU_XLA_FLAGS) added to XLA_FLAGS. (Importing the package has
    pinned JAX to the CPU where no accelerator is attached: `platforms.pin_platform`.)"""
    if expected_platform() == "gpu":
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
    if "GLIBC_TUNABLES" in os.environ or platform.libc_ver()[0] != "glibc" or expected_platform() != "cpu":
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
    libc.mallopt(M_MMAP_THRESHOLD, threshold)
    libc.mallopt(M_MMAP_MAX, 1 << 20)
    try:
        yield
    finally:
        libc.mallopt(M_MMAP_MAX, 0)
        libc.malloc_trim(0)
