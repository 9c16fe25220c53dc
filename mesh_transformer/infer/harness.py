"""The lm-evaluation-harness adapter: a `TemplateLM` (registered as "mesh-transformer") that scores and generates
with our programs on a mesh fitted to the devices, and `evaluate`, which runs tasks through it.

loglikelihood: each request truncated from the left as lm-eval's HF model does (the last seq + 1 tokens), requests
with the same context packed together (score.py), rows of one width bucket, `batch_size` rows per program.
loglikelihood_rolling: disjoint windows of seq tokens (lm-eval's own window functions, context 1), scored alike.
generate_until: the sampler, greedy unless do_sample, cut at the request's stop strings, max_gen_toks new tokens.
Importing this module imports lm_eval; training, sampling and serving never do.
"""
from __future__ import annotations

import collections
import difflib
import logging
from collections.abc import Callable, Sequence
from typing import Any

import lm_eval.models  # noqa: F401  (lm-eval's own models register first: it only loads them into an empty registry)
import numpy as np
from lm_eval import utils as lm_utils
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from tqdm import tqdm

from mesh_transformer import flags
from mesh_transformer.config import Config, ConfigError
from mesh_transformer.infer.load import load_for_inference
from mesh_transformer.infer.params import make_inference_layout, place_params
from mesh_transformer.infer.sampler import Sampler
from mesh_transformer.infer.score import Scorer, Unit, pack
from mesh_transformer.parallel.layout import Layout
from mesh_transformer.tokenizer import EOS_ID, eos_ids, load_tokenizer

log = logging.getLogger(__name__)

MODEL_NAME = "mesh-transformer"
DEFAULT_BATCH_ROWS = 8
DEFAULT_MAX_GEN_TOKS = 256
SAMPLE_SEED = 1234


def truncate(context: Sequence[int], continuation: Sequence[int], seq: int) -> tuple[tuple[int, ...], ...]:
    """(context, continuation) cut from the left to seq + 1 tokens (seq inputs), as lm-eval's HF model does."""
    whole = (list(context) + list(continuation))[-(seq + 1):]
    n_cont = min(len(continuation), len(whole) - 1)
    return tuple(whole[:len(whole) - n_cont]), tuple(whole[len(whole) - n_cont:])


