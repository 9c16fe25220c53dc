"""What every command-line script shares: config flags, multi-host start-up, one-line errors for user mistakes."""
from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

from mesh_transformer import config


def add_config_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", required=True, help="flat JSON config file")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override a config key (value parsed as JSON, else a string); repeatable")


def load_config(args: argparse.Namespace) -> config.Config:
    return config.load(args.config, args.overrides)


def user_errors() -> tuple[type[BaseException], ...]:
    """Exceptions that mean bad input, not a bug: reported on one line without a traceback."""
    from mesh_transformer import checkpoint, tfrecord, trainer

    return (config.ConfigError, tfrecord.DataError, checkpoint.CorruptCheckpointError, trainer.TrainingError,
            FileNotFoundError, PermissionError)


def run_main(fn: Callable[[], int]) -> int:
    """Run a CLI body; user errors print one line on stderr and give exit status 2."""
    try:
        return fn()
    except user_errors() as e:
        print(f"error: {str(e).splitlines()[0] if str(e) else type(e).__name__}", file=sys.stderr, flush=True)
        return 2
