"""Plot a run's train and validation loss from MODEL_DIR/metrics.jsonl into a PNG and print its path."""
from __future__ import annotations

import argparse
import sys

from mesh_transformer.train.metrics import MetricsError, plot_loss


EXAMPLES = """\
examples:
  python plot_metrics.py demo_out/model
  python plot_metrics.py gs://my-bucket/lora_6B_v5litepod-1 --out loss.png
"""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=EXAMPLES,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model_dir", help="run directory, local or gs://, holding metrics.jsonl")
    parser.add_argument("--out", help="where to write the PNG (default: MODEL_DIR/loss.png)")
    args = parser.parse_args(argv)
    try:
        path = plot_loss(args.model_dir, args.out)
    except (MetricsError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
