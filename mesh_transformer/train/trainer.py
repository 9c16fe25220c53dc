"""The training loop: resume or init, step, validate, checkpoint, log; stops cleanly on SIGTERM / Ctrl-C."""
from __future__ import annotations

import logging
import math
import os
import signal
import threading
from collections.abc import Callable, Iterator
from typing import Any

import jax
import numpy as np
from tqdm import tqdm

from mesh_transformer.model.split import split_of
from mesh_transformer.parallel.layout import make_layout
from mesh_transformer import storage
from mesh_transformer.store import checkpoint
from mesh_transformer.train import data, finetune, optim, state
from mesh_transformer.config import Config, ConfigError
from mesh_transformer.train.metrics import MetricsWriter, StepRate

log = logging.getLogger(__name__)


class TrainingError(RuntimeError):
    """Training cannot go on (for example a non-finite loss); the last good checkpoint is kept."""


def _check_inputs(cfg: Config) -> None:
    if not cfg.train_set:
        raise ConfigError("config key 'train_set' is missing: give an index file or a list of [index, weight]")
    root = cfg.model_path
    if not storage.is_gcs(root):
        try:
            storage.makedirs(root)
            probe = storage.join(root, f".write-probe-{jax.process_index()}")
            storage.write_bytes_atomic(probe, b"")
            os.remove(probe)
        except OSError as e:
            raise ConfigError(f"model_dir {root} is not writable: {e.strerror or e}") from None


def _train_sources(cfg: Config):
    if isinstance(cfg.train_set, str):
        return cfg.train_set
    try:
        return [(str(index), float(weight)) for index, weight in cfg.train_set]
    except (TypeError, ValueError):
        raise ConfigError("config key 'train_set' must be an index path or a list of [index, weight] pairs") from None


class StopFlag:
    """Set by SIGTERM or SIGINT; the loop checks it between steps, saves and exits."""

    def __init__(self) -> None:
        self.event = threading.Event()
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> StopFlag:
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                self._previous[sig] = signal.signal(sig, lambda *_: self.event.set())
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


