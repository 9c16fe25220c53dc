"""How a command-line script ends on a user's mistake: which exceptions are mistakes rather than bugs, and the one
line (and exit status 2) each, or a device out-of-memory error, is reported as (`run_main`)."""
from __future__ import annotations

import sys
from collections.abc import Callable

from mesh_transformer import config


def user_errors() -> tuple[type[BaseException], ...]:
    """Exceptions that mean bad input, not a bug: reported on one line without a traceback."""
    # Imported here, not at the top: the scripts import this module before JAX starts, and these import JAX.
    from mesh_transformer.store import checkpoint, tfrecord
    from mesh_transformer.train import trainer

    from google.auth.exceptions import DefaultCredentialsError  # gs:// paths without credentials

    return (config.ConfigError, tfrecord.DataError, checkpoint.CorruptCheckpointError, trainer.TrainingError,
            FileNotFoundError, FileExistsError, PermissionError, DefaultCredentialsError)


OUT_OF_MEMORY_HINT = ("the model does not fit: try --dtype int8 (half of bf16's weights; bf16 is half of fp32's), a "
                      "larger --mp (more devices per model copy), fewer slots (--max-batch), a paged cache of what "
                      "fits (device_serve.py --kv-pages auto, --kv-cache-dtype int8) or a shorter context "
                      "(--set seq=N)")
TRAIN_OUT_OF_MEMORY_HINT = ("the training step does not fit: try a smaller per_replica_batch with more "
                            "gradient_accumulation_steps, remat true, a larger cores_per_replica (or mesh_fsdp), and "
                            "for LoRA base_dtype bfloat16 (--set key=value); aot_check.py --topology checks a config "
                            "without the device")


def out_of_memory_message(e: BaseException, hint: str = OUT_OF_MEMORY_HINT) -> str | None:
    """A one-line account of a device out-of-memory error (how much was asked, what to change), else None."""
    import jax

    text = str(e)
    if not isinstance(e, jax.errors.JaxRuntimeError) or "RESOURCE_EXHAUSTED" not in text:
        return None
    first = next((line.strip() for line in text.splitlines() if "RESOURCE_EXHAUSTED" in line), text.splitlines()[0])
    return f"out of device memory ({first.partition('RESOURCE_EXHAUSTED:')[2].strip() or first}); {hint}"


def run_main(fn: Callable[[], int], out_of_memory_hint: str = OUT_OF_MEMORY_HINT) -> int:
    """Run a CLI body; user errors and device out-of-memory print one line on stderr and give exit status 2; the
    latter names what to change (`out_of_memory_hint`: the inference tools' flags unless given)."""
    try:
        return fn()
    except user_errors() as e:
        print(f"error: {str(e).splitlines()[0] if str(e) else type(e).__name__}", file=sys.stderr, flush=True)
        return 2
    except Exception as e:
        message = out_of_memory_message(e, out_of_memory_hint)
        if message is None:
            raise
        print(f"error: {message}", file=sys.stderr, flush=True)
        return 2
