"""The flags the command-line scripts share (config, model, sampling, conversion, multi-host) and what reads them:
the config they name (`load_config`), the multi-process run they describe (`start_distributed`) and prompts typed
on stdin (`stdin_lines`)."""
from __future__ import annotations

import argparse
import sys
from collections.abc import Iterator, Sequence

from mesh_transformer import config


class Parser(argparse.ArgumentParser):
    """An argument parser whose errors are one-line ConfigErrors (exit status 2 through run_main, no usage dump)."""

    def error(self, message: str) -> None:
        raise config.ConfigError(message)


def add_config_args(parser: argparse.ArgumentParser, required: bool = True) -> None:
    parser.add_argument("--config", required=required,
                        help="flat JSON config file" + ("" if required else " (default: the checkpoint's own)"))
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override a config key (value parsed as JSON, else a string); repeatable")


MEMORY_FRACTION = 0.9  # device_serve.py --memory-fraction's default (vLLM's --gpu-memory-utilization's)
AUTO, OFF = "auto", "off"


def _kv_pages(value: str) -> int | str:
    if value in (AUTO, OFF):
        return value
    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"a number of pages, '{AUTO}' or '{OFF}', got {value!r}") from None


def add_paged_cache_args(parser: argparse.ArgumentParser, server: bool = False) -> None:
    """The serving engine's paged KV cache flags (device_serve.py and the serving benches); `paged_cache` reads them.
    The server's (`server`) take --kv-pages auto and --memory-fraction too (serve/sizing.py)."""
    if server:
        parser.add_argument("--kv-pages", type=_kv_pages, default=None, metavar="N|auto|off",
                            help="a paged KV cache of N pages shared by the --max-batch slots: a request waits for "
                                 "its prompt's pages and takes more as it generates (--kv-reserve: all of them at "
                                 "once); auto: the pages that fit "
                                 "--memory-fraction of the device's memory after the weights and the largest "
                                 "program; off: a whole context per slot (default: auto on a TPU with the paged "
                                 "attention kernel or with --kv-cache-dtype, else off)")
        parser.add_argument("--kv-reserve", action="store_true",
                            help="with --kv-pages, a request holds the pages of its prompt and max_tokens from when it "
                                 "starts, so none is ever preempted (default: pages taken as tokens are made; where "
                                 "they run out, the latest started request is preempted and later resumes, its "
                                 "prompt and tokens so far computed again, as vLLM does)")
        parser.add_argument("--memory-fraction", type=float, default=MEMORY_FRACTION,
                            help="the share of each device's memory the server may use: weights, KV cache and the "
                                 f"largest program's temporaries (default {MEMORY_FRACTION}); checked before the "
                                 "weights are read")
    else:
        parser.add_argument("--kv-pages", type=int, default=None,
                            help="a paged KV cache of this many pages, shared by the --max-batch slots (default: a "
                                 "whole context per slot)")
    parser.add_argument("--page-size", type=int, default=16, help="tokens per page of --kv-pages (default 16)")
    parser.add_argument("--kv-cache-dtype", choices=("compute", "int8"), default=None,
                        help="the paged cache's keys and values: the compute dtype, or int8 with a scale per token and "
                             "head (half the bytes); a paged cache")


def paged_cache(parser: argparse.ArgumentParser, args: argparse.Namespace) -> dict:
    """The Engine's paged-cache arguments of `add_paged_cache_args`' flags ({}: the slot cache); the server's are
    n_pages (a number, "auto", "off", or None where its platform decides), page_size and memory_fraction. A bad
    combination is the parser's one-line error.
    --kv-cache-dtype becomes a config override (`args.overrides`, where there is one)."""
    pages = args.kv_pages
    if isinstance(pages, int) and pages < 1 or args.page_size < 1:
        parser.error(f"--kv-pages and --page-size must be at least 1, got {pages} and {args.page_size}")
    fraction = getattr(args, "memory_fraction", MEMORY_FRACTION)
    if not 0 < fraction <= 1:
        parser.error(f"--memory-fraction must be in (0, 1], got {fraction}")
    if args.kv_cache_dtype and pages == OFF:
        parser.error("--kv-cache-dtype is the paged cache's: not with --kv-pages off (the slot cache holds the "
                     "compute dtype)")
    if args.kv_cache_dtype and not hasattr(args, "memory_fraction") and pages is None:
        parser.error("--kv-cache-dtype needs --kv-pages (the slot cache holds the compute dtype)")
    if args.kv_cache_dtype and hasattr(args, "overrides"):
        args.overrides.append(f"kv_cache_dtype={args.kv_cache_dtype}")
    if getattr(args, "kv_reserve", False) and pages == OFF:
        parser.error("--kv-reserve is the paged cache's: not with --kv-pages off")
    if hasattr(args, "memory_fraction"):  # the server's: its platform decides where no flag does (device_serve.py)
        pages = AUTO if pages is None and args.kv_cache_dtype else pages
        return {"n_pages": pages, "page_size": args.page_size, "memory_fraction": fraction}
    return {"n_pages": pages, "page_size": args.page_size} if pages else {}


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
    parser.add_argument("--dtype", choices=tuple(config.INFERENCE_DTYPES),
                        help="compute dtype the weights are held in, or int8: the layers' weights in int8 with a "
                             "scale per output, computed in bf16 (default: the config's compute_dtype)")
    parser.add_argument("--quantize-head", action="store_true",
                        help="with --dtype int8, the LM head in int8 too (a scale per vocab entry)")


