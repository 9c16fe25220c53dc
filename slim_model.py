"""Make a slim checkpoint: params only (no optimizer state), cast to bf16 (or --dtype), from a checkpoint of any format.

    python slim_model.py --input-ckpt runs/6B/step_1000 --config configs/6B_roto_256.json --output-ckpt runs/6B_slim

--dtype int8 writes the layers' matrices as int8 with a scale per output channel (the rest in bf16, GPT-J-6B in
6.4 GB), the numbers `--dtype int8` would quantize while loading; the sampling, serving and eval tools read it as
int8 (or dequantized, with a float --dtype), the converters dequantized.
"""
from __future__ import annotations

import argparse
import logging
import sys

from mesh_transformer import errors, flags


EXAMPLES = """\
examples:
  python slim_model.py --input-ckpt runs/6B/step_1000 --config configs/6B_roto_256.json --output-ckpt runs/6B_slim
  python slim_model.py --input-ckpt step_383500/ --config configs/6B_roto_256.json --output-ckpt gptj_int8 \\
      --dtype int8
"""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=EXAMPLES,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    flags.add_convert_args(parser)
    parser.add_argument("--dtype", choices=flags.CONVERT_DTYPES, default="bf16",
                        help="dtype of the params (default: bf16; int8: see above)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    def run() -> int:
        from mesh_transformer.store import convert

        print(convert.convert_checkpoint(args.input_ckpt, flags.load_config(args), args.output_ckpt, dtype=args.dtype,
                                         slim=True), flush=True)
        return 0

    return errors.run_main(run)


if __name__ == "__main__":
    sys.exit(main())
