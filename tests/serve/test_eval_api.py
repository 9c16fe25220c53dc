"""/v1/completions as lm-eval's `local-completions` backend: echo + logprobs, token-id prompts, real top_logprobs,
and lm-eval itself through the server against its own `hf` model on the same weights."""
import httpx
import numpy as np
import pytest
import torch
from transformers import GPTJForCausalLM

from mesh_transformer.infer import harness
from mesh_transformer.infer.params import make_inference_layout, read_params
from mesh_transformer.parallel.mesh import make_dp_mp
from mesh_transformer.serve import engine as serving, server
from mesh_transformer.tokenizer import load_tokenizer
from tests.helpers import EVAL_CFG as CFG
from tests.helpers import EVAL_OPTIONS, TASKS, assert_same_eval

PROMPTS = [[15496, 995, 11, 262, 2068], [464, 3290], [40, 716, 257, 1332, 286, 262, 1080, 13, 632]]


@pytest.fixture(scope="module")
def hf_dir(eval_hf_dir):
    return eval_hf_dir


@pytest.fixture(scope="module")
def url(hf_dir):
    layout = make_inference_layout(CFG, mesh=make_dp_mp(2, 2, __import__("jax").devices()[:4]))
    tokenizer = load_tokenizer()
    engine = serving.Engine(layout, read_params(layout, hf_dir), tokenizer, max_batch=4)
    with server.BackgroundServer(server.create_app(engine, tokenizer, model_name="tiny")) as running:
        yield running.url
    engine.close()


@pytest.fixture(scope="module")
def http(url):
    with httpx.Client(base_url=url, timeout=120) as client:
        yield client


@pytest.fixture(scope="module")
def torch_logprobs(hf_dir):
    """HF torch's log-softmax after each prompt token [T, V], per prompt: the reference."""
    model = GPTJForCausalLM.from_pretrained(hf_dir, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        return [torch.log_softmax(model(torch.tensor([p])).logits[0].float(), -1).numpy() for p in PROMPTS]


def test_echo_logprobs_of_batched_token_prompts_equal_hf_and_top_k_is_true(http, torch_logprobs):
    body = {"prompt": PROMPTS, "max_tokens": 0, "echo": True, "logprobs": 5, "temperature": 0}
    response = http.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    tokenizer = load_tokenizer()
    for choice, prompt, ref_TxV in zip(response.json()["choices"], PROMPTS, torch_logprobs):
        logprobs = choice["logprobs"]
        assert choice["text"] == tokenizer.decode(prompt)
        assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
        expected = ref_TxV[np.arange(len(prompt) - 1), prompt[1:]]
        np.testing.assert_allclose(logprobs["token_logprobs"][1:], expected, atol=1e-4, rtol=0)
        for t, top in enumerate(logprobs["top_logprobs"][1:]):
            ids = np.argsort(-ref_TxV[t])[:5]
            assert list(top) == [tokenizer.decode([i]) for i in ids]
            np.testing.assert_allclose(list(top.values()), ref_TxV[t, ids], atol=1e-4, rtol=0)


def test_echo_with_one_token_gives_prompt_then_the_greedy_token(http, torch_logprobs):
    body = {"prompt": PROMPTS[0], "max_tokens": 1, "echo": True, "logprobs": 1, "temperature": 0, "seed": 3}
    choice = http.post("/v1/completions", json=body).json()["choices"][0]
    ref_TxV = torch_logprobs[0]
    greedy = int(ref_TxV[-1].argmax())
    tokenizer = load_tokenizer()
    assert choice["text"] == tokenizer.decode(PROMPTS[0] + [greedy])
    assert len(choice["logprobs"]["token_logprobs"]) == len(PROMPTS[0]) + 1
    np.testing.assert_allclose(choice["logprobs"]["token_logprobs"][-1], ref_TxV[-1, greedy], atol=1e-4)
    assert list(choice["logprobs"]["top_logprobs"][-1].values()) == [choice["logprobs"]["token_logprobs"][-1]]


def test_echo_streams_the_prompt_first_and_each_piece_with_its_top_logprobs(http):
    body = {"prompt": PROMPTS[1], "max_tokens": 3, "echo": True, "stream": True, "temperature": 0, "logprobs": 2}
    with http.stream("POST", "/v1/completions", json=body) as response:
        chunks = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    assert chunks[-1] == "[DONE]"
    choices = [httpx.Response(200, content=c).json()["choices"][0] for c in chunks[:-1]]
    whole = http.post("/v1/completions", json={**body, "stream": False}).json()["choices"][0]
    assert choices[0]["text"] == load_tokenizer().decode(PROMPTS[1])
    assert "".join(c["text"] for c in choices) == whole["text"]
    streamed = [top for c in choices for top in c["logprobs"]["top_logprobs"]]
    assert [t and list(t) for t in streamed] == [t and list(t) for t in whole["logprobs"]["top_logprobs"]]


def test_echo_with_n_choices_echoes_each(http):
    body = {"prompt": [PROMPTS[1], PROMPTS[2]], "max_tokens": 0, "echo": True, "n": 2, "logprobs": 0}
    choices = http.post("/v1/completions", json=body).json()["choices"]
    tokenizer = load_tokenizer()
    assert [c["text"] for c in choices] == [tokenizer.decode(p) for p in (PROMPTS[1],) * 2 + (PROMPTS[2],) * 2]
    assert choices[0]["logprobs"]["token_logprobs"] == choices[1]["logprobs"]["token_logprobs"]


@pytest.mark.parametrize("body, param", [({"logprobs": 6}, "logprobs"), ({"max_tokens": 0}, "max_tokens"),
                                         ({"echo": "yes"}, "echo")])
def test_bad_eval_requests_are_400_naming_the_field(http, body, param):
    response = http.post("/v1/completions", json={"prompt": PROMPTS[0], "max_tokens": 1, **body})
    assert response.status_code == 400 and response.json()["error"]["param"] == param


def test_lm_eval_local_completions_through_the_server_matches_hf(url, hf_dir, eval_tasks, hf_eval_results):
    ours = harness.evaluate("local-completions", TASKS, manager=eval_tasks[1], **EVAL_OPTIONS, model_args=(
        f"base_url={url}/v1/completions,tokenizer={hf_dir},tokenizer_backend=huggingface,tokenized_requests=True,"
        f"max_length={CFG.seq}"))
    # lm-eval's API models roll windows of max_length - 1 tokens, its hf model of max_length: the same scores
    # only where a text fits one window of either.
    one_window = [s["doc_id"] for s in hf_eval_results["samples"]["tiny_ppl"]
                  if len(load_tokenizer().encode(s["doc"]["text"])) < CFG.seq - 1]
    assert one_window
    assert_same_eval(ours, hf_eval_results, rolling_docs=one_window)
