"""Export a checkpoint (ours, original mesh-transformer-jax, or HF) as an HF GPTJForCausalLM directory.

    python to_hf_weights.py --input-ckpt runs/6B [--config configs/6B_roto_256.json] --output-path gptj-hf \\
        [--dtype fp16|bf16|fp32] [--max-shard-size 5GB] [--peft]

A LoRA run exports merged (W + A @ B * scale), or with --peft as an HF PEFT adapter directory (adapter_config.json
and adapter_model.safetensors) that peft.PeftModel.from_pretrained loads over the base's HF export. --config is
needed only for a checkpoint that carries none (an original mesh-transformer-jax one).

The directory holds config.json, safetensors weights (split with model.safetensors.index.json past --max-shard-size)
and the tokenizer files, so GPTJForCausalLM.from_pretrained and AutoTokenizer.from_pretrained load it. Local or gs://.
"""
from __future__ import annotations

import argparse
import logging
import sys

from mesh_transformer import errors, flags


EXAMPLES = """\
examples:
  python to_hf_weights.py --input-ckpt gptj_1shard --output-path gptj_hf --dtype fp16
  python to_hf_weights.py --input-ckpt lora_6B_v5litepod-1 --output-path lora_adapter --peft
"""


def main(argv: list[str] | None = None) -> int:
    from mesh_transformer.config import parse_size

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=EXAMPLES,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--input-ckpt", required=True,
                        help="our checkpoint (root or step dir), an original step_N dir, or an HF directory")
    flags.add_config_args(parser, required=False)
    parser.add_argument("--output-path", required=True, help="directory to write (local or gs://)")
    parser.add_argument("--dtype", choices=("fp16", "bf16", "fp32"), default="fp16", help="weight dtype (fp16)")
    parser.add_argument("--max-shard-size", type=parse_size, default="5GB",
                        help="largest safetensors file, e.g. 5GB, 500MB, 2GiB (default 5GB)")
    parser.add_argument("--peft", action="store_true", help="write a LoRA run's adapters as a PEFT directory")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    def run() -> int:
        from mesh_transformer.config import ConfigError, parse_overrides
        from mesh_transformer.store import adapters, convert, hf_export

        if args.peft:
            files = adapters.export_peft(args.input_ckpt, args.output_path)
            print(f"wrote {args.output_path}: {', '.join(files)}", flush=True)
            return 0
        cfg = flags.load_config(args) if args.config else convert.source_config(
            args.input_ckpt, **parse_overrides(args.overrides))
        if cfg is None:
            raise ConfigError(f"{args.input_ckpt} carries no config: give --config")
        files = hf_export.write_hf(args.input_ckpt, cfg, args.output_path, dtype=args.dtype,
                                 max_shard_bytes=args.max_shard_size)
        print(f"wrote {args.output_path}: {', '.join(files)}", flush=True)
        return 0

    return errors.run_main(run)


if __name__ == "__main__":
    sys.exit(main())
