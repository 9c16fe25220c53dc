"""The flags the command-line scripts share (config, model, conversion, multi-host) and what reads them: the config
they name (`load_config`) and the multi-process run they describe (`start_distributed`)."""
from __future__ import annotations

import argparse

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


def load_config(args: argparse.Namespace) -> config.Config:
    return config.load(args.config, args.overrides)


def start_distributed(args: argparse.Namespace) -> None:
    """Join the multi-process run the flags (or the environment) describe, before any device is touched."""
    from mesh_transformer.parallel import mesh  # it imports JAX: the scripts parse their flags without it

    try:
        mesh.init_distributed(args.coordinator, args.num_processes, args.process_id)
    except ValueError as e:
        raise config.ConfigError(str(e)) from None
