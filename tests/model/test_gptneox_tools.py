"""The tools on a GPT-NeoX HF directory, as a user runs them: sampling with the directory's own tokenizer, lm-eval
against lm-eval's own `hf` model on the same directory, resharding into ours and back out to HF, and a PEFT adapter
on the targets HF holds apart (attention's dense, the MLP's)."""
import json

import numpy as np
import pytest
import torch

from mesh_transformer import config
from mesh_transformer.config import ConfigError
from mesh_transformer.infer import harness
from mesh_transformer.store import convert, hf
from tests.helpers import (CPU_POLICY, EVAL_CFG_DICT, EVAL_OPTIONS, TASKS, assert_same_eval, random_eval_params,
                           run_script, run_scripts, save_config, state_dict_numpy, write_hf_dir)

NEOX_CFG = config.from_dict({**EVAL_CFG_DICT, "family": "gptneox", "parallel_residual": False, "rotary_base": 500.0})


@pytest.fixture(scope="module")
def neox_dir(tmp_path_factory):
    """A random tiny GPT-NeoX as an HF directory (f32 safetensors, config.json, the tokenizer's files)."""
    return write_hf_dir(str(tmp_path_factory.mktemp("neox_hf")), random_eval_params(NEOX_CFG), NEOX_CFG)


def hf_model(path):
    from transformers import GPTNeoXForCausalLM

    return GPTNeoXForCausalLM.from_pretrained(path, attn_implementation="eager").eval()


def test_the_directory_reads_as_a_gptneox_config_with_its_own_tokenizer(neox_dir):
    cfg = convert.source_config(neox_dir)
    assert (cfg.family, cfg.parallel_residual, cfg.rotary_base, cfg.tokenizer) == ("gptneox", False, 500.0, neox_dir)


