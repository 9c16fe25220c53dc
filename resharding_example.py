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

from mesh_transformer import errors, flags


EXAMPLES = """\
examples:
  python resharding_example.py --input-ckpt step_383500/ --config configs/6B_roto_256.json \\
      --output-ckpt gptj_1shard --cores-per-replica 1 --slim --dtype bf16
"""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=EXAMPLES,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    flags.add_convert_args(parser)
    parser.add_argument("--cores-per-replica", type=int, help="model-parallel layout of the output (default: the "
                                                              "config's cores_per_replica)")
    parser.add_argument("--slim", action="store_true", help="params only: leave the optimizer state out")
    parser.add_argument("--dtype", choices=flags.CONVERT_DTYPES,
                        help="cast the params (default: keep their dtype; int8, with --slim: the layers' matrices in "
                             "int8, as slim_model.py writes them)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    def run() -> int:
        from mesh_transformer.store import convert

        print(convert.convert_checkpoint(args.input_ckpt, flags.load_config(args), args.output_ckpt,
                                         cores_per_replica=args.cores_per_replica, dtype=args.dtype, slim=args.slim),
              flush=True)
        return 0

    return errors.run_main(run)


if __name__ == "__main__":
    sys.exit(main())
