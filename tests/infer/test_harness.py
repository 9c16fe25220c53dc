"""The lm-eval adapter against lm-eval's own `hf` model on the same weights exported to HF, on test-written tasks."""
import gc
import json

import jax
import numpy as np
import pytest
from lm_eval.api.registry import get_model

from mesh_transformer import config
from mesh_transformer.config import ConfigError
from mesh_transformer.infer import harness
from mesh_transformer.infer.params import make_inference_layout, read_params
from mesh_transformer.model import lora
from mesh_transformer.parallel.mesh import make_dp_mp
from mesh_transformer.store import tfrecord
from mesh_transformer.tokenizer import load_tokenizer
from mesh_transformer.train.metrics import read_metrics
from mesh_transformer.train.trainer import Trainer
from tests.helpers import EVAL_CFG, EVAL_CFG_DICT, EVAL_OPTIONS, TASKS, assert_same_eval, run_script


def native(hf_dir, dp, mp):
    layout = make_inference_layout(EVAL_CFG, mesh=make_dp_mp(dp, mp))
    return harness.MeshTransformerLM(layout, read_params(layout, hf_dir), load_tokenizer(), batch_size=4)


@pytest.mark.parametrize("dp, mp", [(1, 1), (2, 4)], ids=["one_device", "dp2-mp4"])
def test_adapter_matches_hf_model(eval_hf_dir, eval_tasks, hf_eval_results, dp, mp):
    lm = native(eval_hf_dir, dp, mp)
    assert_same_eval(harness.evaluate(lm, TASKS, manager=eval_tasks[1], **EVAL_OPTIONS), hf_eval_results)
    assert lm.scorer.traces <= 2  # one program per width bucket: 32 (questions) and 64 (perplexity windows)


def test_unknown_task_names_the_nearest(eval_tasks):
    with pytest.raises(ConfigError, match="unknown lm-eval task 'tiny_mcc'; nearest: tiny_mc"):
        harness.check_tasks(eval_tasks[1], ["tiny_mcc"])


def test_device_eval_writes_lm_evals_results_and_samples(eval_hf_dir, eval_tasks, hf_eval_results, tmp_path):
    out = tmp_path / "out"
    result = run_script("device_eval.py", "--ckpt", eval_hf_dir, "--tasks", "tiny_mc", "--include_path",
                        eval_tasks[0], "--batch_size", "4", "--output_path", str(out), "--log_samples")
    assert result.returncode == 0, result.stderr[-2000:]
    assert "tiny_mc" in result.stdout and "Running loglikelihood requests" in result.stderr  # table, progress bar
    (model_dir,) = out.iterdir()
    results_file = next(model_dir.glob("results_*.json"))
    assert json.loads(results_file.read_text())["results"]["tiny_mc"]["acc,none"] == \
        hf_eval_results["results"]["tiny_mc"]["acc,none"]
    samples = [json.loads(line) for line in next(model_dir.glob("samples_tiny_mc_*.jsonl")).read_text().splitlines()]
    assert len(samples) == len(hf_eval_results["samples"]["tiny_mc"])


def test_device_eval_bad_flags_are_one_line_errors():
    result = run_script("device_eval.py", "--ckpt", "nowhere", "--tasks", "x", "--log_samples")
    assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1
    assert "--log_samples needs --output_path" in result.stderr