@register_model(MODEL_NAME)
class MeshTransformerLM(TemplateLM):
    """GPT-J on our programs. Built from (layout, params, tokenizer), or by lm-eval from model_args
    `ckpt=P[,config=C,mp=N,dtype=bf16]` (see `from_arg_string`)."""

    def __init__(self, layout: Layout, params: dict, tokenizer: Any, batch_size: int | str = DEFAULT_BATCH_ROWS,
                 max_gen_toks: int = DEFAULT_MAX_GEN_TOKS, adapters: dict | None = None, **_ignored: Any):
        super().__init__()
        self.layout, self.cfg, self.tokenizer = layout, layout.cfg, tokenizer
        rows = DEFAULT_BATCH_ROWS if batch_size in (None, "auto") else int(str(batch_size).split(":")[0])
        self.params = place_params(params, layout, adapters)
        self.scorer = Scorer(layout, self.params, batch_rows=rows)
        self.sampler = Sampler(layout, self.params)
        self.batch_size = self.scorer.batch_rows
        self.max_gen_toks = min(int(max_gen_toks), self.cfg.seq - 1)

    def use_params(self, params: dict, adapters: dict | None = None) -> None:
        """Evaluate these params (with these LoRA adapters merged) from now on (of the same shapes: the compiled
        programs are kept)."""
        self.params = place_params(params, self.layout, adapters)
        self.scorer.params = self.sampler.params = self.params

    def drop_params(self) -> None:
        """Let go of the params (their device memory is freed once nothing else holds them) until `use_params`."""
        self.params = self.scorer.params = self.sampler.params = None

    @classmethod
    def create_from_arg_string(cls, arg_string: str, additional_config: dict | None = None) -> MeshTransformerLM:
        """lm-eval's way in: `--model mesh-transformer --model_args ckpt=P[,config=C,mp=N,dtype=int8,lora=A]`: any
        flag of the sampling tools' model flags (`flags.add_inference_args`) by its name, the rest for the adapter."""
        args = lm_utils.simple_parse_args_string(arg_string)
        parser = flags.Parser(prog="mesh-transformer model_args")
        flags.add_inference_args(parser)
        argv = []
        for action in parser._actions:  # the model flags by their names; a switch as quantize_head=True
            if action.dest not in args or not action.option_strings or action.dest == "overrides":
                continue
            value, flag = str(args.pop(action.dest)), action.option_strings[0]
            argv += ([flag] if value.lower() in ("true", "1") else []) if action.nargs == 0 else [flag, value]
        layout, tokenizer, params = load_for_inference(parser.parse_args(argv))
        extra = {k: v for k, v in (additional_config or {}).items() if v is not None}
        return cls(layout, params, tokenizer, **{**args, **extra})

    # --------------------------------------------------------------------------------------- what lm-eval asks of it
    @property
    def eot_token_id(self) -> int:
        return next(iter(eos_ids(self.tokenizer)), EOS_ID)

    @property
    def prefix_token_id(self) -> int:
        """What a rolling log-likelihood's first window starts from: the tokenizer's BOS (Llama's <s>), else its end
        of text (GPT-2's and Pythia's are the same token), as lm-eval's `hf` model has it."""
        bos = getattr(self.tokenizer, "bos_token_id", None)
        return self.eot_token_id if bos is None else int(bos)

    @property
    def max_length(self) -> int:
        return self.cfg.seq

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs: Any) -> list[int]:
        """The text's tokens as lm-eval's `hf` model encodes them: with the tokenizer's own special tokens (a Llama
        tokenizer's BOS) unless told, or where the text starts with the BOS already."""
        bos_text = self.tokenizer.decode([self.prefix_token_id])
        if add_special_tokens is None and bos_text and string.startswith(bos_text):
            add_special_tokens = False
        if add_special_tokens is None:
            return self.tokenizer.encode(string)
        return self.tokenizer.encode(string, add_special_tokens=add_special_tokens)

    def tok_decode(self, tokens: Sequence[int], **kwargs: Any) -> str:
        return self.tokenizer.decode(list(tokens))

    def _loglikelihood_tokens(self, requests: list, disable_tqdm: bool = False,
                              **kwargs: Any) -> list[tuple[float, bool]]:
        """(sum of the continuation's log-probs, whether each of its tokens was the argmax) per request."""
        pairs = [truncate(context, continuation, self.cfg.seq) for _, context, continuation in requests]
        results = self.score_pairs(pairs, disable_tqdm)
        for (key, _, _), result in zip(requests, results):
            if key is not None:
                self.cache_hook.add_partial("loglikelihood", key, result)
        return results

    def score_pairs(self, pairs: Sequence[tuple[Sequence[int], Sequence[int]]],
                    disable_tqdm: bool = True) -> list[tuple[float, bool]]:
        """(log-prob sum, greedy) of each (context, continuation) pair, contexts shared where they are equal."""
        by_context: dict[tuple[int, ...], list[int]] = collections.defaultdict(list)
        for i, (context, _) in enumerate(pairs):
            by_context[tuple(context)].append(i)
        units = [Unit(ctx, tuple(tuple(pairs[i][1]) for i in members)) for ctx, members in by_context.items()]
        width = self.scorer.width(max((u.length for u in units), default=1))
        rows, placed = pack(units, width)
        step = self.scorer.batch_rows
        logprob_RxC, greedy_RxC = np.zeros(rows.targets.shape), np.zeros(rows.targets.shape, bool)
        bar = tqdm(total=len(pairs), desc="Running loglikelihood requests", disable=disable_tqdm)
        done_rows = np.zeros(rows.ids.shape[0] + 1, np.int64)  # requests whose last row is r, for the bar
        for places in placed:
            done_rows[max(p.row for p in places)] += len(places)
        for start in range(0, rows.ids.shape[0], step):
            scores = self.scorer.run(type(rows)(*[x[start:start + step] for x in rows]))
            logprob_RxC[start:start + step], greedy_RxC[start:start + step] = scores.logprob, scores.greedy
            bar.update(int(done_rows[start:start + step].sum()))
        bar.close()
        results: list[tuple[float, bool]] = [(0.0, True)] * len(pairs)
        for members, places in zip(by_context.values(), placed):
            for i, p in zip(members, places):
                span = slice(p.start, p.start + p.length)
                results[i] = (float(logprob_RxC[p.row, span].sum()), bool(greedy_RxC[p.row, span].all()))
        return results

    def loglikelihood_rolling(self, requests: list, disable_tqdm: bool = False) -> list[float]:
        """The log-likelihood of each whole text, over disjoint windows of seq tokens."""
        windows, owner = [], []
        for i, (text,) in enumerate(req.args for req in requests):
            for context, continuation in map(lm_utils.make_disjoint_window, lm_utils.get_rolling_token_windows(
                    token_list=self.tok_encode(text), prefix_token=self.prefix_token_id,
                    max_seq_len=self.max_length, context_len=1)):
                windows.append((context, continuation))
                owner.append(i)
        totals = [0.0] * len(requests)
        for i, (logprob, _) in zip(owner, self.score_pairs(windows, disable_tqdm)):
            totals[i] += logprob
        for req, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, total)
        return totals

    def generate_until(self, requests: list, disable_tqdm: bool = False) -> list[str]:
        """Each request's continuation: greedy unless do_sample, cut before the first stop string."""
        outputs: list[str | None] = [None] * len(requests)
        by_kwargs: dict[str, list[int]] = collections.defaultdict(list)
        for i, req in enumerate(requests):
            by_kwargs[repr(sorted(req.args[1].items()))].append(i)
        bar = tqdm(total=len(requests), desc="Running generate_until requests", disable=disable_tqdm)
        for members in by_kwargs.values():
            gen_kwargs = dict(requests[members[0]].args[1])
            members = sorted(members, key=lambda i: -len(self.tok_encode(requests[i].args[0])))
            for start in range(0, len(members), self.batch_size):
                chunk = members[start:start + self.batch_size]
                for i, text in zip(chunk, self._generate([requests[i].args[0] for i in chunk], gen_kwargs)):
                    outputs[i] = text
                    self.cache_hook.add_partial("generate_until", requests[i].args, text)
                bar.update(len(chunk))
        bar.close()
        return outputs

    def _generate(self, contexts: list[str], gen_kwargs: dict) -> list[str]:
        until = gen_kwargs.get("until") or [self.tok_decode([self.eot_token_id])]
        until = [until] if isinstance(until, str) else list(until)
        max_new = min(int(gen_kwargs.get("max_gen_toks", self.max_gen_toks)), self.cfg.seq - 1)
        sampling = {"temperature": 0.0}
        if gen_kwargs.get("do_sample") and float(gen_kwargs.get("temperature", 1.0)) > 0:
            sampling = {"temperature": float(gen_kwargs.get("temperature", 1.0)), "top_p": float(
                gen_kwargs.get("top_p", 1.0)), "top_k": int(gen_kwargs.get("top_k", 0) or 0), "seed": SAMPLE_SEED}
        results = self.sampler.generate_text(self.tokenizer, contexts, max_new, stop=until, truncate_left=True,
                                             **sampling)
        return [r.text for r in results]


