"""Ahead-of-time fit check: compile the train step and the inference programs for faked CPU devices or for a real TPU
slice or GPU set (compile-only devices, no accelerator needed), report per-device memory.

With `--set lora_rank=N` (and base_dtype, lora_targets) the train step is the LoRA one: adapters and their optimizer
state trained, the base held frozen in base_dtype.

Prints JSON lines (params and optimizer bytes, the compiler's arguments / outputs / temporaries, compile times, which
compiler made each; for a TPU or GPU target the train step's estimated seconds, tokens/s and MFU) and human lines.
Exit status 0: fits in --device-memory; 1: does not fit; 2: bad input.

    python aot_check.py --config configs/6B_roto_256.json [--mode shard_map|dp|fsdp|tp|fsdp_tp|all]
        [--mesh data=1,fsdp=8,tensor=1] [--topology v3-8 | --devices 8] [--device-memory 16GiB] [--set key=value]

--topology is a Cloud TPU accelerator type (v3-8, v4-8, v5litepod-1, v5litepod-8, v5p-8, v6e-8, v3-32, ...) compiled
by libtpu, or a GPU set KIND-N (h100-8, h200-1, a100-80-8, l40s-1, rtx4090-1, v100-1, t4-1, ...) compiled by the CUDA
plugin; --devices N fakes N CPU devices instead (the CPU compiler's figures are the CPU's, not an accelerator's). The
shard_map path takes its mesh from the config (mp = cores_per_replica, dp = the rest of the devices); the GSPMD modes
take --mesh (axes left out are 1, data defaults to the devices the others leave) or a default per mode.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

from mesh_transformer import errors, flags
from mesh_transformer.parallel.layout import MODES


EXAMPLES = """\
examples:
  python aot_check.py --config configs/6B_lora_v5litepod-1.json --topology v5litepod-1
  python aot_check.py --config configs/6B_roto_256.json --topology v3-8 --mode all
  python aot_check.py --config configs/6B_roto_256.json --topology v5litepod-1 --inference-only \\
      --set weight_dtype=int8 --max-batch 64 --kv-cache-dtype int8 --max-loras 16
"""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=EXAMPLES,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    flags.add_config_args(parser)
    parser.add_argument("--mode", choices=("shard_map", *MODES, "all"),
                        help="parallelism (default: the config's); all: every mode's train step")
    parser.add_argument("--mesh", default="", help="GSPMD mesh sizes, e.g. data=1,fsdp=8,tensor=1")
    parser.add_argument("--topology", help="a TPU slice (v3-8, v5litepod-1, ...) or GPU set (h100-8, ...) to "
                                           "compile for, without the device")
    parser.add_argument("--devices", type=int, default=8, help="faked CPU devices (without --topology)")
    parser.add_argument("--device-memory", help="memory of one device, e.g. 16GiB (default: the target's, or 16GiB)")
    parser.add_argument("--slots", "--max-batch", dest="slots", type=int, default=8,
                        help="serving slots (device_serve.py --max-batch; default 8)")
    only = parser.add_mutually_exclusive_group()
    only.add_argument("--train-only", action="store_true", help="compile the train step(s) only")
    only.add_argument("--inference-only", action="store_true",
                      help="compile the serving and sampling programs only (e.g. with --set weight_dtype=int8)")
    parser.add_argument("--no-loop-hoisting", action="store_true",
                        help="compile the CPU's train step without XLA's loop-invariant code motion, which on CPU "
                             "hoists an f32 copy of a bf16 base out of the layer loop (GPUs and TPUs hold none)")
    server = parser.add_argument_group("device_serve.py's cache flags (with --inference-only: the server's verdict)")
    flags.add_paged_cache_args(server, server=True)
    server.add_argument("--max-loras", type=int, help="LoRA adapter slots the server holds (device_serve.py's)")
    server.add_argument("--max-lora-rank", type=int, help="their rank (device_serve.py's; default 16)")
    args = parser.parse_args(argv)
    given = [f for f in ("kv_pages", "kv_cache_dtype", "max_loras", "max_lora_rank") if getattr(args, f) is not None]
    if given and not args.inference_only:
        parser.error(f"--{given[0].replace('_', '-')} is device_serve.py's: give it with --inference-only")
    paged = flags.paged_cache(parser, args) if args.inference_only else None
    args.overrides += [f"{key}={getattr(args, key)}" for key in ("max_loras", "max_lora_rank")
                       if getattr(args, key) is not None]

    def run() -> int:
        from mesh_transformer import aot

        records = aot.run(flags.load_config(args), args.mode, args.mesh, args.devices, args.device_memory, args.slots,
                          args.no_loop_hoisting, args.topology, args.train_only, args.inference_only, paged)
        for record in records:
            print(json.dumps(record), flush=True)
        print(aot.human_line(records), flush=True)
        return 0 if records[-1]["fits"] else 1

    return errors.run_main(run)


if __name__ == "__main__":
    os.environ.setdefault("JAX_PLATFORMS", "cpu")  # this process compiles for its targets, it runs nothing on them
    sys.exit(main())