class Trainer:
    """Owns the Layout, the compiled steps, the train state and the data iterator of one run."""

    def __init__(self, cfg: Config, *, tune_model_path: str | None = None, fresh_opt: bool = False,
                 evaluate: Callable[..., dict[str, float]] | None = None):
        """`evaluate(params, adapters) -> metrics` runs every val_every besides validation (device_train.py passes the
        lm-eval tasks of eval_harness_tasks there; train/ does not import infer/)."""
        _check_inputs(cfg)
        self.cfg, self.evaluate = cfg, evaluate
        self.root = cfg.model_path
        self.checkpointer = checkpoint.Checkpointer(self.root, keep_last=cfg.keep_last, keep_every=cfg.keep_every)
        self.layout = make_layout(cfg)
        devices = self.layout.mesh.devices
        log.info("train mesh: %s over %d %s devices", " x ".join(f"{k} {v}" for k, v in self.layout.mesh.shape.items()),
                 devices.size, devices.flat[0].platform)
        self.split = split_of(cfg)
        self.mesh, self.global_batch = self.layout.mesh, self.layout.global_batch
        self.optimizer = optim.make_optimizer(cfg)
        self.schedule = optim.lr_schedule(cfg)
        self.frozen: dict = {}  # the split's frozen tree, the steps' last argument: LoRA's base params, or nothing
        self.base_identity: dict | None = None
        self.state, data_state = self._start_state(tune_model_path, fresh_opt)
        train_step, frozen_formats = state.make_train_step(self.layout, self.optimizer, self.schedule), None
        if self.frozen:  # LoRA's base, moved into the layouts the step's compiler chose (`state.compile_train_step`)
            train_step, frozen_formats = state.compile_train_step(self.layout, self.optimizer, self.schedule)
            self.frozen = state.place_frozen(self.frozen, frozen_formats)
        eval_step = state.make_eval_step(self.layout, frozen_formats=frozen_formats)
        self.train_step = lambda train_state, tokens: train_step(train_state, tokens, self.frozen)
        self.eval_step = lambda params, tokens: eval_step(params, tokens, self.frozen)
        self.step = int(self.state["step"])
        self.dataset = data.TokenDataset(
            _train_sources(cfg), cfg.seq, self.global_batch, seed=cfg.seed, state=data_state,
            gradient_accumulation_steps=cfg.gradient_accumulation_steps,
            process_index=jax.process_index(), process_count=jax.process_count())
        self.metrics = MetricsWriter(self.root, enabled=jax.process_index() == 0, wandb_project=cfg.wandb_project,
                                     run_name=cfg.name, config=cfg.to_dict())
        self.last_saved_step: int | None = self.step if data_state is not None else None
        self.rate = StepRate(cfg.gradient_accumulation_steps * self.global_batch * cfg.seq)

    def _start_state(self, tune_model_path: str | None, fresh_opt: bool) -> tuple[dict, dict | None]:
        """Resume from the latest valid checkpoint of model_dir, else start from tune_model_path (any format, no
        random init first) or random init. LoRA: the base from tune_model_path, else from the run's metadata."""
        abstract = state.abstract_train_state(self.layout, self.optimizer)
        found = checkpoint.restore_latest_valid(self.root, abstract)
        if found is not None:
            step, train_state, metadata = found
            log.info("resuming from %s at step %d", self.root, step)
            if self.split.frozen_axes(self.cfg):
                self._load_base(tune_model_path, metadata.get(finetune.BASE_KEY))
            if fresh_opt:
                train_state["opt_state"] = state.init_opt_state(self.layout, train_state["params"], self.optimizer)
            return train_state, metadata.get("data_state")
        if self.split.frozen_axes(self.cfg):
            self._load_base(tune_model_path, None)
        elif tune_model_path:
            params = finetune.tuned_params(self.layout, tune_model_path)
            step = jax.device_put(np.zeros((), np.int32), self.layout.replicated)
            opt_state = state.init_opt_state(self.layout, params, self.optimizer)
            return {"step": step, "params": params, "opt_state": opt_state}, None
        return state.init_train_state(self.layout, self.optimizer, jax.random.PRNGKey(self.cfg.seed)), None

    def model_params(self) -> tuple[dict, dict | None]:
        """The whole model: (params, LoRA adapters or None), from the state's trainable tree and the frozen one."""
        return self.split.model(self.state["params"], self.frozen)

    def _load_base(self, path: str | None, saved: dict | None) -> None:
        """The frozen base of a LoRA run: `path`, else the one the run's checkpoints name; checked against them."""
        path = path or (saved or {}).get("path")
        if not path:
            raise ConfigError("LoRA (lora_rank > 0) needs a base model: give --tune-model-path (ours, an original "
                              "mesh-transformer-jax checkpoint or an HF directory)")
        base, self.base_identity = finetune.load_base(self.layout, path)
        if saved is not None:
            finetune.check_base(saved, self.base_identity)
        self.frozen = base

    def _global_batch(self, local_GxBxT1: np.ndarray) -> jax.Array:
        return jax.make_array_from_process_local_data(self.layout.batch_sharding(), local_GxBxT1)

    def save(self, blocking: bool = False) -> None:
        if self.last_saved_step == self.step:
            return
        metadata = {"config": self.cfg.to_dict(), "data_state": self.dataset.state()}
        if self.base_identity is not None:
            metadata[finetune.BASE_KEY] = self.base_identity
        self.checkpointer.save(self.step, self.state, metadata, blocking=blocking)
        self.last_saved_step = self.step

    def validate(self) -> dict[str, float]:
        """Mean loss and perplexity on each val_set over val_batches batches."""
        results = {}
        for name, index in self.cfg.val_set.items():
            losses = [float(self.eval_step(self.state["params"], self._val_batch(b))) for b in data.val_batches(
                index, self.cfg.seq, self.global_batch, self.cfg.val_batches,
                process_index=jax.process_index(), process_count=jax.process_count())]
            if losses:
                loss = float(np.mean(losses))
                results[f"val/{name}/loss"] = loss
                results[f"val/{name}/ppl"] = math.exp(min(loss, 50.0))
        return results

    def _val_batch(self, local_BxT1: np.ndarray) -> jax.Array:
        return jax.make_array_from_process_local_data(self.layout.batch_sharding(accumulated=False),
                                                      local_BxT1)

    def _log(self, step: int, metrics: dict, dispatched_at: float) -> dict[str, float]:
        """Read a step's metrics (one step behind the device) and stop on a non-finite loss."""
        scalars = {k: float(v) for k, v in jax.device_get(metrics).items()}
        scalars["tokens_per_s"] = self.rate.completed(dispatched_at)
        if not math.isfinite(scalars["loss"]):
            raise TrainingError(f"loss became {scalars['loss']} at step {step}; stopping, the last good checkpoint "
                                f"(step {self.last_saved_step}) is kept")
        self.metrics.write(step, scalars)
        return scalars

    def batches(self) -> Iterator[jax.Array]:
        for local in self.dataset:
            yield self._global_batch(local)

    def run(self, stop: threading.Event | None = None) -> int:
        """Train to total_steps or until `stop` is set; returns the last step. Always leaves a checkpoint."""
        cfg = self.cfg
        stop = stop or threading.Event()
        pending: tuple[int, dict, float] | None = None
        bar = tqdm(total=cfg.total_steps, initial=self.step, disable=jax.process_index() != 0, dynamic_ncols=True)
        batches = self.batches()
        try:
            while self.step < cfg.total_steps and not stop.is_set():
                self.state, metrics = self.train_step(self.state, next(batches))
                self.step += 1
                dispatched_at = self.rate.dispatched()
                if pending is not None:
                    shown = self._log(*pending)
                    bar.set_postfix(loss=f"{shown['loss']:.3f}", tok_s=f"{shown['tokens_per_s']:.0f}")
                pending = (self.step, metrics, dispatched_at)
                bar.update(1)
                due_val = cfg.val_every and self.step % cfg.val_every == 0 and (cfg.val_set or self.evaluate)
                due_ckpt = self.step % cfg.ckpt_every == 0 or self.step == cfg.total_steps
                if due_val or due_ckpt:
                    self._log(*pending)  # never save or validate past an unchecked loss
                    pending = None
                if due_val:
                    val = {**self.validate(), **(self.evaluate(*self.model_params()) if self.evaluate else {})}
                    self.metrics.write(self.step, val)
                    log.info("step %d validation: %s", self.step, val)
                if due_ckpt:
                    self.save()
            if pending is not None:
                self._log(*pending)
            if stop.is_set():
                log.info("stop requested: writing a checkpoint at step %d", self.step)
            self.save(blocking=True)
        finally:
            self.checkpointer.wait()  # a save already under way completes even when training fails
            bar.close()
            self.metrics.close()
            self.dataset.close()
        return self.step
