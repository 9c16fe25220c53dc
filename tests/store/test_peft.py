"""LoRA adapters on disk: a LoRA run exported merged and as a PEFT directory, PEFT's own adapters read by us, both
merged at load for inference; bad adapters are one-line errors."""
import dataclasses

import jax
import numpy as np
import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import GPTJForCausalLM

from mesh_transformer.model import table
from mesh_transformer import config
from mesh_transformer.infer import adapter_slots
from mesh_transformer.infer import params as infer_params
from mesh_transformer.model import gptj as model
from mesh_transformer.model import lora
from mesh_transformer.store import adapters, checkpoint, convert, hf
from tests.helpers import CPU_POLICY, TINY_SHAPE, random_hf_dir, run_script, served_greedy, state_dict_numpy

CFG = config.from_dict({**TINY_SHAPE, "seq": 16, "cores_per_replica": 1, "lora_rank": 4, "lora_alpha": 8})
IDS = np.random.default_rng(0).integers(0, CFG.n_vocab, (2, CFG.seq))


def random_adapters(cfg, seed):
    rng = np.random.default_rng(seed)
    return jax.tree.map(lambda s: (rng.normal(size=s.shape) * 0.1).astype(np.float32), lora.lora_shapes(cfg))


def save_lora_run(root, cfg, base, adapters, step=5):
    """A LoRA run's checkpoint as the trainer writes it (adapters as params, the base named in the metadata)."""
    tree = {"step": np.int32(step), "params": adapters}
    checkpoint.save(root, step, tree, {"config": cfg.to_dict(), "lora_base": {"path": base}})
    return root


def torch_logits(hf_model, ids=IDS):
    with torch.no_grad():
        return hf_model(torch.tensor(ids.astype(np.int64))).logits.numpy()


def our_logits(params, cfg=CFG, ids=IDS, adapters=None):
    forward = jax.jit(lambda p, x, a: model.forward(p, x, cfg, policy=CPU_POLICY, adapters=a))
    return np.asarray(forward(params, ids, adapters))


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("peft")
    base_dir, base_model = random_hf_dir(tmp, CFG)
    base = hf.hf_to_params(state_dict_numpy(base_model), CFG)
    adapters = random_adapters(CFG, 1)
    return {"tmp": tmp, "base_dir": base_dir, "base": base, "adapters": adapters,
            "run": save_lora_run(str(tmp / "run"), CFG, base_dir, adapters)}


def test_merged_and_peft_exports_give_our_adapted_logits(run, tmp_path):
    ours = our_logits(run["base"], adapters=run["adapters"])
    merged, adapter = str(tmp_path / "merged"), str(tmp_path / "adapter")
    for args in (["--output-path", merged, "--dtype", "fp32"], ["--output-path", adapter, "--peft"]):
        result = run_script("to_hf_weights.py", "--input-ckpt", run["run"], *args)
        assert result.returncode == 0, result.stderr[-2000:]
    np.testing.assert_allclose(torch_logits(GPTJForCausalLM.from_pretrained(merged).eval()), ours, atol=1e-4)
    peft_model = PeftModel.from_pretrained(GPTJForCausalLM.from_pretrained(run["base_dir"]), adapter).eval()
    np.testing.assert_allclose(torch_logits(peft_model), ours, atol=1e-4)


def test_an_adapter_saved_by_peft_loads_in_ours(run, tmp_path):
    peft_cfg = LoraConfig(r=4, lora_alpha=16, target_modules=["q_proj", "v_proj", "out_proj", "fc_out"],
                          init_lora_weights=False, lora_dropout=0.0)
    peft_model = get_peft_model(GPTJForCausalLM.from_pretrained(run["base_dir"]), peft_cfg).eval()
    peft_model.save_pretrained(str(tmp_path / "by_peft"))
    with convert.open_params(run["base_dir"], CFG, lora=str(tmp_path / "by_peft")) as reader:
        merged = {}
        for path, like in table.param_paths(CFG):
            table.set_path(merged, path, convert.read_array(reader, path, like.shape))
    np.testing.assert_allclose(our_logits(merged), torch_logits(peft_model), atol=1e-4)


