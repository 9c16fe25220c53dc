"""Tests for metrics.py: JSONL log, TensorBoard event files, W&B as an optional extra, the loss plot and its CLI."""
from __future__ import annotations

import glob
import json
import logging
import os
import struct
import sys
import types

import google_crc32c
import pytest

from mesh_transformer.train import metrics
from mesh_transformer import storage
from mesh_transformer.train.metrics import MetricsError, MetricsWriter, plot_loss, read_metrics
from tests.gcs_emulator import create_bucket, gcs_emulator
from tests.helpers import run_script

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


# ---- an independent event-file decoder, so the test does not trust the writer's own helpers ----

def _masked_crc(data: bytes) -> int:
    crc = google_crc32c.value(data)
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def _records(path: str) -> list[bytes]:
    """Every record's data; asserts both CRCs of each record."""
    with open(path, "rb") as f:
        blob = f.read()
    out, pos = [], 0
    while pos < len(blob):
        (length,) = struct.unpack_from("<Q", blob, pos)
        (length_crc,) = struct.unpack_from("<I", blob, pos + 8)
        assert length_crc == _masked_crc(blob[pos:pos + 8])
        data = blob[pos + 12:pos + 12 + length]
        (data_crc,) = struct.unpack_from("<I", blob, pos + 12 + length)
        assert data_crc == _masked_crc(data)
        out.append(data)
        pos += 12 + length + 4
    return out


