"""Every script end to end on the chip, each in a child process as a user runs it: train, resume, sample (bf16 and
int8), export to HF, and LoRA fine-tuning from an original mesh-transformer-jax checkpoint.

The scripts open the chip themselves, so this process must not hold it while they run: these tests run before the
tier's in-process ones (tests/device/conftest.py), and check what the scripts wrote through the host-side readers,
which start no JAX backend.
"""
import math
import os
import shutil
import subprocess

import numpy as np
import pytest
from jax._src import xla_bridge  # backends_are_initialized: JAX has no public way to ask without starting them

from mesh_transformer import config, platforms
from mesh_transformer.model import table
from mesh_transformer.store import checkpoint, checkpoint_format, convert
from mesh_transformer.tokenizer import load_tokenizer
from mesh_transformer.train.metrics import read_metrics
from tests.helpers import (MTJ_CFG, TINY_SHAPE, make_config, original_shards, random_params, run_script, save_config,
                           train_losses, write_mtj_v1)

PLATFORM = platforms.expected_platform()  # "tpu" or "gpu" (or "cpu" through the tier's escape hatch)
GPT2_VOCAB = 50304  # GPT-2's vocabulary padded: the sampling script's text prompts tokenize into it


def run_on_chip(script: str, *args: str) -> subprocess.CompletedProcess:
    """A top-level script run as a user runs it, in a child process that opens the chip; it must succeed and say
    that it ran on the accelerator."""
    assert not xla_bridge.backends_are_initialized(), (
        "this process has started JAX, and so holds the chip: the script tests must run before any in-process one")
    result = run_script(script, *args)
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def assert_on_the_accelerator(result: subprocess.CompletedProcess) -> None:
    """The script's log names its mesh's devices ("train mesh: ... over 1 tpu devices", "inference mesh: ...")."""
    assert f" {PLATFORM} devices" in result.stderr, result.stderr[-3000:]


def assert_same_params(path_a: str, path_b: str, cfg: config.Config) -> None:
    """Two checkpoints of any formats hold the same params, read one at a time on the host."""
    with convert.open_params(path_a, cfg) as a, convert.open_params(path_b, cfg) as b:
        for path, _ in table.param_paths(cfg):
            np.testing.assert_array_equal(a.read(path), b.read(path), err_msg="/".join(path))


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> config.Config:
    """The config of a 4-step device_train.py run on the chip (checkpoints at steps 2 and 4), the run done. One
    sequence per device and micro-batch, so the 8 validation records fill a batch on the escape hatch's 8 CPUs too."""
    root = tmp_path_factory.mktemp("train")
    cfg = make_config(root, n_vocab=GPT2_VOCAB, cores_per_replica=1, per_replica_batch=1, total_steps=4, ckpt_every=2,
                      val_every=2)
    result = run_on_chip("device_train.py", "--config", save_config(root, cfg))
    assert "stopped at step 4" in result.stdout
    assert_on_the_accelerator(result)
    return cfg


def test_device_train_trains_validates_and_checkpoints_on_the_chip(trained):
    assert checkpoint.list_steps(trained.model_dir) == [2, 4]
    losses = train_losses(trained.model_dir)
    assert sorted(losses) == [1, 2, 3, 4] and all(math.isfinite(loss) for loss in losses.values()), losses
    assert [row["step"] for row in read_metrics(trained.model_dir) if "val/held/loss" in row] == [2, 4]


def test_device_train_resumes_from_its_last_checkpoint(trained, tmp_path):
    model_dir = str(tmp_path / "run")
    shutil.copytree(trained.model_dir, model_dir)
    result = run_on_chip("device_train.py", "--config", save_config(tmp_path, trained), "--set",
                         f"model_dir={model_dir}", "--set", "total_steps=6")
    assert "at step 4" in result.stderr and "stopped at step 6" in result.stdout
    assert_on_the_accelerator(result)
    assert [row["step"] for row in read_metrics(model_dir) if "loss" in row] == [1, 2, 3, 4, 5, 6]  # none again
    assert checkpoint.latest_step(model_dir) == 6


@pytest.mark.parametrize("dtype", ["bf16", "int8"])
def test_device_sample_completes_a_prompt_on_the_chip(trained, dtype):
    result = run_on_chip("device_sample.py", "--ckpt", trained.model_dir, "--prompt", "Hello world",
                         "--max-new-tokens", "8", "--temperature", "0", "--dtype", dtype)
    assert_on_the_accelerator(result)
    assert result.stdout.endswith("\n") and len(result.stdout) > 1, result.stdout


def test_to_hf_weights_exports_a_directory_that_loads_with_the_checkpoints_params(trained, tmp_path):
    from transformers import GPTJConfig

    out = str(tmp_path / "hf")
    run_on_chip("to_hf_weights.py", "--input-ckpt", trained.model_dir, "--output-path", out, "--dtype", "fp32")
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(os.listdir(out))
    hf_config = GPTJConfig.from_pretrained(out)
    assert (hf_config.n_layer, hf_config.n_embd, hf_config.vocab_size) == (trained.layers, trained.d_model,
                                                                           trained.n_vocab)
    assert load_tokenizer(out).encode("Hello world") == [15496, 995]
    assert_same_params(trained.model_dir, out, trained)


def test_lora_fine_tune_from_an_original_checkpoint_on_the_chip_exports_merged(tmp_path):
    base = str(tmp_path / "original" / "step_10")
    write_mtj_v1(base, original_shards(random_params(MTJ_CFG, seed=0), MTJ_CFG, 2, np.random.default_rng(0)), 10,
                 full=False)
    shape = {key: getattr(MTJ_CFG, key) for key in TINY_SHAPE}
    cfg = make_config(tmp_path, **shape, cores_per_replica=1, per_replica_batch=1, lora_rank=4, lora_alpha=8,
                      total_steps=3, ckpt_every=3, val_every=3)
    result = run_on_chip("device_train.py", "--config", save_config(tmp_path, cfg), "--tune-model-path", base)
    assert "stopped at step 3" in result.stdout
    assert_on_the_accelerator(result)
    leaves, metadata = checkpoint_format.read_index(cfg.model_dir, 3)
    assert {leaf for leaf in leaves if leaf.startswith("params/")} == {
        f"params/{target}/{w}" for target in table.lora_targets(cfg) for w in "ab"}  # the adapters, no base
    assert metadata["lora_base"]["path"] == os.path.abspath(base)

    out = str(tmp_path / "hf")
    run_on_chip("to_hf_weights.py", "--input-ckpt", cfg.model_dir, "--output-path", out, "--dtype", "fp32")
    assert_same_params(cfg.model_dir, out, cfg)  # the run reads as its base with the adapters merged
    with convert.open_params(base, cfg) as original, convert.open_params(out, cfg) as merged:
        q = ("layers", "attn", "q")
        assert not np.allclose(original.read(q), merged.read(q))  # the trained adapters moved the weights
