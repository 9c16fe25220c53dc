"""Train or fine-tune a GPT-J model: resumes from the latest checkpoint in model_dir.

    python device_train.py --config configs/demo.json [--tune-model-path P] [--fresh-opt] [--set key=value ...]
"""
from __future__ import annotations

import argparse
import logging
import sys

from mesh_transformer import compile_cache, errors, flags, platforms


EXAMPLES = """\
examples:
  python device_train.py --config configs/demo.json
  python device_train.py --config configs/6B_lora_v5litepod-1.json --tune-model-path step_383500/ \\
      --set train_set=data/mydata.index
"""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=EXAMPLES,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    flags.add_config_args(parser)
    flags.add_distributed_args(parser)
    parser.add_argument("--tune-model-path", help="start from this checkpoint's params, with a fresh schedule")
    parser.add_argument("--fresh-opt", action="store_true", help="reset the optimizer state when resuming")
    parser.add_argument("--include_path", help="a directory of extra lm-eval task YAML files for eval_harness_tasks")
    compile_cache.add_cache_args(parser)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    def run() -> int:
        import jax

        from mesh_transformer.train import trainer

        cfg = flags.load_config(args)
        cache = compile_cache.enable(args.compilation_cache)
        flags.start_distributed(args)
        evaluate = None
        if cfg.eval_harness_tasks:  # lm-eval is imported only then
            from mesh_transformer.infer import harness

            evaluate = harness.training_evaluator(cfg, args.include_path)
        with trainer.StopFlag() as stop:
            t = trainer.Trainer(cfg, tune_model_path=args.tune_model_path, fresh_opt=args.fresh_opt,
                                evaluate=evaluate)
            step = t.run(stop.event)
        if jax.process_index() == 0:
            print(f"stopped at step {step}; checkpoints and metrics in {cfg.model_path}", flush=True)
        logging.getLogger(compile_cache.__name__).info("%s", cache.summary())
        return 0

    return errors.run_main(run, errors.TRAIN_OUT_OF_MEMORY_HINT)


if __name__ == "__main__":
    platforms.platform_setup()
    sys.exit(main())
