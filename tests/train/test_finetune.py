"""Fine-tuning runs: --tune-model-path in any format, LoRA runs end to end (resume, base identity, SIGKILL)."""
import dataclasses
import os

import jax
import numpy as np
import pytest
import torch
from transformers import GPTJConfig, GPTJForCausalLM

from mesh_transformer import config
from mesh_transformer.model import lora, table
from mesh_transformer.config import ConfigError
from mesh_transformer.store import checkpoint, checkpoint_format, hf, tfrecord
from mesh_transformer.train.trainer import Trainer
from tests.helpers import MTJ_CFG, TINY_NEOX_SHAPE, TINY_SHAPE, make_checkpoint, random_hf_dir
from tests.helpers import run_driver, save_config, train_losses, wait_for

SEQ = 16


def write_corpus(directory, n_records=64):
    """Counting sequences from random starts: a corpus a tiny model (and its adapters) can learn in a few steps."""
    rng = np.random.default_rng(0)
    path = os.path.join(directory, "count.tfrecords")
    tfrecord.write_records(path, [tfrecord.encode_example({"text": (rng.integers(0, 128) + np.arange(SEQ + 1)) % 128})
                                  for _ in range(n_records)])
    index = os.path.join(directory, "count.index")
    with open(index, "w") as f:
        f.write("count.tfrecords\n")
    return index


def run_config(tmp_path, shape, **overrides):
    raw = {**shape, "seq": SEQ, "cores_per_replica": 4, "per_replica_batch": 2, "gradient_accumulation_steps": 2,
           "warmup_steps": 0, "anneal_steps": 20, "lr": 2e-2, "end_lr": 2e-3, "total_steps": 6, "ckpt_every": 3,
           "val_every": 1000, "keep_every": 1000, "remat": False, "model_dir": str(tmp_path / "run"),
           "train_set": write_corpus(str(tmp_path))}
    return config.from_dict({**raw, **overrides})


def hf_loss(model, tokens_GxBxT1):
    """HF's mean next-token loss, averaged over micro-batches as our step does."""
    with torch.no_grad():
        ids = [torch.tensor(t.astype(np.int64)) for t in tokens_GxBxT1]
        return np.mean([float(model(t, labels=t).loss) for t in ids])


def first_step_loss(trainer):
    tokens = next(trainer.batches())
    _, metrics = trainer.train_step(trainer.state, tokens)
    return float(metrics["loss"]), np.asarray(jax.device_get(tokens))


@pytest.mark.parametrize("shape", [TINY_SHAPE, TINY_NEOX_SHAPE], ids=["gptj", "gptneox"])
def test_fine_tune_from_an_hf_dir_starts_at_hf_loss(tmp_path, shape):
    cfg = run_config(tmp_path, shape)
    path, model = random_hf_dir(tmp_path, cfg)
    trainer = Trainer(cfg, tune_model_path=path)
    assert trainer.step == 0 and int(trainer.state["opt_state"][1].count) == 0
    loss, tokens = first_step_loss(trainer)
    np.testing.assert_allclose(loss, hf_loss(model.float(), tokens), rtol=1e-4)


def test_fine_tune_from_an_original_layout_checkpoint_starts_at_hf_loss(tmp_path):
    step_dir, expected = make_checkpoint(tmp_path, 2, np.float32, full=False)
    shape = {k: getattr(MTJ_CFG, k) for k in TINY_SHAPE}
    cfg = run_config(tmp_path, shape)
    hf_model = GPTJForCausalLM(GPTJConfig(**{**hf.hf_config(cfg), "n_positions": SEQ + 1})).eval()
    hf_model.load_state_dict({k: torch.from_numpy(v.copy()) for k, v in hf.params_to_hf(expected, cfg).items()},
                             strict=False)
    loss, tokens = first_step_loss(Trainer(cfg, tune_model_path=step_dir))
    np.testing.assert_allclose(loss, hf_loss(hf_model, tokens), rtol=1e-4)


