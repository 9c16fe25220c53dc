"""device_serve.py's engine from its flags: the model opened, the server sized before the weights are read
(sizing.py: a setting that cannot fit fails there, a paged cache of auto pages takes what the largest programs
leave), then the weights read and the engine made over the programs the sizing compiled."""
from __future__ import annotations

import argparse
import logging
from typing import Any

from mesh_transformer.infer.load import open_for_inference, read_for_inference
from mesh_transformer.infer.programs import Programs
from mesh_transformer.serve import sizing
from mesh_transformer.serve.engine import Engine

log = logging.getLogger(__name__)


def sized_engine(args: argparse.Namespace) -> tuple[Engine, Any]:
    """(engine, tokenizer) of device_serve.py's flags (`flags.paged_cache`'s in `args.paged`)."""
    layout, tokenizer, source = open_for_inference(args)
    programs = Programs(layout)
    fit = sizing.for_server(programs, max_batch=args.max_batch, prefix_cache=args.prefix_cache, **args.paged)
    log.info("%s", fit.summary())
    engine = Engine(layout, read_for_inference(layout, source, args), tokenizer, max_batch=args.max_batch,
                    max_queue=args.max_queue, warm_up=args.warm_up, programs=programs,
                    prefix_cache=args.prefix_cache, n_pages=fit.n_pages, page_size=args.paged["page_size"],
                    reserve_pages=args.kv_reserve)
    return engine, tokenizer
