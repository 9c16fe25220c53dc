import dataclasses
import os
import signal

import numpy as np
import pytest

from mesh_transformer.store import checkpoint, tfrecord
from mesh_transformer import config
from mesh_transformer.config import ConfigError
from mesh_transformer.parallel.mesh import make_dp_mp
from mesh_transformer.train.metrics import read_metrics
from mesh_transformer.train.trainer import Trainer, TrainingError
from mesh_transformer.parallel.layout import make_layout

from tests.gcs_emulator import create_bucket, gcs_emulator
from tests.helpers import make_config, run_driver, save_config, train_losses, wait_for


def test_resumed_run_is_bit_identical_to_an_uninterrupted_one(tmp_path):
    straight = make_config(tmp_path, model_dir=str(tmp_path / "straight"))
    Trainer(straight).run()
    split = make_config(tmp_path, model_dir=str(tmp_path / "split"), total_steps=3)
    Trainer(split).run()
    resumed = Trainer(dataclasses.replace(split, total_steps=6))
    assert resumed.step == 3
    resumed.run()
    assert train_losses(straight.model_dir) == train_losses(split.model_dir)
    assert len(train_losses(straight.model_dir)) == 6
    rows = read_metrics(straight.model_dir)
    assert any("val/held/loss" in r and "val/held/ppl" in r for r in rows)
    assert checkpoint.list_steps(straight.model_dir) == [3, 6]


def test_checkpoint_from_dp2_mp4_restores_on_other_meshes_with_equal_logits(tmp_path):
    cfg = make_config(tmp_path, total_steps=3, n_heads=8)
    Trainer(cfg).run()
    ids = np.random.default_rng(3).integers(0, 128, (8, cfg.seq))
    logits = []
    for dp, mp in [(2, 4), (8, 1), (1, 8)]:
        c = config.from_dict({**cfg.to_dict(), "cores_per_replica": mp})
        mesh = make_dp_mp(dp, mp)
        layout = make_layout(c, mesh=mesh)
        params, _ = checkpoint.restore(cfg.model_dir, 3, layout.abstract_params(), paths_prefix="params")
        logits.append(np.asarray(layout.logits_fn()(params, ids)))
    np.testing.assert_allclose(logits[1], logits[0], atol=1e-5)
    np.testing.assert_allclose(logits[2], logits[0], atol=1e-5)


def test_sigkill_during_checkpoint_write_resumes_from_last_complete_one(tmp_path):
    cfg = make_config(tmp_path, total_steps=9)
    marker = tmp_path / "stalled"
    proc = run_driver(["--config", save_config(tmp_path, cfg)],
                      {"STALL_CHECKPOINT_STEP": "6", "STALL_MARKER": str(marker)})
    wait_for(marker.exists, proc)
    proc.kill()
    proc.wait()
    step6 = os.path.join(cfg.model_dir, "step_6")
    assert os.path.isdir(step6) and not os.path.exists(os.path.join(step6, checkpoint.COMMIT_NAME))
    assert checkpoint.latest_step(cfg.model_dir) == 3
    resumed = Trainer(cfg)
    assert resumed.step == 3
    assert resumed.run() == 9
    assert checkpoint.list_steps(cfg.model_dir) == [3, 6, 9]


def test_sigterm_writes_a_checkpoint_and_exits_zero(tmp_path):
    cfg = make_config(tmp_path, total_steps=100_000, ckpt_every=100_000, val_every=100_000)
    proc = run_driver(["--config", save_config(tmp_path, cfg)])
    metrics = os.path.join(cfg.model_dir, "metrics.jsonl")
    wait_for(lambda: os.path.exists(metrics) and os.path.getsize(metrics) > 0, proc)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=240)
    assert proc.returncode == 0, err[-2000:]
    step = checkpoint.latest_step(cfg.model_dir)
    assert step is not None and step >= 1 and f"stopped at step {step}" in out


