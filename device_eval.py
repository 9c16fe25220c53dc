"""Evaluate a GPT-J with lm-evaluation-harness tasks on the devices present; results (and samples) as lm_eval writes
them.

Example: python device_eval.py --ckpt gptj_1shard --tasks lambada_openai,hellaswag [--limit 100]
    [--num_fewshot 0] [--batch_size 8] [--output_path results/] [--log_samples] [--include_path my_tasks/]
"""
from __future__ import annotations

import argparse
import logging
import sys
from functools import partial

from mesh_transformer import compile_cache
from mesh_transformer.errors import run_main
from mesh_transformer.flags import EVAL_SEEDS, Parser, add_inference_args, parse_seeds
from mesh_transformer.platforms import platform_setup

EXAMPLES = """\
examples:
  python device_eval.py --ckpt gptj_1shard --tasks lambada_openai,hellaswag --limit 100
  python device_eval.py --hf gpt-j-6B/ --dtype int8 --tasks hellaswag --num_fewshot 0 --output_path results/ \\
      --log_samples
"""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line (lm_eval's own flag names for the evaluation); raises ConfigError on a bad one."""
    p = Parser(description=__doc__.split("\n\n")[0], epilog=EXAMPLES,
               formatter_class=argparse.RawDescriptionHelpFormatter)
    add_inference_args(p)
    p.add_argument("--tasks", required=True, help="comma-separated lm-eval task names")
    p.add_argument("--include_path", help="a directory of extra task YAML files")
    p.add_argument("--num_fewshot", type=int, help="examples in the few-shot context (default: the task's)")
    p.add_argument("--limit", type=float, help="examples per task at most (a fraction when below 1)")
    p.add_argument("--batch_size", type=int, default=8, help="rows per scoring program and prompts per generation "
                                                             "batch (default 8)")
    p.add_argument("--max_gen_toks", type=int, default=256, help="new tokens at most where a task sets none")
    p.add_argument("--output_path", help="where lm_eval's results JSON (and samples JSONL) go")
    p.add_argument("--log_samples", action="store_true", help="also write each sample's inputs and outputs")
    p.add_argument("--seed", type=parse_seeds, default=parse_seeds(EVAL_SEEDS),
                   help=f"python, numpy, torch and few-shot seeds, or one for all (default {EVAL_SEEDS})")
    compile_cache.add_cache_args(p)
    args = p.parse_args(argv)
    args.tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    if not args.tasks:
        p.error("--tasks names no task")
    if args.log_samples and not args.output_path:
        p.error("--log_samples needs --output_path")
    if args.batch_size < 1 or (args.limit is not None and args.limit <= 0):
        p.error("--batch_size and --limit must be positive")
    return args


def _main(argv: list[str] | None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    cache = compile_cache.enable(args.compilation_cache)
    from lm_eval.utils import make_table

    from mesh_transformer.infer import harness
    from mesh_transformer.infer.load import load_for_inference

    manager = harness.task_manager(args.include_path, args.tasks)
    harness.check_tasks(manager, args.tasks)  # before the model is read: a typo costs seconds
    layout, tokenizer, params = load_for_inference(args)
    lm = harness.MeshTransformerLM(layout, params, tokenizer, batch_size=args.batch_size,
                                   max_gen_toks=args.max_gen_toks)
    tracker = harness.tracker(args.output_path)
    random_seed, numpy_seed, torch_seed, fewshot_seed = args.seed
    results = harness.evaluate(lm, args.tasks, manager=manager, num_fewshot=args.num_fewshot, limit=args.limit,
                               log_samples=args.log_samples, evaluation_tracker=tracker, random_seed=random_seed,
                               numpy_random_seed=numpy_seed, torch_random_seed=torch_seed,
                               fewshot_random_seed=fewshot_seed)
    if args.output_path:
        harness.save_results(tracker, results, args.log_samples)
    print(make_table(results), flush=True)
    logging.getLogger(compile_cache.__name__).info("%s", cache.summary())
    return 0


def main(argv: list[str] | None = None) -> int:
    """Run the evaluation; user mistakes print one line on stderr and exit 2."""
    return run_main(partial(_main, argv))


if __name__ == "__main__":
    platform_setup()
    sys.exit(main())