def test_sampling_resharding_and_export_run_on_the_directory(neox_dir, tmp_path):
    """Greedy text of device_sample.py equals HF's greedy continuation; the directory resharded into ours (mp 2) and
    written back to HF holds the same tensors."""
    ours, back = str(tmp_path / "ours"), str(tmp_path / "back")
    sample, reshard = run_scripts(
        ("device_sample.py", "--hf", neox_dir, "--prompt", "Hello world", "--max-new-tokens", "6", "--temperature",
         "0", "--set", "cores_per_replica=2"),
        ("resharding_example.py", "--input-ckpt", neox_dir, "--config", save_config(tmp_path, NEOX_CFG),
         "--output-ckpt", ours, "--cores-per-replica", "2", "--slim"))
    assert sample.returncode == 0, sample.stderr[-2000:]
    assert reshard.returncode == 0, reshard.stderr[-2000:]
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(neox_dir)
    prompt = tokenizer("Hello world", return_tensors="pt").input_ids
    with torch.no_grad():
        out = hf_model(neox_dir).generate(prompt, max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert sample.stdout == tokenizer.decode(out[0, prompt.shape[1]:]) + "\n"
    export = run_script("to_hf_weights.py", "--input-ckpt", ours, "--output-path", back, "--dtype", "fp32")
    assert export.returncode == 0, export.stderr[-2000:]
    assert json.load(open(f"{back}/config.json"))["model_type"] == "gpt_neox"
    want, got = state_dict_numpy(hf_model(neox_dir)), state_dict_numpy(hf_model(back))
    assert set(got) == set(want)
    for name, value in want.items():
        np.testing.assert_array_equal(got[name], value, err_msg=name)


def test_lm_eval_on_the_directory_matches_lm_evals_hf_model(neox_dir, eval_tasks):
    reference = harness.evaluate("hf", TASKS, manager=eval_tasks[1], **EVAL_OPTIONS, device="cpu",
                                 model_args=f"pretrained={neox_dir},dtype=float32")
    from mesh_transformer.infer.params import make_inference_layout, read_params
    from mesh_transformer.parallel.mesh import make_dp_mp
    from mesh_transformer.tokenizer import load_tokenizer

    cfg = convert.source_config(neox_dir)
    layout = make_inference_layout(cfg, mesh=make_dp_mp(2, 2))
    lm = harness.MeshTransformerLM(layout, read_params(layout, neox_dir), load_tokenizer(cfg.tokenizer), batch_size=4)
    assert_same_eval(harness.evaluate(lm, TASKS, manager=eval_tasks[1], **EVAL_OPTIONS), reference)


def test_a_peft_adapter_on_dense_and_the_mlp_gives_peft_s_logits(neox_dir, tmp_path):
    import jax
    from peft import LoraConfig, get_peft_model

    from mesh_transformer.model import gptj as model
    from mesh_transformer.model import table

    torch.manual_seed(0)
    peft_model = get_peft_model(hf_model(neox_dir), LoraConfig(r=4, lora_alpha=8, init_lora_weights=False,
                                                               target_modules=["dense", "dense_h_to_4h"])).eval()
    peft_model.save_pretrained(str(tmp_path / "adapter"))
    ids = np.random.default_rng(0).integers(0, NEOX_CFG.n_vocab, (2, 9))
    with torch.no_grad():
        want = peft_model(torch.tensor(ids)).logits.numpy()
    merged: dict = {}
    with convert.open_params(neox_dir, NEOX_CFG, lora=str(tmp_path / "adapter")) as reader:
        for path, like in table.param_paths(NEOX_CFG):
            table.set_path(merged, path, convert.read_array(reader, path, like.shape))
    got = jax.jit(lambda p, x: model.forward(p, x, NEOX_CFG, policy=CPU_POLICY))(merged, ids)
    np.testing.assert_allclose(np.asarray(got), want, atol=1e-4, rtol=0)


def test_a_peft_export_of_q_k_v_adapters_is_refused_by_name():
    from mesh_transformer.store import peft

    adapters = {"q": {"a": np.zeros((2, 32, 4)), "b": np.zeros((2, 4, 32))}}
    with pytest.raises(ConfigError, match="LoRA targets q adapt part of a tensor HF holds whole"):
        peft.write_peft("unused", adapters, NEOX_CFG, 4, 8.0)
    assert "q" not in peft.modules(NEOX_CFG) and peft.modules(NEOX_CFG)["fc_in"] == "mlp.dense_h_to_4h"
    assert hf.hf_config(NEOX_CFG)["use_parallel_residual"] is False


@pytest.mark.parametrize("n_pages", [None, 32], ids=["slots", "paged"])
def test_the_server_completes_as_the_offline_sampler(neox_dir, n_pages):
    """device_serve.py's engine and app over the directory (mp 2), on the slot cache and on pages: /v1/completions
    greedy text equals the offline sampler's."""
    import httpx

    from mesh_transformer.infer import sampler as sampling
    from mesh_transformer.infer.params import make_inference_layout, read_params
    from mesh_transformer.parallel.mesh import make_dp_mp
    from mesh_transformer.serve import engine as serving, server
    from mesh_transformer.tokenizer import load_tokenizer

    cfg = convert.source_config(neox_dir)
    layout = make_inference_layout(cfg, mesh=make_dp_mp(1, 2))
    params, tokenizer = read_params(layout, neox_dir), load_tokenizer(cfg.tokenizer)
    prompts = ["Hello world", "The quick brown fox"]
    offline = sampling.Sampler(layout, params).generate_text(tokenizer, prompts, 6, temperature=0.0)
    paged = {} if n_pages is None else {"n_pages": n_pages, "page_size": 8}
    engine = serving.Engine(layout, params, tokenizer, max_batch=2, stop_token_ids=(), **paged)
    try:
        with server.BackgroundServer(server.create_app(engine, tokenizer, model_name="tiny-neox")) as running:
            with httpx.Client(base_url=running.url, timeout=120) as client:
                for prompt, want in zip(prompts, offline):
                    response = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 6,
                                                                    "temperature": 0})
                    assert response.status_code == 200, response.text
                    assert response.json()["choices"][0]["text"] == want.text
    finally:
        engine.close()
