"""Training metrics from process 0: a JSONL log, TensorBoard event files, optionally Weights & Biases, and a loss plot.

`{model_dir}/metrics.jsonl` holds one line per write, `{"step": .., "time": .., **scalars}`; `read_metrics` merges it
back. Key conventions: train `loss`, `grad_norm`, `lr`, `tokens_per_s`; validation `val/{name}/loss`, `val/{name}/ppl`.

Event files in `{model_dir}/tensorboard/` are written without TensorFlow: TFRecord framing (tfrecord.frame_record)
around hand-encoded protos
  Event{wall_time=1 double, step=2 int64, file_version=3 string, summary=5 Summary, session_log=7 SessionLog}
  Summary{value=1 repeated Value{tag=1 string, simple_value=2 float}}    SessionLog{status=1 enum, START=1}.
A GCS object cannot be appended to, so on gs:// both files are buffered in memory and rewritten whole on flush.
"""
from __future__ import annotations

import io
import json
import logging
import re
import socket
import struct
import time
from collections.abc import Mapping
from typing import Any

from mesh_transformer import storage
from mesh_transformer.store.tfrecord import len_field, varint, frame_record

log = logging.getLogger(__name__)

METRICS_FILE = "metrics.jsonl"
TENSORBOARD_DIR = "tensorboard"
PLOT_FILE = "loss.png"
_FILE_VERSION = b"brain.Event:2"
_SESSION_START = 1  # SessionLog.START: TensorBoard drops the points a restarted run is about to write again
_GCS_FLUSH_INTERVAL_S = 300.0  # on gs:// a crash between explicit flushes loses at most this much of the log
_VAL_LOSS_KEY = re.compile(r"^val/(?P<name>.+)/loss$")
_WIRE_VARINT, _WIRE_FIXED64, _WIRE_FIXED32 = 0, 1, 5


class StepRate:
    """Tokens per second of completed training steps, smoothed over the last `window` of them.

    A step's time is the device's: from when it could start (dispatched, and the step before it done) to when its
    results were read, which is when it finished, since they are read while the next step runs. Compiling,
    validation and checkpoints between steps are not counted; the time between two dispatches would count them,
    and would read the host's speed rather than the device's while the device's queue fills.
    """

    def __init__(self, tokens_per_step: int, window: int = 10, clock=time.perf_counter):
        self.tokens_per_step, self.window, self.clock = tokens_per_step, window, clock
        self._times: list[float] = []
        self._last_done = float("-inf")

    def dispatched(self) -> float:
        """Now, just after a step was dispatched (compiled and queued): what `completed` takes for it."""
        return self.clock()

    def completed(self, dispatched_at: float) -> float:
        """A step dispatched at `dispatched_at` has just had its results read: tokens/s over the window."""
        now = self.clock()
        self._times = [*self._times[-(self.window - 1):], max(now - max(self._last_done, dispatched_at), 1e-9)]
        self._last_done = now
        return self.tokens_per_step * len(self._times) / sum(self._times)


class MetricsError(ValueError):
    """Metrics a user asked for that are missing or empty."""


# ---- TensorBoard Event protos ----

def _double_field(field: int, value: float) -> bytes:
    return varint(field << 3 | _WIRE_FIXED64) + struct.pack("<d", value)


def _float_field(field: int, value: float) -> bytes:
    return varint(field << 3 | _WIRE_FIXED32) + struct.pack("<f", value)


def _varint_field(field: int, value: int) -> bytes:
    return varint(field << 3 | _WIRE_VARINT) + varint(value)


def file_version_event(wall_time: float) -> bytes:
    """The Event every event file starts with; TensorBoard reads its version string to pick a parser."""
    return _double_field(1, wall_time) + len_field(3, _FILE_VERSION)


def session_start_event(wall_time: float, step: int) -> bytes:
    """An Event marking a (re)start at `step`, so TensorBoard discards older points at steps >= `step`."""
    return _double_field(1, wall_time) + _varint_field(2, step) + len_field(7, _varint_field(1, _SESSION_START))


def scalars_event(wall_time: float, step: int, scalars: Mapping[str, float]) -> bytes:
    """An Event holding one Summary with a simple_value per scalar."""
    values = b"".join(len_field(1, len_field(1, tag.encode()) + _float_field(2, value))
                      for tag, value in scalars.items())
    return _double_field(1, wall_time) + _varint_field(2, step) + len_field(5, values)