def test_non_finite_loss_stops_and_keeps_the_last_good_checkpoint(tmp_path):
    cfg = make_config(tmp_path, total_steps=9)
    trainer = Trainer(cfg)
    step_fn = trainer.train_step

    def poisoned(state, batch):
        state, metrics = step_fn(state, batch)
        if trainer.step >= 4:
            metrics = {**metrics, "loss": metrics["loss"] * np.nan}
        return state, metrics

    trainer.train_step = poisoned
    with pytest.raises(TrainingError, match="loss became nan at step 5.*step 3"):
        trainer.run()
    assert checkpoint.list_steps(cfg.model_dir) == [3]


def test_corrupt_checkpoint_falls_back_to_the_previous_one(tmp_path, caplog):
    cfg = make_config(tmp_path)
    Trainer(cfg).run()
    piece = next(p for p in checkpoint_files(cfg.model_dir, 6) if p.endswith(".npy"))
    data = bytearray(open(piece, "rb").read())
    data[-1] ^= 0xFF
    open(piece, "wb").write(bytes(data))
    assert Trainer(cfg).step == 3
    assert "is corrupt: sha256" in caplog.text and "falling back" in caplog.text


def checkpoint_files(root, step):
    for directory, _, files in os.walk(os.path.join(root, f"step_{step}")):
        yield from (os.path.join(directory, f) for f in files)


def test_bad_inputs_are_clear_errors(tmp_path):
    with pytest.raises(ConfigError, match="'train_set' is missing"):
        Trainer(make_config(tmp_path, train_set=None))
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    with pytest.raises(ConfigError, match="model_dir .* is not writable"):
        Trainer(make_config(tmp_path, model_dir=str(blocker / "run")))
    empty = tmp_path / "empty_0_1.tfrecords"
    empty.write_bytes(b"")
    (tmp_path / "empty.index").write_text(empty.name + "\n")
    with pytest.raises(tfrecord.DataError, match="empty"):
        Trainer(make_config(tmp_path, train_set=str(tmp_path / "empty.index"))).run()


def test_device_train_cli_reports_user_errors_on_one_line(tmp_path):
    cfg_path = save_config(tmp_path, make_config(tmp_path))
    proc = run_driver(["--config", cfg_path, "--set", "lrr=1"])
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 2
    assert err.strip().splitlines() == ["error: unknown config key 'lrr'; did you mean 'lr'?"]


def test_training_reads_and_writes_gcs(tmp_path):
    with gcs_emulator() as url:
        create_bucket(url, "bucket")
        local = make_config(tmp_path, total_steps=3)
        from mesh_transformer import storage

        for name in ("train_0_64.tfrecords", "train.index", "val_0_8.tfrecords", "val.index"):
            storage.write_bytes_atomic(f"gs://bucket/data/{name}", (tmp_path / name).read_bytes())
        cfg = dataclasses.replace(local, model_dir="gs://bucket/run", train_set="gs://bucket/data/train.index",
                                  val_set={"held": "gs://bucket/data/val.index"})
        Trainer(cfg).run()
        assert checkpoint.list_steps("gs://bucket/run") == [3]
        assert sorted(train_losses("gs://bucket/run")) == [1, 2, 3]
        assert Trainer(dataclasses.replace(cfg, total_steps=4)).step == 3


def test_parallelism_is_a_config_change_and_checkpoints_cross_modes(tmp_path):
    # fsdp 2 x tensor 4 splits the batch 2 ways, as shard_map dp 2 x mp 4 does: the same global batch
    fsdp_tp = make_config(tmp_path, total_steps=3, parallelism="fsdp_tp", mesh_fsdp=2, mesh_tensor=4)
    trainer = Trainer(fsdp_tp)
    assert dict(trainer.mesh.shape) == {"data": 1, "fsdp": 2, "tensor": 4}
    trainer.run()
    shard_map = dataclasses.replace(fsdp_tp, parallelism="shard_map", total_steps=4)
    resumed = Trainer(shard_map)  # the GSPMD checkpoint, restored on the ('dp', 'mp') layout
    assert resumed.step == 3 and resumed.run() == 4
    reference = make_config(tmp_path, total_steps=4, model_dir=str(tmp_path / "reference"))
    Trainer(reference).run()
    np.testing.assert_allclose([train_losses(shard_map.model_dir)[s] for s in range(1, 5)],
                               [train_losses(reference.model_dir)[s] for s in range(1, 5)], rtol=1e-5)
