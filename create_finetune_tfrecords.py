"""Turn a .txt / .jsonl / .zst corpus (a file or a folder of them) into packed TFRecord token files and an index.

Example: python create_finetune_tfrecords.py corpus/ mydata --output-dir data --seq 2048 --files-per 10000
"""
from __future__ import annotations

import argparse
import logging
import sys


EXAMPLES = """\
examples:
  python create_finetune_tfrecords.py corpus/ mydata --output-dir data --seq 2048 --files-per 10000
  python create_finetune_tfrecords.py demo_out/corpus/val val --output-dir demo_out/data --seq 64 \\
      --preserve-data-order
"""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line, with the original tool's flags."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=EXAMPLES,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("input_path", help="a .txt, .jsonl or .zst (compressed jsonl or txt) file, or a folder of them "
                                      "(searched recursively, sorted)")
    p.add_argument("name", help="output name: files are {name}_{i}_{n_records}.tfrecords, the index {name}.index")
    p.add_argument("--output-dir", default=".", help="where the files go (local path or gs://); default .")
    p.add_argument("--seq", type=int, default=2048, help="model context length; records hold seq + 1 tokens")
    p.add_argument("--min-unique-tokens", type=int, default=0,
                   help="drop records with fewer unique tokens than this (0 keeps all)")
    p.add_argument("--n-repack-epochs", type=int, default=1,
                   help="repeat the documents this many times, shuffled differently each time")
    p.add_argument("--seed", type=int, default=10, help="seed of the shuffles")
    p.add_argument("--preserve-data-order", action="store_true", help="keep document and record order; no shuffle")
    p.add_argument("--normalize-with-ftfy", action="store_true", help="fix text with ftfy (NFKC) before tokenizing")
    p.add_argument("--files-per", type=int, default=100_000, help="records per .tfrecords file")
    p.add_argument("--tokenizer", default=None, help="'gpt2' (default, offline) or a local tokenizer directory")
    args = p.parse_args(argv)
    for flag in ("seq", "n_repack_epochs", "files_per"):
        if getattr(args, flag) <= 0:
            p.error(f"--{flag.replace('_', '-')} must be positive, got {getattr(args, flag)}")
    return args


def main(argv: list[str] | None = None) -> int:
    """Run the tool; user mistakes print one line on stderr and exit 2."""
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    from mesh_transformer.train.finetune_records import PackOptions, create_finetune_tfrecords
    from mesh_transformer.tokenizer import load_tokenizer

    options = PackOptions(seq=args.seq, n_repack_epochs=args.n_repack_epochs, seed=args.seed,
                          preserve_data_order=args.preserve_data_order, min_unique_tokens=args.min_unique_tokens)
    try:
        index_path, n_records = create_finetune_tfrecords(
            args.input_path, args.name, args.output_dir, load_tokenizer(args.tokenizer), options,
            records_per_file=args.files_per, normalize_with_ftfy=args.normalize_with_ftfy)
    except (ValueError, OSError) as e:  # DataError is a ValueError
        message = str(e).replace("\n", " ")
        print(f"error: {message}", file=sys.stderr)
        return 2
    print(f"wrote {n_records} records of {args.seq + 1} tokens; index {index_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