def _new_events_path(directory: str) -> str:
    """A fresh event file name; a suffix keeps two writers started within one second from sharing a file."""
    base = storage.join(directory, f"events.out.tfevents.{int(time.time())}.{socket.gethostname()}")
    path, n = base, 0
    while storage.exists(path):
        n += 1
        path = f"{base}.{n}"
    return path


# ---- the writer ----

class MetricsWriter:
    """Writes scalar metrics to metrics.jsonl, TensorBoard and (optionally) W&B; with enabled=False it does nothing.

    Construct it on every process with `enabled=(jax.process_index() == 0)` so only one process writes.
    """

    def __init__(self, model_dir: str, *, enabled: bool = True, wandb_project: str | None = None,
                 run_name: str = "", config: dict | None = None) -> None:
        self.enabled = enabled
        self.model_dir = model_dir
        self._wandb_project = wandb_project
        self._run_name = run_name
        self._config = dict(config or {})
        self._wandb_run: Any = None
        self._wandb_tried = False
        self._session_started = False
        self._closed = False
        if not enabled:
            return
        self.jsonl_path = storage.join(model_dir, METRICS_FILE)
        self.events_path = _new_events_path(storage.join(model_dir, TENSORBOARD_DIR))
        header = frame_record(file_version_event(time.time()))
        self._gcs = storage.is_gcs(model_dir)
        if self._gcs:
            # A resumed run appends: start the buffer from what the previous run left.
            previous = storage.read_bytes(self.jsonl_path) if storage.exists(self.jsonl_path) else b""
            self._jsonl_buffer = bytearray(_with_line_end(previous))
            self._events_buffer = bytearray(header)
            self._last_flush_s = time.monotonic()
            self.flush()  # the event file and its header exist from the start, as they do locally
        else:
            self._jsonl_file = storage.open_file(self.jsonl_path, "ab")
            if self._jsonl_file.tell() and not _ends_with_newline(self.jsonl_path):
                self._jsonl_file.write(b"\n")  # a crash mid-line must not glue the next line onto the broken one
            self._events_file = storage.open_file(self.events_path, "wb")
            self._events_file.write(header)
            self._events_file.flush()

    def write(self, step: int, scalars: Mapping[str, float]) -> None:
        """Record one step's scalars everywhere; values may be Python, numpy or jax scalars."""
        if not self.enabled:
            return
        if self._closed:
            raise RuntimeError(f"MetricsWriter for {self.model_dir} is closed")
        clash = {"step", "time"} & set(scalars)
        if clash:
            raise ValueError(f"metric names {sorted(clash)} are reserved for the row's own step and time")
        step = int(step)
        values = {key: float(value) for key, value in scalars.items()}
        now = time.time()
        line = (json.dumps({"step": step, "time": now, **values}) + "\n").encode()
        events = b""
        if not self._session_started:
            events += frame_record(session_start_event(now, step))
            self._session_started = True
        events += frame_record(scalars_event(now, step, values))
        if self._gcs:
            self._jsonl_buffer += line
            self._events_buffer += events
            if time.monotonic() - self._last_flush_s > _GCS_FLUSH_INTERVAL_S:
                self.flush()
        else:
            # Flushed per line so a crash loses nothing and `tail -f` shows progress.
            self._jsonl_file.write(line)
            self._jsonl_file.flush()
            self._events_file.write(events)
            self._events_file.flush()
        self._log_wandb(step, values)

    def flush(self) -> None:
        """Make everything written so far durable (on gs://, rewrite both objects)."""
        if not self.enabled or self._closed:
            return
        if self._gcs:
            storage.write_bytes_atomic(self.jsonl_path, bytes(self._jsonl_buffer))
            storage.write_bytes_atomic(self.events_path, bytes(self._events_buffer))
            self._last_flush_s = time.monotonic()
        else:
            self._jsonl_file.flush()
            self._events_file.flush()

    def close(self) -> None:
        """Flush and release the files and the W&B run; calling it again is harmless."""
        if not self.enabled or self._closed:
            return
        self.flush()
        self._closed = True
        if not self._gcs:
            self._jsonl_file.close()
            self._events_file.close()
        if self._wandb_run is not None:
            self._wandb_run.finish()
            self._wandb_run = None

    def __enter__(self) -> MetricsWriter:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _log_wandb(self, step: int, values: dict[str, float]) -> None:
        run = self._wandb()
        if run is None:
            return
        try:
            run.log(values, step=step)
        except Exception as e:  # a W&B outage must not stop a training run
            log.warning("W&B logging failed (%s); going on without W&B", e)
            self._wandb_run = None

    def _wandb(self) -> Any:
        """The W&B run, started on first use; None when no project is set or W&B is unavailable."""
        if self._wandb_project is None or self._wandb_tried:
            return self._wandb_run
        self._wandb_tried = True
        try:
            import wandb
        except ImportError:
            log.warning("wandb_project=%r is set but wandb is not installed; metrics go to JSONL and TensorBoard only",
                        self._wandb_project)
            return None
        try:
            self._wandb_run = wandb.init(project=self._wandb_project, name=self._run_name or None,
                                         config=self._config)
        except Exception as e:  # a missing login or no network must not stop a training run
            log.warning("wandb.init failed (%s); going on without W&B", e)
        return self._wandb_run


