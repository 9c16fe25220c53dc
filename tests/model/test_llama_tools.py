"""The tools on a Llama HF directory, as a user runs them: the directory's own tokenizer (tokenizer.json, its BOS),
its chat template and its generation config's end-of-turn ids, and the server's chat completions equal to HF's
greedy continuation of the template's text. The tokenizer's files are built here (no download)."""
import json

import numpy as np
import pytest
import torch

from bench.common import write_word_tokenizer
from mesh_transformer.store import convert
from mesh_transformer.tokenizer import eos_ids, load_tokenizer

WORDS = ["Hello", "world", "user", "assistant", "The", "quick", "brown", "fox", "jumps", "over", "lazy", "dog"]
SPECIALS = ["<unk>", "<s>", "</s>", "<|eot|>", "<|start|>"]
TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|start|> {{ m['role'] }} {{ m['content'] }} <|eot|> {% endfor %}"
            "{% if add_generation_prompt %}<|start|> assistant {% endif %}")


def write_tokenizer(path: str) -> None:
    """A word-level tokenizer of 128 ids (specials, words, w0 ...) that prepends <s>, with a chat template and a
    generation config that ends a turn at <|eot|> or </s>."""
    vocab = {token: i for i, token in enumerate(SPECIALS + WORDS + [f"w{i}" for i in range(128 - 17)])}
    write_word_tokenizer(path, vocab, chat_template=TEMPLATE)
    with open(f"{path}/generation_config.json", "w") as f:
        json.dump({"bos_token_id": 1, "eos_token_id": [2, 3]}, f)


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    """A random tiny Llama 3-style model (8 query heads over 2 key heads, llama3 rope) saved by transformers, with
    the tokenizer's files."""
    from tests.model.test_llama import random_hf

    path = str(tmp_path_factory.mktemp("llama_hf"))
    hf_model = random_hf("llama3", seed=7)
    hf_model.config.bos_token_id, hf_model.config.eos_token_id = 1, 2
    hf_model.save_pretrained(path, safe_serialization=True)
    write_tokenizer(path)
    return path, hf_model


def test_the_directory_reads_as_llama_with_its_tokenizer_bos_and_end_of_turn(llama_dir):
    path, _ = llama_dir
    cfg = convert.source_config(path)
    assert (cfg.family, cfg.kv_heads, cfg.tokenizer) == ("llama", 2, path)
    tokenizer = load_tokenizer(cfg.tokenizer)
    assert tokenizer.encode("Hello world") == [1, 5, 6]  # BOS as tokenizer.json says
    assert eos_ids(tokenizer) == (2, 3)  # </s>, and <|eot|> from generation_config.json


def test_the_servers_chat_completion_is_hfs_greedy_continuation_of_the_template(llama_dir):
    import httpx

    from mesh_transformer.infer.params import make_inference_layout, read_params
    from mesh_transformer.parallel.mesh import make_dp_mp
    from mesh_transformer.serve import engine as serving, server

    path, hf_model = llama_dir
    cfg = convert.source_config(path)
    tokenizer = load_tokenizer(cfg.tokenizer)
    messages = [{"role": "user", "content": "The quick brown fox"}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert ids[0] == 1 and ids.count(1) == 1  # one BOS, the template's
    with torch.no_grad():
        out = hf_model.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False, eos_token_id=[2, 3],
                                pad_token_id=0)
    new = [t for t in out[0, len(ids):].tolist()]
    stop = next((i for i, t in enumerate(new) if t in (2, 3)), len(new))
    want = tokenizer.decode(new[:stop])
    layout = make_inference_layout(cfg, mesh=make_dp_mp(1, 2))
    engine = serving.Engine(layout, read_params(layout, path), tokenizer, max_batch=2, n_pages=32, page_size=8)
    try:
        app = server.create_app(engine, tokenizer, model_name="tiny-llama")
        with server.BackgroundServer(app) as running, httpx.Client(base_url=running.url, timeout=120) as client:
            response = client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 8,
                                                                 "temperature": 0})
    finally:
        engine.close()
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    assert choice["message"]["content"] == want
    assert choice["finish_reason"] == ("stop" if stop < len(new) else "length")
    assert np.all(np.array(new[:stop]) < 128)


def test_device_sample_greedy_text_is_hfs_and_the_directory_goes_to_ours_and_back(llama_dir, tmp_path):
    """device_sample.py on the directory (mp 2: a device holds 4 query heads over 1 key head) prints HF's greedy
    continuation (stopping where generation_config.json's ids would); from_hf_weights.py and to_hf_weights.py take it
    to ours and back with the same tensors (the tied head written as lm_head.weight)."""
    from transformers import LlamaForCausalLM

    from tests.helpers import run_script, run_scripts, state_dict_numpy

    path, hf_model = llama_dir
    ours, back = str(tmp_path / "ours"), str(tmp_path / "back")
    sample, imported = run_scripts(
        ("device_sample.py", "--hf", path, "--prompt", "The quick brown fox", "--max-new-tokens", "6",
         "--temperature", "0", "--set", "cores_per_replica=2"),
        ("from_hf_weights.py", "--hf-model", path, "--output-ckpt", ours))
    assert sample.returncode == 0, sample.stderr[-2000:]
    assert imported.returncode == 0, imported.stderr[-2000:]
    tokenizer = load_tokenizer(path)
    ids = tokenizer.encode("The quick brown fox")
    with torch.no_grad():
        out = hf_model.generate(torch.tensor([ids]), max_new_tokens=6, do_sample=False, eos_token_id=[2, 3],
                                pad_token_id=0)
    new = out[0, len(ids):].tolist()
    new = new[:next((i for i, t in enumerate(new) if t in (2, 3)), len(new))]
    assert sample.stdout == tokenizer.decode(new) + "\n"
    export = run_script("to_hf_weights.py", "--input-ckpt", ours, "--output-path", back, "--dtype", "fp32")
    assert export.returncode == 0, export.stderr[-2000:]
    assert json.load(open(f"{back}/config.json"))["model_type"] == "llama"
    got = state_dict_numpy(LlamaForCausalLM.from_pretrained(back))
    want = state_dict_numpy(hf_model)
    for name, value in want.items():
        np.testing.assert_array_equal(got[name], value, err_msg=name)


def test_lm_eval_on_the_directory_matches_lm_evals_hf_model(llama_dir, eval_tasks):
    """Scored through our harness on dp 2 x mp 2 as lm-eval's own `hf` model scores the directory: texts with the
    tokenizer's BOS, rolling windows after it."""
    from mesh_transformer.infer import harness
    from mesh_transformer.infer.params import make_inference_layout, read_params
    from mesh_transformer.parallel.mesh import make_dp_mp
    from tests.helpers import EVAL_OPTIONS, TASKS, assert_same_eval

    path, _ = llama_dir
    reference = harness.evaluate("hf", TASKS, manager=eval_tasks[1], **EVAL_OPTIONS, device="cpu",
                                 model_args=f"pretrained={path},dtype=float32")
    cfg = convert.source_config(path)
    layout = make_inference_layout(cfg, mesh=make_dp_mp(2, 2))
    lm = harness.MeshTransformerLM(layout, read_params(layout, path), load_tokenizer(cfg.tokenizer), batch_size=4)
    assert lm.prefix_token_id == 1 and lm.tok_encode("Hello world") == [1, 5, 6]
    assert_same_eval(harness.evaluate(lm, TASKS, manager=eval_tasks[1], **EVAL_OPTIONS), reference)
