"""Rewrite a checkpoint (ours, original mesh-transformer-jax, or HF) as ours, laid out for another cores_per_replica.

    python resharding_example.py --input-ckpt gs://bucket/mesh_jax_pile_6B_rotary/step_383500 \\
        --config configs/6B_roto_256.json --output-ckpt ckpt_mp1 --cores-per-replica 1 --slim --dtype bf16

Arrays are streamed one at a time (host memory near one layer); the output config (cores_per_replica set) is saved
in the checkpoint's metadata and as OUTPUT/config.json.
"""
from __future__ import annotations

import argparse
import logging
import sys

from mesh_transformer import cli

DTYPES = ("bf16", "fp16", "fp32")


def add_io_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--input-ckpt", required=True,
                        help="our checkpoint (root or step dir), an original step_N dir, or an HF directory")
    cli.add_config_args(parser)
    parser.add_argument("--output-ckpt", required=True, help="checkpoint root to write step_N under (local or gs://)")


def convert_checkpoint(args: argparse.Namespace, cores_per_replica: int | None, dtype: str | None,
                       slim: bool) -> int:
    """The shared body of resharding_example and slim_model: write the checkpoint, then its config."""
    import json

    from mesh_transformer.store import checkpoint, convert, storage

    cfg = cli.load_config(args)
    step_dir = convert.write_checkpoint(args.input_ckpt, cfg, args.output_ckpt, cores_per_replica=cores_per_replica,
                                        dtype=dtype, slim=slim)
    root, step = checkpoint.find_step(step_dir)
    out_cfg = checkpoint.read_metadata(root, step)["config"]
    storage.write_bytes_atomic(storage.join(args.output_ckpt, "config.json"), json.dumps(out_cfg, indent=2).encode())
    print(f"wrote {step_dir} (cores_per_replica {out_cfg['cores_per_replica']})", flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_io_args(parser)
    parser.add_argument("--cores-per-replica", type=int, help="model-parallel layout of the output (default: the "
                                                              "config's cores_per_replica)")
    parser.add_argument("--slim", action="store_true", help="params only: leave the optimizer state out")
    parser.add_argument("--dtype", choices=DTYPES, help="cast the params (default: keep their dtype)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return cli.run_main(lambda: convert_checkpoint(args, args.cores_per_replica, args.dtype, args.slim))


if __name__ == "__main__":
    sys.exit(main())