def check_tasks(task_manager: Any, tasks: Sequence[str]) -> None:
    """Raises a ConfigError naming an unknown task and the nearest known names."""
    known = task_manager.all_tasks
    for task in tasks:
        if task not in known:
            near = difflib.get_close_matches(task, known, n=3)
            hint = f"; nearest: {', '.join(near)}" if near else "; list them with `lm_eval ls tasks`"
            raise ConfigError(f"unknown lm-eval task '{task}'{hint}")


def task_manager(include_path: str | None = None, tasks: Sequence[str] = ()) -> Any:
    """lm-eval's TaskManager over its bundled tasks and `include_path`; when every one of `tasks` is found under
    include_path alone, that one only (indexing the ~14,000 bundled tasks takes about 20 s)."""
    from lm_eval.tasks import TaskManager

    if include_path:
        own = TaskManager(include_path=include_path, include_defaults=False)
        if tasks and all(task in own.all_tasks for task in tasks):
            return own
    return TaskManager(include_path=include_path)


def evaluate(lm: MeshTransformerLM, tasks: Sequence[str], *, include_path: str | None = None,
             manager: Any = None, **options: Any) -> dict:
    """lm_eval.simple_evaluate over the adapter: unknown tasks and datasets that cannot be had offline are
    ConfigErrors (one line). `options` are simple_evaluate's (limit, num_fewshot, log_samples, random_seed...)."""
    from lm_eval import simple_evaluate

    manager = manager or task_manager(include_path, tasks)
    check_tasks(manager, tasks)
    try:
        return simple_evaluate(model=lm, tasks=list(tasks), task_manager=manager, **options)
    except (ConnectionError, OSError) as e:
        raise ConfigError(f"a task's dataset cannot be loaded (offline?): {str(e).splitlines()[0]}") from None


