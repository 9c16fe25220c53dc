"""LoRA adapters served side by side over one base (serve/adapters.py): /v1/models lists them, a request's model
picks one, concurrent requests mixing the base and adapters of different ranks and targets each get their merged
model's greedy text and log-probs (the same prompt on each: the prefix cache keeps them apart), adapters load and
unload at run time without losing a request, and bad ones get their errors while the server keeps serving."""
import concurrent.futures
import contextlib
import dataclasses
import json
import subprocess
import sys

import httpx
import jax
import numpy as np
import pytest

from mesh_transformer import config
from mesh_transformer.infer import sampler as sampling
from mesh_transformer.infer.params import make_inference_layout
from mesh_transformer.infer.programs import Programs
from mesh_transformer.infer.score import Scorer, score_sequences
from mesh_transformer.model import lora, table
from mesh_transformer.parallel.mesh import make_dp_mp
from mesh_transformer.serve import engine as serving, server
from mesh_transformer.store import peft
from mesh_transformer.tokenizer import EOS_ID, load_tokenizer

BASE = config.from_dict({"layers": 2, "d_model": 32, "n_heads": 4, "n_vocab": 50304, "pe_rotary_dims": 4, "seq": 64,
                         "cores_per_replica": 4, "remat": False})
SERVED = dataclasses.replace(BASE, max_loras=3, max_lora_rank=8)
NEW = 8
PROMPT = "the quick brown fox"
# name -> (rank, targets, alpha)
ADAPTERS = {"sql": (2, ("q", "k", "v", "out", "fc_in", "fc_out"), 4.0), "legal": (8, ("q", "v"), 8.0),
            "late": (4, ("out", "fc_in", "fc_out"), 4.0)}


def random_adapter(rank: int, targets: tuple, seed: int, cfg=BASE) -> dict:
    shapes = lora.lora_shapes(dataclasses.replace(cfg, lora_rank=rank, lora_targets=list(targets)))
    rng = np.random.default_rng(seed)
    return {t: {w: (rng.normal(size=s.shape) * 0.5).astype(np.float32) for w, s in ab.items()}
            for t, ab in shapes.items()}


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer()


@pytest.fixture(scope="module")
def base_params():
    """Random weights, EOS made impossible so lengths are known."""
    rng = np.random.default_rng(0)
    params = jax.tree.map(lambda s: (rng.standard_normal(s.shape) * 0.2).astype(np.float32), table.param_shapes(BASE))
    params["lm_head"]["bias"][EOS_ID] = -1e4
    return params


@pytest.fixture(scope="module")
def adapter_dirs(tmp_path_factory):
    """Each adapter as an HF PEFT directory; its arrays and scale."""
    root, out = tmp_path_factory.mktemp("adapters"), {}
    for seed, (name, (rank, targets, alpha)) in enumerate(ADAPTERS.items()):
        arrays = random_adapter(rank, targets, seed)
        peft.write_peft(str(root / name), arrays, BASE, rank, alpha)
        out[name] = (str(root / name), arrays, alpha / rank)
    return out


@pytest.fixture(scope="module")
def expected(base_params, adapter_dirs, tokenizer):
    """Each model's greedy text and log-probs for PROMPT: the base's, and each adapter merged into it."""
    layout = make_inference_layout(BASE, mesh=make_dp_mp(2, 4))
    models = {"tiny": base_params, **{name: lora.merge(base_params, arrays, scale)
                                      for name, (_, arrays, scale) in adapter_dirs.items()}}
    out = {}
    for name, params in models.items():
        result = sampling.Sampler(layout, params).generate([tokenizer.encode(PROMPT)], NEW, temperature=0.0,
                                                           return_logprobs=True, stop_token_ids=[])[0]
        out[name] = (tokenizer.decode(result.tokens), list(result.logprobs))
    assert len({text for text, _ in out.values()}) == len(out)  # each adapter changes the text
    return out


@pytest.fixture(scope="module")
def programs():
    """The decode programs every engine here runs, compiled once."""
    return Programs(make_inference_layout(SERVED, mesh=make_dp_mp(2, 4)))


@contextlib.contextmanager
def running_server(base_params, adapter_dirs, tokenizer, programs):
    """A server of the base with "sql" and "legal" loaded (3 slots), on a paged cache with prefix reuse."""
    engine = serving.Engine(programs.layout, base_params, tokenizer, max_batch=8, n_pages=64, page_size=4,
                            programs=programs)
    modules = [(name, adapter_dirs[name][0]) for name in ("sql", "legal")]
    try:
        app = server.create_app(engine, tokenizer, model_name="tiny", lora_modules=modules)
        with server.BackgroundServer(app) as running:
            yield running.url
    finally:
        engine.close()


