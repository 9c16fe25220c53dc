"""Make a slim checkpoint: params only (no optimizer state), cast to bf16 (or --dtype), from a checkpoint of any format.

    python slim_model.py --input-ckpt runs/6B/step_1000 --config configs/6B_roto_256.json --output-ckpt runs/6B_slim
"""
from __future__ import annotations

import argparse
import logging
import sys

from mesh_transformer import cli
from resharding_example import DTYPES, add_io_args, convert_checkpoint


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_io_args(parser)
    parser.add_argument("--dtype", choices=DTYPES, default="bf16", help="dtype of the params (default: bf16)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return cli.run_main(lambda: convert_checkpoint(args, None, args.dtype, slim=True))


if __name__ == "__main__":
    sys.exit(main())
