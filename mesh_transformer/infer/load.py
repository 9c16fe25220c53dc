"""A model for the sampling, serving and evaluation tools from their model flags (`flags.add_inference_args`): the
config and checkpoint they name, the tokenizer, and the params read onto a mesh fitted to the devices."""
from __future__ import annotations

import argparse
import concurrent.futures
import logging
import time

import jax
from transformers import PreTrainedTokenizerBase

from mesh_transformer import config, storage
from mesh_transformer.infer.params import make_inference_layout, read_params
from mesh_transformer.parallel.layout import Layout
from mesh_transformer.platforms import host_memory_returned
from mesh_transformer.store import convert
from mesh_transformer.tokenizer import load_tokenizer

log = logging.getLogger(__name__)


def inference_config(args: argparse.Namespace) -> tuple[config.Config, str]:
    """(config, checkpoint path) of the sampling and serving tools: --config when given, else the config the
    checkpoint carries (ours: its metadata; HF: config.json; original layout: a config.json beside or above its
    step directory); --set and --dtype applied on top."""
    source = args.hf or args.ckpt
    overrides = config.parse_overrides(args.overrides)
    if args.dtype:
        overrides.update(config.INFERENCE_DTYPES[args.dtype])
    if getattr(args, "quantize_head", False):
        overrides["quantize_head"] = True
    if getattr(args, "max_loras", 0):  # device_serve.py's served LoRA adapters' slots
        overrides.update(max_loras=args.max_loras, max_lora_rank=args.max_lora_rank)

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


def open_for_inference(args: argparse.Namespace) -> tuple[Layout, PreTrainedTokenizerBase, str]:
    """(layout, tokenizer, checkpoint path) for the sampling and serving tools: all but the weights, which
    `read_for_inference` reads (a tool may compile in between, while the host holds no weights)."""
    cfg, source = inference_config(args)
    layout = make_inference_layout(cfg, mp=args.mp)
    try:
        tokenizer = load_tokenizer(cfg.tokenizer)
    except ValueError as e:
        raise config.ConfigError(str(e)) from None
    return layout, tokenizer, source


def read_for_inference(layout: Layout, source: str, args: argparse.Namespace) -> dict:
    """The params of `source` read straight into the decode programs' form on the layout's mesh (`read_params`),
    with the --lora adapters merged, host memory returned as each layer is placed."""
    start_s = time.perf_counter()
    with host_memory_returned():
        params = jax.block_until_ready(read_params(layout, source, lora=args.lora))
    log.info("read %.2f GB of params from %s in %.1f s (%s)", sum(x.nbytes for x in jax.tree.leaves(params)) / 1e9,
             source, time.perf_counter() - start_s,
             "joined on the host" if layout.policy.host_loading else "joined on the devices")
    return params


def load_for_inference(args: argparse.Namespace) -> tuple[Layout, PreTrainedTokenizerBase, dict]:
    """(layout, tokenizer, params) for the sampling and serving tools, the params read straight into the decode
    programs' form on a mesh fitted to the devices."""
    layout, tokenizer, source = open_for_inference(args)
    return layout, tokenizer, read_for_inference(layout, source, args)


def sampler_for(layout: Layout, source: str, args: argparse.Namespace, first_prompt_tokens: int | None):
    """A `Sampler` over the params of `source` (`read_for_inference`), the programs of a first prompt of that many
    tokens (where known) compiled before they arrive: on the CPU first, so that the compiler's working memory is not
    added to the weights'; on an accelerator while they are read (the compiler works on the host, the weights go to
    the devices)."""
    from mesh_transformer.infer.programs import Programs
    from mesh_transformer.infer.sampler import Sampler, compile_ahead

    programs = Programs(layout)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        compiling = None
        if first_prompt_tokens is not None:
            compiling = pool.submit(compile_ahead, programs, args.num_samples, first_prompt_tokens,
                                    args.max_new_tokens)
            if layout.policy.host_loading:
                compiling.result()
        params = read_for_inference(layout, source, args)
        if compiling is not None:
            compiling.result()
    return Sampler(layout, params, programs)