def lora_config(tmp_path, **overrides):
    return run_config(tmp_path, TINY_SHAPE, lora_rank=4, lora_alpha=8, **overrides)


@pytest.mark.parametrize("base_dtype", ["bfloat16", "int8"])
def test_lora_run_trains_the_adapters_only_and_lowers_the_loss(tmp_path, base_dtype):
    """An int8 base (QLoRA's memory) is read quantized layer by layer: its matrices int8 with a scale per output
    column, the rest bf16."""
    cfg = lora_config(tmp_path, total_steps=12, ckpt_every=12, base_dtype=base_dtype, lr=5e-2, end_lr=5e-2)
    path, model = random_hf_dir(tmp_path, cfg)
    trainer = Trainer(cfg, tune_model_path=path)
    before = jax.device_get(trainer.frozen)
    trainer.run()
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(trainer.frozen), before)
    assert trainer.frozen["layers"]["attn"]["q"].dtype == base_dtype
    if base_dtype == "int8":
        assert trainer.frozen["layers"]["ln_1"]["scale"].dtype == "bfloat16"
        q_w = model.transformer.h[1].attn.q_proj.weight.detach().numpy().T  # [D, D] of layer 1
        want_q, want_scale = lora.quantize_matrix(q_w)
        np.testing.assert_array_equal(before["layers"]["attn"]["q"][1], want_q)
        np.testing.assert_array_equal(before["layers"][lora.SCALES]["q"][1], want_scale)
    losses = train_losses(cfg.model_dir)
    assert losses[12] < losses[1] - 0.1, losses
    leaves, metadata = checkpoint_format.read_index(cfg.model_dir, 12)
    assert metadata["lora_base"]["path"] == os.path.abspath(path)
    params = {leaf for leaf in leaves if leaf.startswith("params/")}
    assert params == {f"params/{t}/{w}" for t in table.lora_targets(cfg) for w in "ab"}  # the adapters, no base


def test_lora_resume_needs_no_path_and_refuses_another_base(tmp_path):
    cfg = lora_config(tmp_path, total_steps=3)
    path, _ = random_hf_dir(tmp_path, cfg)
    Trainer(cfg, tune_model_path=path).run()
    resumed = Trainer(dataclasses.replace(cfg, total_steps=6))  # the base from the checkpoint's metadata
    assert resumed.step == 3 and resumed.base_identity["path"] == os.path.abspath(path)
    other, _ = random_hf_dir(tmp_path, cfg, "other", seed=1)
    with pytest.raises(ConfigError, match="differs from the one this run was trained on.*other weights"):
        Trainer(cfg, tune_model_path=other)
    with pytest.raises(ConfigError, match="needs a base model"):
        Trainer(lora_config(tmp_path, model_dir=str(tmp_path / "fresh")))


def test_lora_sigkill_resume_is_bit_identical(tmp_path):
    straight = lora_config(tmp_path, total_steps=9, model_dir=str(tmp_path / "straight"))
    path, _ = random_hf_dir(tmp_path, straight)
    Trainer(straight, tune_model_path=path).run()
    cfg = dataclasses.replace(straight, model_dir=str(tmp_path / "killed"))
    marker = tmp_path / "stalled"
    proc = run_driver(["--config", save_config(tmp_path, cfg), "--tune-model-path", path],
                      {"STALL_CHECKPOINT_STEP": "6", "STALL_MARKER": str(marker)})
    wait_for(marker.exists, proc)
    proc.kill()
    proc.wait()
    assert checkpoint.latest_step(cfg.model_dir) == 3
    resumed = Trainer(cfg)
    assert resumed.step == 3 and resumed.run() == 9
    assert train_losses(cfg.model_dir) == train_losses(straight.model_dir)
    a, b = (checkpoint.restore(c.model_dir, 9, resumed.state)[0] for c in (cfg, straight))
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(a), jax.device_get(b))
