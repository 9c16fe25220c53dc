"""Serve a GPT-J over HTTP: OpenAI-compatible /v1/completions and /v1/chat/completions (streaming too), /v1/models,
the original /complete, /health and Prometheus /metrics, with continuous batching on the devices.

Example: python device_serve.py --ckpt gptj_1shard --port 5000 [--dtype bf16] [--mp 1]
"""
from __future__ import annotations

import argparse
import logging
import sys
from functools import partial

from mesh_transformer import compile_cache
from mesh_transformer.errors import run_main
from mesh_transformer.flags import (Parser, add_inference_args, add_lora_args, add_paged_cache_args, lora_args,
                                   paged_cache)
from mesh_transformer.platforms import platform_setup


EXAMPLES = """\
examples:
  python device_serve.py --ckpt gptj_1shard --port 5000 --dtype bf16
  python device_serve.py --hf gpt-j-6B/ --dtype int8 --max-batch 16 --warm-up --api-key KEY
  python device_serve.py --hf gpt-j-6B/ --dtype int8 --max-batch 64 --kv-cache-dtype int8 --warm-up
  python device_serve.py --hf gpt-j-6B/ --dtype int8 --lora-modules sql=adapters/sql legal=gs://b/legal --max-loras 16
"""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line; raises ConfigError on a bad one."""
    p = Parser(description=__doc__.split("\n\n")[0], epilog=EXAMPLES,
               formatter_class=argparse.RawDescriptionHelpFormatter)
    add_inference_args(p)
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=5000, help="port (default 5000)")
    p.add_argument("--max-batch", type=int, default=8, help="requests generated together (default 8; rounded up "
                                                           "to a multiple of the data-parallel size)")
    p.add_argument("--max-queue", type=int, default=64, help="requests waiting at most; more get 429 (default 64)")
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' (all but /health)")
    p.add_argument("--model-name", default=None, help="the model id the API reports (default: the config's name)")
    p.add_argument("--chat-template", default=None, help="a jinja chat template file for /v1/chat/completions "
                                                         "(default: the tokenizer's, else plain 'User: ...' turns)")
    p.add_argument("--no-prefix-cache", dest="prefix_cache", action="store_false",
                   help="compute every prompt whole (default: reuse the cached keys of a prompt prefix a slot holds)")
    p.add_argument("--warm-up", action="store_true",
                   help="compile every program before listening (those applying penalties just after): a slower "
                        "start, no compile pauses while serving")
    add_paged_cache_args(p, server=True)
    add_lora_args(p)
    compile_cache.add_cache_args(p)
    args = p.parse_args(argv)
    lora_args(p, args)
    args.paged = paged_cache(p, args)
    if not 0 <= args.port <= 65535:
        p.error(f"--port must be in [0, 65535], got {args.port}")
    for flag in ("max_batch", "max_queue"):
        if getattr(args, flag) < 1:
            p.error(f"--{flag.replace('_', '-')} must be at least 1, got {getattr(args, flag)}")
    if args.api_key == "":
        p.error("--api-key is empty")
    return args


def _main(argv: list[str] | None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    chat_template = None
    if args.chat_template:  # read first: a wrong path fails before the model loads
        with open(args.chat_template, encoding="utf-8") as f:
            chat_template = f.read()
    cache = compile_cache.enable(args.compilation_cache)
    from mesh_transformer.serve import server
    from mesh_transformer.serve.start import sized_engine

    engine, tokenizer = sized_engine(args)
    cfg = engine.cfg
    app = server.create_app(engine, tokenizer, model_name=args.model_name or cfg.name, api_key=args.api_key,
                            chat_template=chat_template, lora_modules=args.lora_modules)
    logging.info("%s", cache.summary())
    logging.info("serving %s with %d slots on http://%s:%d", cfg.name, engine.n_slots, args.host, args.port)
    try:
        server.serve(app, args.host, args.port)
    finally:
        engine.close()
    return 0


def main(argv: list[str] | None = None) -> int:
    """Run the server; user mistakes print one line on stderr and exit 2."""
    return run_main(partial(_main, argv))


if __name__ == "__main__":
    platform_setup()
    sys.exit(main())
