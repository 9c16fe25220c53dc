"""Sample text from a GPT-J checkpoint: one --prompt, or an interactive loop reading prompts from stdin until EOF.

Example: python device_sample.py --ckpt gptj_1shard --prompt "Hi" [--dtype bf16] [--mp 1]
(--config only where the checkpoint carries no config of its own)
"""
from __future__ import annotations

import argparse
import logging
import sys
import time
from collections.abc import Iterator
from functools import partial

from mesh_transformer.config import ConfigError
from mesh_transformer.errors import run_main
from mesh_transformer.flags import Parser, add_inference_args
from mesh_transformer.platforms import platform_setup


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line; raises ConfigError on a bad one."""
    p = Parser(description=__doc__.splitlines()[0])
    add_inference_args(p)
    p.add_argument("--prompt", help="the prompt; without it, prompts are read from stdin, one a line")
    p.add_argument("--max-new-tokens", type=int, default=64, help="tokens to generate at most (default 64)")
    p.add_argument("--temperature", type=float, default=0.75, help="0 = greedy (default 0.75)")
    p.add_argument("--top-p", type=float, default=0.9, help="nucleus mass in (0, 1]; 1 = off (default 0.9)")
    p.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens; 0 = off (default)")
    p.add_argument("--seed", type=int, default=0, help="sample i uses seed + i (default 0)")
    p.add_argument("--stop", nargs="+", default=[], metavar="TEXT", help="end a completion before this text")
    p.add_argument("--num-samples", type=int, default=1, help="completions per prompt (default 1)")
    args = p.parse_args(argv)
    for flag in ("max_new_tokens", "num_samples"):
        if getattr(args, flag) < 1:
            p.error(f"--{flag.replace('_', '-')} must be at least 1, got {getattr(args, flag)}")
    if args.prompt == "":
        p.error("--prompt is empty")
    if "" in args.stop:
        p.error("--stop texts must not be empty")
    from mesh_transformer.infer.sampler import check_sampling

    try:
        check_sampling([args.temperature], [args.top_k], [args.top_p])
    except ValueError as e:
        p.error(str(e))
    return args


def stdin_lines() -> Iterator[str]:
    """Lines typed (or piped) on stdin, prompted with '> ' on a terminal; blank lines are skipped."""
    while True:
        if sys.stdin.isatty():
            print("> ", end="", file=sys.stderr, flush=True)
        line = sys.stdin.readline()
        if not line:
            return
        if line.strip():
            yield line.rstrip("\n")


def _complete(sampler, tokenizer, prompt: str, args: argparse.Namespace) -> None:
    start_s = time.perf_counter()
    results = sampler.generate_text(
        tokenizer, [prompt] * args.num_samples, args.max_new_tokens, temperature=args.temperature,
        top_k=args.top_k, top_p=args.top_p, seed=[args.seed + i for i in range(args.num_samples)], stop=args.stop)
    logging.info("%d tokens in %.2f s", sum(len(r.tokens) for r in results), time.perf_counter() - start_s)
    for i, result in enumerate(results):
        if args.num_samples > 1:
            print(f"--- sample {i + 1} ({result.finish_reason}) ---")
        print(result.text, flush=True)


def _main(argv: list[str] | None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    logging.getLogger("mesh_transformer.infer.params").setLevel(logging.INFO)  # the mesh chosen
    from mesh_transformer.infer.load import load_for_inference
    from mesh_transformer.infer.sampler import Sampler

    layout, tokenizer, params = load_for_inference(args)
    sampler = Sampler(layout, params)
    if args.prompt is not None:
        try:
            _complete(sampler, tokenizer, args.prompt, args)
        except ValueError as e:  # e.g. a prompt longer than the context allows
            raise ConfigError(str(e)) from None
        return 0
    for prompt in stdin_lines():
        try:
            _complete(sampler, tokenizer, prompt, args)
        except ValueError as e:  # say so and read the next prompt
            print(f"error: {str(e).splitlines()[0]}", file=sys.stderr, flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    """Run the tool; user mistakes print one line on stderr and exit 2."""
    return run_main(partial(_main, argv))


if __name__ == "__main__":
    platform_setup()
    sys.exit(main())