def _with_line_end(data: bytes) -> bytes:
    return data + b"\n" if data and not data.endswith(b"\n") else data


def _ends_with_newline(path: str) -> bool:
    with storage.open_file(path, "rb") as f:
        f.seek(-1, io.SEEK_END)
        return f.read(1) == b"\n"


# ---- reading back and plotting ----

def read_metrics(model_dir: str) -> list[dict[str, Any]]:
    """Every step's metrics from metrics.jsonl, sorted by step, one dict per step.

    Rows of the same step are merged; where a resumed run wrote a step again, the last value of each key wins.
    Returns [] when there is no metrics file.
    """
    path = storage.join(model_dir, METRICS_FILE)
    if not storage.exists(path):
        return []
    by_step: dict[int, dict[str, Any]] = {}
    for number, line in enumerate(storage.read_bytes(path).decode(errors="replace").splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            step = int(row["step"])
        except (ValueError, TypeError, KeyError):
            log.warning("%s:%d: skipping a malformed line (an interrupted write?)", path, number)
            continue
        by_step.setdefault(step, {}).update(row, step=step)
    return [by_step[step] for step in sorted(by_step)]


def loss_series(rows: list[dict[str, Any]]) -> dict[str, tuple[list[int], list[float]]]:
    """Label -> (steps, losses) for train loss (`loss`) and each validation set (`val/{name}/loss`)."""
    series: dict[str, tuple[list[int], list[float]]] = {}
    for row in rows:
        for key, value in row.items():
            if key == "loss":
                label = "train"
            elif match := _VAL_LOSS_KEY.match(key):
                label = f"val {match['name']}"
            else:
                continue
            steps, losses = series.setdefault(label, ([], []))
            steps.append(row["step"])
            losses.append(float(value))
    return series


def plot_loss(model_dir: str, out_png: str | None = None) -> str:
    """Draw train loss and every validation loss against step into a PNG; returns the PNG's path."""
    jsonl_path = storage.join(model_dir, METRICS_FILE)
    rows = read_metrics(model_dir)
    if not rows:
        raise MetricsError(f"no metrics to plot: {jsonl_path} is missing or empty")
    series = loss_series(rows)
    if not series:
        raise MetricsError(f"no loss metrics ('loss' or 'val/NAME/loss') in {jsonl_path}")
    # Figure without pyplot renders PNG through Agg and leaves the process's global backend alone.
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    figure = Figure(figsize=(8, 5), dpi=100)
    axes = figure.add_subplot()
    for label, (steps, losses) in series.items():
        # Validation points are sparse, so markers keep a short series visible.
        axes.plot(steps, losses, label=label, marker=None if label == "train" else "o", markersize=3)
    run_name = model_dir.rstrip("/").rsplit("/", 1)[-1] or model_dir
    axes.set_title(f"Loss: {run_name}")
    axes.set_xlabel("step")
    axes.xaxis.set_major_locator(MaxNLocator(integer=True))
    axes.set_ylabel("loss")
    axes.grid(alpha=0.3)
    axes.legend()
    figure.tight_layout()
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png")
    out_png = out_png or storage.join(model_dir, PLOT_FILE)
    storage.write_bytes_atomic(out_png, buffer.getvalue())
    log.info("wrote %s", out_png)
    return out_png