def varint(buf: bytes, pos: int) -> tuple[int, int]:
    value, shift = 0, 0
    while True:
        byte = buf[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, pos
        shift += 7


def _proto(buf: bytes) -> dict[int, list]:
    """Field number -> list of raw values (ints for varints, bytes otherwise)."""
    fields: dict[int, list] = {}
    pos = 0
    while pos < len(buf):
        key, pos = varint(buf, pos)
        wire = key & 7
        if wire == 0:
            value, pos = varint(buf, pos)
        else:
            size = {1: 8, 5: 4}.get(wire)
            if size is None:
                size, pos = varint(buf, pos)
            value, pos = buf[pos:pos + size], pos + size
        fields.setdefault(key >> 3, []).append(value)
    return fields


def _decode_events(path: str) -> list[dict]:
    events = []
    for data in _records(path):
        e = _proto(data)
        event = {"wall_time": struct.unpack("<d", e[1][0])[0], "step": e.get(2, [0])[0]}
        if 3 in e:
            event["file_version"] = e[3][0].decode()
        if 7 in e:
            event["session_status"] = _proto(e[7][0])[1][0]
        if 5 in e:
            values = [_proto(v) for v in _proto(e[5][0])[1]]
            event["scalars"] = {v[1][0].decode(): struct.unpack("<f", v[2][0])[0] for v in values}
        events.append(event)
    return events


def _event_file(model_dir: str) -> str:
    (path,) = glob.glob(os.path.join(model_dir, "tensorboard", "events.out.tfevents.*"))
    return path


# ---- JSONL ----

def test_write_appends_one_json_line_per_call_and_reads_back(tmp_path):
    with MetricsWriter(str(tmp_path)) as writer:
        writer.write(1, {"loss": 2.5, "lr": 1e-4})
        writer.write(2, {"loss": 2.0, "lr": 2e-4})
        lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
        assert len(lines) == 2  # visible before close: flushed per line
    assert json.loads(lines[0])["loss"] == 2.5 and json.loads(lines[0])["time"] > 0
    rows = read_metrics(str(tmp_path))
    assert [(r["step"], r["loss"], r["lr"]) for r in rows] == [(1, 2.5, 1e-4), (2, 2.0, 2e-4)]


def test_resumed_run_appends_and_last_value_per_step_and_key_wins(tmp_path):
    with MetricsWriter(str(tmp_path)) as writer:
        for step in (1, 2, 3):
            writer.write(step, {"loss": 10.0 + step})
        writer.write(3, {"val/owt/loss": 9.0})
    with MetricsWriter(str(tmp_path)) as writer:  # restored from the step-2 checkpoint
        writer.write(3, {"loss": 5.0})
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 5
    rows = read_metrics(str(tmp_path))
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert rows[2]["loss"] == 5.0 and rows[2]["val/owt/loss"] == 9.0


def test_line_cut_by_a_crash_is_skipped_and_the_next_run_starts_a_fresh_line(tmp_path, caplog):
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "loss": 3.0}\n{"step": 2, "lo')
    with MetricsWriter(str(tmp_path)) as writer:
        writer.write(2, {"loss": 2.0})
    with caplog.at_level(logging.WARNING):
        rows = read_metrics(str(tmp_path))
    assert [(r["step"], r["loss"]) for r in rows] == [(1, 3.0), (2, 2.0)]
    assert "malformed" in caplog.text


def test_reserved_metric_names_are_rejected(tmp_path):
    with MetricsWriter(str(tmp_path)) as writer, pytest.raises(ValueError, match="reserved"):
        writer.write(1, {"step": 1.0})


def test_disabled_writer_writes_nothing(tmp_path):
    writer = MetricsWriter(str(tmp_path / "run"), enabled=False, wandb_project="p")
    writer.write(1, {"loss": 1.0})
    writer.flush()
    writer.close()
    assert not (tmp_path / "run").exists()
    assert read_metrics(str(tmp_path / "run")) == []


def test_gcs_run_is_buffered_until_flush_and_a_resumed_run_appends(tmp_path):
    with gcs_emulator() as url:
        create_bucket(url, "bucket")
        run = "gs://bucket/run"
        with MetricsWriter(run) as writer:
            writer.write(1, {"loss": 3.0})
            assert read_metrics(run) == []  # buffered: GCS objects are rewritten whole, not appended to
            writer.flush()
            assert [r["loss"] for r in read_metrics(run)] == [3.0]
            writer.write(2, {"loss": 2.0})
        with MetricsWriter(run) as writer:
            writer.write(2, {"loss": 1.5})
        assert [(r["step"], r["loss"]) for r in read_metrics(run)] == [(1, 3.0), (2, 1.5)]
        events = sorted(storage.walk_files(f"{run}/tensorboard"))
        assert len(events) == 2
        local = tmp_path / "events"
        local.write_bytes(storage.read_bytes(events[0]))
        assert [e.get("scalars") for e in _decode_events(str(local))][2:] == [{"loss": 3.0}, {"loss": 2.0}]
        assert plot_loss(run) == f"{run}/loss.png"
        assert storage.read_bytes(f"{run}/loss.png").startswith(PNG_MAGIC)


# ---- TensorBoard ----

def test_event_file_has_valid_crcs_and_decodes_to_the_scalars(tmp_path):
    with MetricsWriter(str(tmp_path)) as writer:
        writer.write(7, {"loss": 2.25, "grad_norm": 0.5})
        writer.write(8, {"val/owt/loss": 3.1})
    path = _event_file(str(tmp_path))
    assert os.path.basename(path).startswith("events.out.tfevents.")
    events = _decode_events(path)
    assert events[0]["file_version"] == "brain.Event:2"
    assert events[1]["session_status"] == 1 and events[1]["step"] == 7  # SessionLog.START at the first step
    assert events[2]["step"] == 7 and events[2]["scalars"] == {"loss": 2.25, "grad_norm": 0.5}
    assert events[3]["step"] == 8 and events[3]["scalars"]["val/owt/loss"] == pytest.approx(3.1, rel=1e-6)
    assert all(e["wall_time"] > 1e9 for e in events)


def test_tensorboard_reads_the_events_and_drops_steps_a_resumed_run_rewrites(tmp_path):
    from tensorboard.backend.event_processing import event_accumulator
    with MetricsWriter(str(tmp_path)) as writer:
        for step in (1, 2, 3):
            writer.write(step, {"loss": 10.0 + step})
    with MetricsWriter(str(tmp_path)) as writer:  # a second file in the same second gets a suffix, not a clash
        writer.write(2, {"loss": 5.0})
    assert len(glob.glob(str(tmp_path / "tensorboard" / "events.out.tfevents.*"))) == 2
    accumulator = event_accumulator.EventAccumulator(str(tmp_path / "tensorboard"))
    accumulator.Reload()
    assert [(s.step, s.value) for s in accumulator.Scalars("loss")] == [(1, 11.0), (2, 5.0)]


# ---- W&B ----

def test_missing_wandb_warns_once_and_goes_on(tmp_path, monkeypatch, caplog):
    monkeypatch.setitem(sys.modules, "wandb", None)  # makes `import wandb` raise ImportError
    with caplog.at_level(logging.WARNING), MetricsWriter(str(tmp_path), wandb_project="proj") as writer:
        writer.write(1, {"loss": 1.0})
        writer.write(2, {"loss": 0.5})
    assert caplog.text.count("wandb is not installed") == 1
    assert len(read_metrics(str(tmp_path))) == 2


def test_wandb_is_started_lazily_and_logs_every_write(tmp_path, monkeypatch):
    calls: list = []

    class FakeRun:
        def log(self, values, step):
            calls.append(("log", step, values))

        def finish(self):
            calls.append(("finish",))

    fake = types.SimpleNamespace(init=lambda **kwargs: calls.append(("init", kwargs)) or FakeRun())
    monkeypatch.setitem(sys.modules, "wandb", fake)
    writer = MetricsWriter(str(tmp_path), wandb_project="proj", run_name="gptj", config={"lr": 1e-4})
    assert calls == []
    writer.write(1, {"loss": 1.0})
    writer.close()
    assert calls == [("init", {"project": "proj", "name": "gptj", "config": {"lr": 1e-4}}),
                     ("log", 1, {"loss": 1.0}), ("finish",)]


# ---- plot and CLI ----

def _write_run(model_dir: str) -> None:
    with MetricsWriter(model_dir) as writer:
        for step in range(1, 21):
            writer.write(step, {"loss": 5.0 / step, "lr": 1e-4, "tokens_per_s": 1000.0})
            if step % 5 == 0:
                writer.write(step, {"val/owt/loss": 6.0 / step, "val/owt/ppl": 2.0, "val/pile/loss": 7.0 / step})


def test_plot_loss_writes_a_png_with_train_and_every_validation_series(tmp_path):
    _write_run(str(tmp_path))
    series = metrics.loss_series(read_metrics(str(tmp_path)))
    assert sorted(series) == ["train", "val owt", "val pile"]
    assert series["val owt"][0] == [5, 10, 15, 20]
    path = plot_loss(str(tmp_path))
    assert path == str(tmp_path / "loss.png")
    data = (tmp_path / "loss.png").read_bytes()
    assert data.startswith(PNG_MAGIC) and len(data) > 1000


def test_plot_loss_on_a_run_without_metrics_raises_a_metrics_error(tmp_path):
    with pytest.raises(MetricsError, match="missing or empty"):
        plot_loss(str(tmp_path))


def test_cli_prints_the_png_path(tmp_path):
    _write_run(str(tmp_path))
    out = str(tmp_path / "sub" / "plot.png")
    result = run_script("plot_metrics.py", str(tmp_path), "--out", out)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip() == out
    assert open(out, "rb").read(8) == PNG_MAGIC


def test_cli_on_an_empty_dir_prints_one_error_line_and_exits_2(tmp_path):
    result = run_script("plot_metrics.py", str(tmp_path))
    assert result.returncode == 2
    assert result.stderr.startswith("error: ") and len(result.stderr.strip().splitlines()) == 1
    assert "Traceback" not in result.stderr and result.stdout == ""


def test_tokens_per_s_counts_the_device_time_of_completed_steps_not_the_gaps_between_dispatches():
    from mesh_transformer.train.metrics import StepRate

    # The trainer's loop against a fake device whose every step takes 0.5 s: dispatching step s returns at once
    # (step 1 after a 3 s compile), then step s - 1's results are read (waiting for the device); at step 6 the
    # step's own results are read and a 5 s validation runs before step 7 is dispatched.
    clock = {"now": 0.0, "device_free": 0.0}
    rate = StepRate(tokens_per_step=1000, window=4, clock=lambda: clock["now"])
    dispatched, done, rates = {}, {}, []

    def dispatch(step, host_s):
        clock["now"] += host_s
        dispatched[step] = rate.dispatched()
        done[step] = clock["device_free"] = max(clock["device_free"], clock["now"]) + 0.5

    def read(step):
        clock["now"] = max(clock["now"], done[step])
        rates.append(rate.completed(dispatched[step]))

    for step in range(1, 11):
        dispatch(step, 3.0 if step == 1 else 0.01)
        if step - 1 in dispatched and step != 7:
            read(step - 1)
        if step == 6:
            read(6)
            clock["now"] += 5.0
    read(10)
    assert len(rates) == 10 and rates == pytest.approx([2000] * 10, rel=1e-6)  # 1000 tokens per 0.5 s
    # What the time between two dispatches read: the compile, the validation, and the host's own speed.
    gaps = [dispatched[s] - dispatched[s - 1] for s in range(2, 11)]
    assert min(gaps) < 0.05 and max(gaps) > 5
