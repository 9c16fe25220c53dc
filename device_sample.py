"""Sample text from a GPT-J checkpoint: one --prompt, or an interactive loop reading prompts from stdin until EOF.

Example: python device_sample.py --ckpt gptj_1shard --prompt "Hi" [--dtype bf16] [--mp 1]
(--config only where the checkpoint carries no config of its own)
"""
from __future__ import annotations

import argparse
import itertools
import logging
import sys
import time
from functools import partial

from mesh_transformer import compile_cache
from mesh_transformer.config import ConfigError
from mesh_transformer.errors import run_main
from mesh_transformer.flags import Parser, add_inference_args, add_sampling_args, check_sampling_args, stdin_lines
from mesh_transformer.platforms import platform_setup


EXAMPLES = """\
examples:
  python device_sample.py --ckpt gptj_1shard --prompt "Hi" --dtype bf16
  python device_sample.py --hf gpt-j-6B/ --dtype int8 --temperature 0 --max-new-tokens 128 < prompts.txt
"""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line; raises ConfigError on a bad one."""
    p = Parser(description=__doc__.split("\n\n")[0], epilog=EXAMPLES,
               formatter_class=argparse.RawDescriptionHelpFormatter)
    add_inference_args(p)
    p.add_argument("--prompt", help="the prompt; without it, prompts are read from stdin, one a line")
    add_sampling_args(p)
    compile_cache.add_cache_args(p)
    args = p.parse_args(argv)
    if args.prompt == "":
        p.error("--prompt is empty")
    check_sampling_args(p, args)
    return args


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
    for name in ("mesh_transformer.infer.params", "mesh_transformer.compile_cache"):  # the mesh, the cache's use
        logging.getLogger(name).setLevel(logging.INFO)
    cache = compile_cache.enable(args.compilation_cache)
    from mesh_transformer.infer.load import open_for_inference, sampler_for

    layout, tokenizer, source = open_for_inference(args)
    # The first prompt's programs compile before the weights arrive (piped stdin: its first line is read first).
    lines = stdin_lines() if args.prompt is None else iter(())
    first = args.prompt if args.prompt is not None else None if sys.stdin.isatty() else next(lines, None)
    sampler = sampler_for(layout, source, args, None if first is None else len(tokenizer.encode(first)))
    if args.prompt is not None:
        try:
            _complete(sampler, tokenizer, args.prompt, args)
        except ValueError as e:  # e.g. a prompt longer than the context allows
            raise ConfigError(str(e)) from None
    else:
        for prompt in itertools.chain([first] if first is not None else [], lines):
            try:
                _complete(sampler, tokenizer, prompt, args)
            except ValueError as e:  # say so and read the next prompt
                print(f"error: {str(e).splitlines()[0]}", file=sys.stderr, flush=True)
    logging.getLogger(compile_cache.__name__).info("%s", cache.summary())
    return 0


def main(argv: list[str] | None = None) -> int:
    """Run the tool; user mistakes print one line on stderr and exit 2."""
    return run_main(partial(_main, argv))


if __name__ == "__main__":
    platform_setup()
    sys.exit(main())
