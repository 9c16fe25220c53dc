"""Sample text from a GPT-J checkpoint: one --prompt, or an interactive loop reading prompts from stdin until EOF.

Example: python device_sample.py --ckpt gptj_1shard --prompt "Hi" [--dtype bf16] [--mp 1]
(--config only where the checkpoint carries no config of its own)
"""
from __future__ import annotations

import argparse
import logging
import sys
import time
from functools import partial

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
    logging.getLogger("mesh_transformer.infer.params").setLevel(logging.INFO)  # the mesh chosen
    from mesh_transformer.infer.load import open_for_inference, read_for_inference
    from mesh_transformer.infer.programs import Programs
    from mesh_transformer.infer.sampler import Sampler, compile_ahead

    layout, tokenizer, source = open_for_inference(args)
    programs = Programs(layout)
    if args.prompt is not None:  # compiled before the weights are read: the compiler's memory is not added to theirs
        compile_ahead(programs, args.num_samples, len(tokenizer.encode(args.prompt)), args.max_new_tokens)
    sampler = Sampler(layout, read_for_inference(layout, source, args), programs)
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