@pytest.fixture(scope="module")
def url(base_params, adapter_dirs, tokenizer, programs):
    """A server whose adapters stay as they are loaded."""
    with running_server(base_params, adapter_dirs, tokenizer, programs) as running:
        yield running


@pytest.fixture
def own_url(base_params, adapter_dirs, tokenizer, programs):
    """A server of the test's own, whose adapters it loads and unloads."""
    with running_server(base_params, adapter_dirs, tokenizer, programs) as running:
        yield running


def complete(url: str, model: str | None, **extra) -> httpx.Response:
    body = {"prompt": PROMPT, "max_tokens": NEW, "temperature": 0, "logprobs": 0, **extra}
    if model is not None:
        body["model"] = model
    return httpx.post(f"{url}/v1/completions", json=body, timeout=120)


def check_answer(response: httpx.Response, want: tuple, model: str) -> None:
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["model"] == model
    choice = body["choices"][0]
    assert choice["text"] == want[0]
    np.testing.assert_allclose(choice["logprobs"]["token_logprobs"], want[1], rtol=0, atol=2e-4)


def test_models_lists_the_base_and_each_adapter_with_its_parent(url, adapter_dirs):
    data = httpx.get(f"{url}/v1/models").json()["data"]
    assert [(m["id"], m["parent"]) for m in data] == [("tiny", None), ("sql", "tiny"), ("legal", "tiny")]
    assert data[1]["root"] == adapter_dirs["sql"][0]


def test_concurrent_requests_mixing_adapters_each_get_their_merged_models_output(url, expected):
    models = ["tiny", "sql", "legal", None] * 4
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        responses = list(pool.map(lambda m: complete(url, m), models))
    for model, response in zip(models, responses):
        check_answer(response, expected[model or "tiny"], model or "tiny")
    chat = httpx.post(f"{url}/v1/chat/completions", json={
        "model": "legal", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}, timeout=120)
    assert chat.status_code == 200 and chat.json()["model"] == "legal"


def test_an_unknown_model_is_openais_404(url):
    for response in (complete(url, "nope"), complete(url, "nope", max_tokens=0, echo=True),
                     httpx.post(f"{url}/v1/chat/completions", json={"model": "nope", "messages": [
                         {"role": "user", "content": "hi"}]}, timeout=120)):
        assert response.status_code == 404
        assert response.json()["error"]["code"] == "model_not_found" and "nope" in response.json()["error"]["message"]