CONVERT_DTYPES = (*config.DTYPE_FLAGS, "int8")  # --dtype of the checkpoint converters (int8: slim only)


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


def load_config(args: argparse.Namespace) -> config.Config:
    return config.load(args.config, args.overrides)


def start_distributed(args: argparse.Namespace) -> None:
    """Join the multi-process run the flags (or the environment) describe, before any device is touched."""
    from mesh_transformer.parallel import mesh  # it imports JAX: the scripts parse their flags without it

    try:
        mesh.init_distributed(args.coordinator, args.num_processes, args.process_id)
    except ValueError as e:
        raise config.ConfigError(str(e)) from None


def add_sampling_args(parser: argparse.ArgumentParser) -> None:
    """How the sampling tool draws: length, temperature, top-p, top-k, seed, stop texts, samples per prompt."""
    parser.add_argument("--max-new-tokens", type=int, default=64, help="tokens to generate at most (default 64)")
    parser.add_argument("--temperature", type=float, default=0.75, help="0 = greedy (default 0.75)")
    parser.add_argument("--top-p", type=float, default=0.9, help="nucleus mass in (0, 1]; 1 = off (default 0.9)")
    parser.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens; 0 = off (default)")
    parser.add_argument("--seed", type=int, default=0, help="sample i uses seed + i (default 0)")
    parser.add_argument("--stop", nargs="+", default=[], metavar="TEXT", help="end a completion before this text")
    parser.add_argument("--num-samples", type=int, default=1, help="completions per prompt (default 1)")


def check_sampling_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """`add_sampling_args`' values checked: a bad one is the parser's one-line error."""
    for flag in ("max_new_tokens", "num_samples"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag.replace('_', '-')} must be at least 1, got {getattr(args, flag)}")
    if "" in args.stop:
        parser.error("--stop texts must not be empty")
    try:
        config.check_sampling([args.temperature], [args.top_k], [args.top_p])
    except ValueError as e:
        parser.error(str(e))


EVAL_SEEDS = "0,1234,1234,1234"  # lm_eval's: python random, numpy, torch, few-shot sampling


def parse_seeds(value: str) -> list[int | None]:
    """lm_eval's --seed: one integer for all four seeds, or four comma-separated integers or None."""
    items = [None if v.strip().lower() == "none" else int(v) for v in value.split(",")]
    if len(items) == 1:
        items *= 4
    if len(items) != 4:
        raise ValueError(value)
    return items


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


def parse_modules(items: Sequence[str]) -> list[tuple[str, str]]:
    """`--lora-modules NAME=PATH ...` as (name, path) pairs; a ConfigError names a malformed or repeated one."""
    pairs = []
    for item in items:
        name, sep, path = item.partition("=")
        if not sep or not name or not path:
            raise config.ConfigError(f"--lora-modules takes NAME=PATH items, got {item!r}")
        if name in dict(pairs):
            raise config.ConfigError(f"--lora-modules names {name!r} twice")
        pairs.append((name, path))
    return pairs


def add_lora_args(parser: argparse.ArgumentParser) -> None:
    """device_serve.py's LoRA adapters served side by side over the base (serve/adapters.py)."""
    lora = parser.add_argument_group("LoRA adapters served side by side over the base (the request's model picks one)")
    lora.add_argument("--enable-lora", action="store_true", help="hold adapter slots (implied by --lora-modules)")
    lora.add_argument("--lora-modules", nargs="+", default=[], metavar="NAME=PATH",
                      help="adapters to serve from the start: a LoRA run of ours or an HF PEFT directory each")
    lora.add_argument("--max-loras", type=int, default=None,
                      help="adapter slots held on the devices (default: the --lora-modules given, at least 4)")
    lora.add_argument("--max-lora-rank", type=int, default=16, help="the largest adapter rank served (default 16)")


def lora_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """`add_lora_args`' flags checked, --max-loras defaulted and --lora-modules parsed into (name, path) pairs."""
    lora_wanted = args.enable_lora or args.lora_modules or args.max_loras
    if args.max_loras is None:
        args.max_loras = max(4, len(args.lora_modules)) if lora_wanted else 0
    if args.max_loras < 0 or args.max_lora_rank < 1:
        parser.error("--max-loras must be at least 0 and --max-lora-rank at least 1")
    if len(args.lora_modules) > args.max_loras:
        parser.error(f"--lora-modules names {len(args.lora_modules)} adapters for --max-loras {args.max_loras} slots")
    args.lora_modules = parse_modules(args.lora_modules)
