"""Ahead-of-time fit check: compile the train step and a decode step for faked CPU devices, report per-device memory.

With `--set lora_rank=N` (and base_dtype, lora_targets) the train step is the LoRA one: adapters and their optimizer
state trained, the base held frozen in base_dtype.

Prints JSON lines (params and optimizer bytes, XLA's arguments / outputs / temporaries, compile times) and one human
line. Exit status 0: fits in --device-memory; 1: does not fit; 2: bad input.

    python aot_check.py --config configs/6B_roto_256.json [--mode shard_map|dp|fsdp|tp|fsdp_tp]
        [--mesh data=1,fsdp=8,tensor=1] [--devices 8] [--device-memory 16GiB] [--set key=value ...]

The shard_map path takes its mesh from the config (mp = cores_per_replica, dp = the rest of --devices); the GSPMD
modes take --mesh (axes left out are 1, data defaults to the devices the others leave).
"""
from __future__ import annotations

import argparse
import json
import sys

from mesh_transformer import cli
from mesh_transformer.parallel.layout import MODES


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    cli.add_config_args(parser)
    parser.add_argument("--mode", choices=("shard_map", *MODES), help="parallelism (default: the config's)")
    parser.add_argument("--mesh", default="", help="GSPMD mesh sizes, e.g. data=1,fsdp=8,tensor=1")
    parser.add_argument("--devices", type=int, default=8, help="faked CPU devices")
    parser.add_argument("--device-memory", default="16GiB", help="memory of one device, e.g. 16GiB")
    parser.add_argument("--slots", type=int, default=8, help="serving slots (device_serve.py --max-batch; default 8)")
    parser.add_argument("--no-loop-hoisting", action="store_true",
                        help="compile the train step without XLA's loop-invariant code motion, which on CPU hoists "
                             "an f32 copy of a bf16 base out of the layer loop (GPUs and TPUs hold none)")
    args = parser.parse_args(argv)

    def run() -> int:
        from mesh_transformer import aot

        records = aot.run(cli.load_config(args), args.mode, args.mesh, args.devices, args.device_memory, args.slots,
                          args.no_loop_hoisting)
        for record in records:
            print(json.dumps(record), flush=True)
        print(aot.human_line(records), flush=True)
        return 0 if records[-1]["fits"] else 1

    return cli.run_main(run)


if __name__ == "__main__":
    sys.exit(main())