def task_metrics(results: dict, prefix: str = "eval") -> dict[str, float]:
    """Each task's numeric metrics as flat scalars: {"eval/<task>/<metric>": value} (lm-eval's "acc,none" keys
    lose their filter name when it is "none")."""
    out = {}
    for task, metrics in results.get("results", {}).items():
        for key, value in metrics.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool) and not key.startswith("alias"):
                name, _, filt = key.partition(",")
                out[f"{prefix}/{task}/{name if filt in ('', 'none') else f'{name}_{filt}'}"] = float(value)
    return out


def tracker(output_path: str | None) -> Any:
    """lm-eval's EvaluationTracker, which names and writes the results files as `lm_eval --output_path` does."""
    from lm_eval.loggers import EvaluationTracker

    return EvaluationTracker(output_path=output_path)


def save_results(evaluation_tracker: Any, results: dict, log_samples: bool) -> None:
    """The results JSON, and with log_samples one samples JSONL per task, as lm_eval's CLI writes them."""
    samples = results.pop("samples", None) if log_samples else None
    evaluation_tracker.save_results_aggregated(results=results, samples=samples)
    if samples is not None:
        for task_name in results["configs"]:
            evaluation_tracker.save_results_samples(task_name=task_name, samples=samples[task_name])


def training_evaluator(cfg: Config, include_path: str | None = None) -> Callable[..., dict[str, float]]:
    """The trainer's `evaluate` hook for cfg.eval_harness_tasks (at most cfg.eval_harness_limit examples each):
    (params, LoRA adapters or None) -> {"eval/<task>/<metric>": value}. It runs on process 0's devices, on process
    0's view of the params (gathered to its host first when there are several processes; the others return {}).
    Tasks are checked now, so a typo fails before training starts."""
    import jax
    from jax.experimental import multihost_utils

    tasks, limit = list(cfg.eval_harness_tasks), cfg.eval_harness_limit
    if limit is not None and limit < 1:
        raise ConfigError(f"config key 'eval_harness_limit' must be at least 1 (or null), got {limit}")
    manager = task_manager(include_path, tasks)
    check_tasks(manager, tasks)
    layout = make_inference_layout(cfg, devices=[d for d in jax.devices() if d.process_index == 0])
    state: dict[str, MeshTransformerLM] = {}

    def evaluate_params(params: dict, adapters: dict | None = None) -> dict[str, float]:
        if jax.process_count() > 1:
            params, adapters = multihost_utils.process_allgather((params, adapters))
            if jax.process_index() != 0:
                return {}
        if "lm" in state:
            state["lm"].use_params(params, adapters)
        else:
            state["lm"] = MeshTransformerLM(layout, params, load_tokenizer(cfg.tokenizer), adapters=adapters)
        try:
            results = evaluate(state["lm"], tasks, manager=manager, limit=limit, bootstrap_iters=0, log_samples=False)
        finally:
            state["lm"].drop_params()  # training needs the memory back: a 6B copy is 12 GB
        return task_metrics(results)

    return evaluate_params