def test_dataset_not_available_offline_is_one_line_config_error(eval_hf_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    (tmp_path / "t.yaml").write_text("task: tiny_remote\ndataset_path: nobody/no_such_dataset\ntest_split: test\n"
                                     "output_type: loglikelihood\ndoc_to_text: 'a'\ndoc_to_target: 'b'\n")
    # Built the way `lm_eval --model mesh-transformer --model_args ckpt=...` builds it.
    lm = get_model(harness.MODEL_NAME).create_from_arg_string(f"ckpt={eval_hf_dir}", {"batch_size": 4})
    assert lm.layout.mesh.shape == {"dp": 2, "mp": 4}
    with pytest.raises(ConfigError, match="cannot be loaded"):
        harness.evaluate(lm, ["tiny_remote"], include_path=str(tmp_path), limit=1)


def test_model_args_take_the_sampling_tools_model_flags(eval_hf_dir):
    lm = get_model(harness.MODEL_NAME).create_from_arg_string(f"hf={eval_hf_dir},mp=1,dtype=bf16", {"batch_size": 2})
    assert lm.layout.mesh.shape == {"dp": 8, "mp": 1} and lm.cfg.compute_dtype == "bfloat16"
    lm = get_model(harness.MODEL_NAME).create_from_arg_string(f"hf={eval_hf_dir},dtype=int8,quantize_head=True", {})
    assert (lm.cfg.weight_dtype, lm.cfg.quantize_head) == ("int8", True)
    assert lm.params["lm_head"]["kernel"].dtype == np.int8
    with pytest.raises(ConfigError, match="--mp 3 must"):
        get_model(harness.MODEL_NAME).create_from_arg_string(f"ckpt={eval_hf_dir},mp=3", {})


def training_config(tmp_path, **overrides):
    """A 2-step run of the evaluation tests' model on a written corpus, evaluating 2 examples per task."""
    records = tmp_path / "train_0_16.tfrecords"
    rng = np.random.default_rng(0)
    tfrecord.write_records(str(records), [tfrecord.encode_example({"text": rng.integers(0, 50256, 17)})
                                          for _ in range(16)])
    (tmp_path / "train.index").write_text(records.name + "\n")
    return config.from_dict({**EVAL_CFG_DICT, "seq": 16, "per_replica_batch": 1, "total_steps": 2, "ckpt_every": 2,
                             "anneal_steps": 4, "model_dir": str(tmp_path / "run"),
                             "train_set": str(tmp_path / "train.index"), "eval_harness_limit": 2, **overrides})


def test_training_logs_task_metrics_at_val_every(tmp_path, eval_tasks):
    cfg = training_config(tmp_path, layers=1, cores_per_replica=1, val_every=1, warmup_steps=1,
                          eval_harness_tasks=["tiny_mc"])
    Trainer(cfg, evaluate=harness.training_evaluator(cfg, eval_tasks[0])).run()
    logged = {row["step"]: row for row in read_metrics(cfg.model_path) if "eval/tiny_mc/acc" in row}
    assert sorted(logged) == [1, 2]
    assert all(row["eval/tiny_mc/acc"] in (0.0, 0.5, 1.0) and "eval/tiny_mc/acc_norm" in row for row in logged.values())


def test_lora_training_evaluates_the_base_with_its_adapters(tmp_path, eval_hf_dir, eval_tasks):
    """A LoRA run's eval_harness_tasks score the base with the adapters merged (the state holds the adapters only),
    and the eval's copy of the model is not kept on the devices between evals."""
    cfg = training_config(tmp_path, cores_per_replica=2, val_every=2, warmup_steps=0, lr=5e-2, end_lr=5e-2,
                          lora_rank=4, lora_alpha=8, eval_harness_tasks=["tiny_ppl"])
    evaluate = harness.training_evaluator(cfg, eval_tasks[0])
    trainer = Trainer(cfg, tune_model_path=eval_hf_dir, evaluate=evaluate)
    trainer.run()
    (logged,) = [row for row in read_metrics(cfg.model_path) if "eval/tiny_ppl/word_perplexity" in row]
    merged = lora.merge(trainer.frozen, trainer.state["params"], lora.scale(cfg))

    def perplexity(params):
        layout = make_inference_layout(cfg, mesh=make_dp_mp(1, 1))
        lm = harness.MeshTransformerLM(layout, params, load_tokenizer(), batch_size=2)
        results = harness.evaluate(lm, ["tiny_ppl"], manager=eval_tasks[1], limit=2, bootstrap_iters=0)
        return harness.task_metrics(results)["eval/tiny_ppl/word_perplexity"]

    np.testing.assert_allclose(logged["eval/tiny_ppl/word_perplexity"], perplexity(merged), rtol=1e-4)
    assert abs(perplexity(trainer.frozen) - logged["eval/tiny_ppl/word_perplexity"]) > 1e-3
    del merged
    gc.collect()  # the lms above
    held = sum(x.nbytes for x in jax.live_arrays())
    evaluate = harness.training_evaluator(cfg, eval_tasks[0])  # kept: it keeps what it holds
    again = evaluate(*trainer.model_params())
    assert again == {k: v for k, v in logged.items() if k.startswith("eval/")}
    gc.collect()
    assert sum(x.nbytes for x in jax.live_arrays()) <= held  # the eval's placed copy is gone again