def test_an_adapter_loads_and_unloads_at_run_time_no_request_is_lost_and_bad_ones_are_400s(own_url, adapter_dirs,
                                                                                             expected, tmp_path):
    url = own_url
    loaded = httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": "late", "lora_path":
                                                             adapter_dirs["late"][0]}, timeout=120)
    assert loaded.status_code == 200, loaded.text
    check_answer(complete(url, "late"), expected["late"], "late")
    # "sql" unloaded while its requests run (a stream that has sent its first tokens, and others): they finish
    # with its output; new ones get a 404.
    body = {"model": "sql", "prompt": PROMPT, "max_tokens": NEW, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as stream:
        lines = (line[6:] for line in stream.iter_lines() if line.startswith("data: "))
        pieces = [json.loads(next(lines))["choices"][0]["text"]]
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            running = [pool.submit(complete, url, "sql") for _ in range(6)]
            others = [pool.submit(complete, url, "legal") for _ in range(2)]
            unloaded = httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "sql"}, timeout=120)
            assert unloaded.status_code == 200, unloaded.text
            answers = [f.result() for f in running + others]
        pieces += [json.loads(line)["choices"][0]["text"] for line in lines if line != "[DONE]"]
    assert "".join(pieces) == expected["sql"][0]
    for response, model in zip(answers, ["sql"] * 6 + ["legal"] * 2):
        if response.status_code == 404:  # submitted after the unload
            assert model == "sql"
            continue
        check_answer(response, expected[model], model)
    assert complete(url, "sql").status_code == 404
    assert "sql" not in [m["id"] for m in httpx.get(f"{url}/v1/models").json()["data"]]
    # Its slot is free again (3 slots: legal, late, and this one).
    again = httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": "sql2", "lora_path":
                                                            adapter_dirs["sql"][0]}, timeout=120)
    assert again.status_code == 200, again.text
    check_answer(complete(url, "sql2"), expected["sql"], "sql2")
    metrics = httpx.get(f"{url}/metrics").text
    assert 'vllm:request_success_total{finished_reason="length",model_name="sql2"} 1.0' in metrics \
        or 'vllm:request_success_total{model_name="sql2",finished_reason="length"} 1.0' in metrics
    assert any(line.startswith("vllm:lora_requests_info{") and 'max_lora="3"' in line
               for line in metrics.splitlines())
    # Bad adapters: each a 400 naming its problem, and the server serves on.
    def load(name, path):
        return httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": name, "lora_path": path}, timeout=120)

    assert {m["id"] for m in httpx.get(f"{url}/v1/models").json()["data"]} == {"tiny", "legal", "late", "sql2"}
    wide = dataclasses.replace(BASE, d_model=64)
    peft.write_peft(str(tmp_path / "wide"), random_adapter(2, ("q",), 7, wide), wide, 2, 2.0)
    peft.write_peft(str(tmp_path / "deep"), random_adapter(16, ("q",), 8), BASE, 16, 16.0)
    for name, path, words in [("gone", str(tmp_path / "missing"), "neither a LoRA run"),
                              ("wide", str(tmp_path / "wide"), "the base model needs"),
                              ("deep", str(tmp_path / "deep"), "rank 16, over the served maximum 8"),
                              ("legal", adapter_dirs["legal"][0], "already served")]:
        response = load(name, path)
        assert response.status_code == 400 and words in response.json()["error"]["message"], response.text
    full = load("more", adapter_dirs["late"][0])  # every slot holds an adapter
    assert full.status_code == 400 and "all 3 adapter slots are taken" in full.json()["error"]["message"]
    assert httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "nope"}).status_code == 404
    assert httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": "x"}).status_code == 400
    check_answer(complete(url, "legal"), expected["legal"], "legal")


def test_an_echoed_prompt_is_scored_through_its_adapter(url, base_params, adapter_dirs, tokenizer):
    """lm-eval's loglikelihood requests (echo, logprobs, max_tokens 0) naming an adapter get its merged model's."""
    tokens = tokenizer.encode(PROMPT + " jumps over the lazy dog")
    _, arrays, scale = adapter_dirs["legal"]
    layout = make_inference_layout(BASE, mesh=make_dp_mp(2, 4))
    want = score_sequences(Scorer(layout, lora.merge(base_params, arrays, scale)), [tokens])[0].logprobs
    for model, differs in (("legal", False), ("tiny", True)):
        response = httpx.post(f"{url}/v1/completions", json={"model": model, "prompt": tokens, "max_tokens": 0,
                                                              "echo": True, "logprobs": 0}, timeout=120)
        assert response.status_code == 200, response.text
        got = response.json()["choices"][0]["logprobs"]["token_logprobs"]
        assert got[0] is None
        assert (np.abs(np.array(got[1:]) - want).max() > 1e-2) == differs
        if not differs:
            np.testing.assert_allclose(got[1:], want, rtol=0, atol=2e-4)


@pytest.mark.parametrize("flags, named", [(["--lora-modules", "nameonly"], "NAME=PATH"),
                                          (["--lora-modules", "a=x", "a=y"], "names 'a' twice"),
                                          (["--lora-modules", "a=x", "b=y", "--max-loras", "1"], "--max-loras 1"),
                                          (["--max-lora-rank", "0"], "--max-lora-rank")])
def test_device_serve_bad_lora_flags_are_one_line_errors(flags, named):
    result = subprocess.run([sys.executable, "device_serve.py", "--config", "configs/bench.json", *flags],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert result.stderr.strip().count("\n") == 0 and named in result.stderr, result.stderr


def test_a_lora_module_that_cannot_load_stops_the_start_naming_it(base_params, tokenizer, programs, tmp_path):
    engine = serving.Engine(programs.layout, base_params, tokenizer, max_batch=8, programs=programs)
    try:
        with pytest.raises(ValueError, match=f"--lora-modules x={tmp_path}/none: adapter 'x'"):
            server.create_app(engine, tokenizer, model_name="tiny", lora_modules=[("x", f"{tmp_path}/none")])
    finally:
        engine.close()
