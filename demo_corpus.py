"""Write the demo corpus: the running interpreter's standard-library .py sources, sorted, as .txt files.

Every machine with the same Python has the same data and nothing is downloaded.

    python demo_corpus.py OUT_DIR [--train-bytes N] [--val-bytes N]
"""
from __future__ import annotations

import argparse
import os
import sysconfig


def stdlib_sources() -> list[str]:
    root = sysconfig.get_paths()["stdlib"]
    paths = []
    for directory, subdirs, files in os.walk(root):
        subdirs[:] = sorted(d for d in subdirs if d not in ("site-packages", "test", "tests", "idlelib"))
        paths += [os.path.join(directory, f) for f in files if f.endswith(".py")]
    return sorted(paths, key=lambda p: os.path.relpath(p, root))


EXAMPLES = """\
examples:
  python demo_corpus.py demo_out/corpus
  python demo_corpus.py corpus --train-bytes 30000000 --val-bytes 1000000
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=EXAMPLES,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out_dir")
    parser.add_argument("--train-bytes", type=int, default=3_000_000)
    parser.add_argument("--val-bytes", type=int, default=200_000)
    args = parser.parse_args()
    budgets = {"train": args.train_bytes, "val": args.val_bytes}
    split, written = "train", 0
    for path in stdlib_sources():
        with open(path, encoding="utf-8", errors="replace") as f:
            text = f.read()
        if written + len(text) > budgets[split]:
            if split == "val":
                break
            split, written = "val", 0
        os.makedirs(os.path.join(args.out_dir, split), exist_ok=True)
        name = os.path.relpath(path, sysconfig.get_paths()["stdlib"]).replace(os.sep, "__")
        with open(os.path.join(args.out_dir, split, name + ".txt"), "w", encoding="utf-8") as f:
            f.write(text)
        written += len(text)
    print(f"demo corpus in {args.out_dir}/train and {args.out_dir}/val")


if __name__ == "__main__":
    main()