def test_inference_merges_a_lora_run_at_load(run):
    layout = infer_params.make_inference_layout(CFG, jax.devices()[:2], mp=2)
    expected = infer_params.place_params(lora.merge(run["base"], run["adapters"], lora.scale(CFG)), layout)
    for placed in (infer_params.read_params(layout, run["run"]),
                   infer_params.read_params(layout, run["base_dir"], lora=run["run"])):
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-6), placed, expected)


def test_peft_on_a_run_without_lora_is_a_one_line_error(run, tmp_path):
    result = run_script("to_hf_weights.py", "--input-ckpt", run["base_dir"], "--output-path", str(tmp_path / "o"),
                        "--peft")
    assert result.returncode == 2 and result.stderr.strip().startswith("error: --peft needs a LoRA run")
    assert len(result.stderr.strip().splitlines()) == 1


def test_lora_whose_shapes_do_not_match_the_base_is_a_one_line_error(run):
    other = dataclasses.replace(CFG, d_model=48)
    bad = save_lora_run(str(run["tmp"] / "bad"), other, run["base_dir"], random_adapters(other, 2))
    result = run_script("device_sample.py", "--ckpt", run["base_dir"], "--lora", bad, "--prompt", "x",
                        "--max-new-tokens", "1")
    assert result.returncode == 2, result.stderr[-2000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]  # after the log lines
    assert errors == [result.stderr.strip().splitlines()[-1]]
    assert errors[0].startswith(f"error: adapter {bad}: q.a has shape") and "the base model needs" in errors[0]


def test_adapters_saved_by_peft_served_side_by_side_give_peft_s_own_models_tokens_and_logprobs(run, tmp_path):
    """Two PEFT adapters (ranks 4 and 8, other targets) in adapter slots beside the base, one batch of a row each
    and a base row: each row's greedy tokens are the argmax of PEFT's own model over them, its log-probs PEFT's."""
    configs = [LoraConfig(r=4, lora_alpha=16, target_modules=["q_proj", "v_proj", "out_proj", "fc_out"],
                          init_lora_weights=False, lora_dropout=0.0),
               LoraConfig(r=8, lora_alpha=8, target_modules=["k_proj", "fc_in"], init_lora_weights=False,
                          lora_dropout=0.0)]
    served_cfg = dataclasses.replace(CFG, lora_rank=0, max_loras=2, max_lora_rank=8)
    layout = infer_params.make_inference_layout(served_cfg, jax.devices()[:1], mp=1)
    params = adapter_slots.with_slots(infer_params.place_params(run["base"], layout), layout)
    writer, hf_models = adapter_slots.SlotWriter(layout), [GPTJForCausalLM.from_pretrained(run["base_dir"]).eval()]
    for slot, peft_cfg in enumerate(configs):
        torch.manual_seed(slot)
        peft_model = get_peft_model(GPTJForCausalLM.from_pretrained(run["base_dir"]), peft_cfg).eval()
        peft_model.save_pretrained(str(tmp_path / f"a{slot}"))
        params = writer.write(params, slot, *adapters.read_adapters(str(tmp_path / f"a{slot}"), served_cfg))
        hf_models.append(peft_model)
    prompts = [[5, 17, 42, 9], [100, 3, 7], [1, 2, 3, 4, 5]]
    tokens, logprobs = served_greedy(layout, params, prompts, np.array([-1, 0, 1]), steps=4)
    for prompt, row_tokens, row_logprobs, hf_model in zip(prompts, tokens, logprobs, hf_models):
        ids = np.array([prompt + list(row_tokens)])
        logp = torch.log_softmax(torch.tensor(torch_logits(hf_model, ids)[0]), -1).numpy()
        positions = range(len(prompt) - 1, len(prompt) - 1 + len(row_tokens))
        assert list(row_tokens) == [int(logp[p].argmax()) for p in positions]
        np.testing.assert_allclose(row_logprobs, [logp[p, t] for p, t in zip(positions, row_tokens)], atol=1e-4)
