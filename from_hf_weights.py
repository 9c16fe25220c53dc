"""Import an HF GPT-J directory (safetensors) as our checkpoint, with a matching config at OUTPUT/config.json.

    python from_hf_weights.py --hf-model gptj-hf --output-ckpt runs/gptj [--cores-per-replica 8] [--dtype fp32]

Weights are streamed one at a time; pytorch_model.bin (pickle) is refused: re-save it as safetensors first.
"""
from __future__ import annotations

import argparse
import logging
import sys

from mesh_transformer import errors


EXAMPLES = """\
examples:
  python from_hf_weights.py --hf-model gptj_hf --output-ckpt gptj_from_hf
  python from_hf_weights.py --hf-model gpt-j-6B/ --output-ckpt gptj_mp8 --cores-per-replica 8 --dtype bf16
"""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=EXAMPLES,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hf-model", required=True, help="HF GPT-J directory: config.json + safetensors (or gs://)")
    parser.add_argument("--output-ckpt", required=True, help="checkpoint root to write step_0 under (local or gs://)")
    parser.add_argument("--cores-per-replica", type=int, default=1,
                        help="model-parallel layout of the output and its config (default 1)")
    parser.add_argument("--dtype", choices=("bf16", "fp16", "fp32"), help="cast the params (default: keep)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    def run() -> int:
        from mesh_transformer.store import convert

        print(convert.import_hf(args.hf_model, args.output_ckpt, cores_per_replica=args.cores_per_replica,
                                dtype=args.dtype), flush=True)
        return 0

    return errors.run_main(run)


if __name__ == "__main__":
    sys.exit(main())
