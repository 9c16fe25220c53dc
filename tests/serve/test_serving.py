import collections
import gc
import json
import random
import socket
import subprocess
import sys
import threading
import time

import httpx
import jax
import numpy as np
import openai
import pytest

from mesh_transformer.model import gptj, table
from mesh_transformer import config
from mesh_transformer.infer import sampler as sampling
from mesh_transformer.infer.programs import Programs
from mesh_transformer.infer.params import make_inference_layout
from mesh_transformer.serve import engine as serving, schedule, server
from mesh_transformer.serve.completion import Event, GenerationRequest, streamable_length
from mesh_transformer.parallel.mesh import make_dp_mp
from mesh_transformer.tokenizer import EOS_ID, load_tokenizer
from tests.helpers import CPU_POLICY

# GPT-2's vocabulary (padded to divide the shards), so text round-trips through the real tokenizer.
CFG = config.from_dict({"layers": 2, "d_model": 32, "n_heads": 4, "n_vocab": 50304, "pe_rotary_dims": 4, "seq": 64,
                        "cores_per_replica": 4, "remat": False})
KEY = "test-key"
MAX_QUEUE, NEW = 64, 12
# At most 16 tokens each: one prompt bucket, so the tests compile few programs.
PROMPTS = [f"{i}: " + " ".join(["the quick fox", "Grüße Köln", "日本語 🙂", "a"][i % 4] for _ in range(1 + i % 2))
           for i in range(64)]


def layout():
    return make_inference_layout(CFG, mesh=make_dp_mp(2, 4))


@pytest.fixture(scope="module")
def programs():
    """One set of decode programs for every engine and sampler here, so they share compiles."""
    return Programs(layout())


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer()


@pytest.fixture(scope="module")
def params():
    """Random weights made with numpy (nothing to compile); EOS made impossible, so lengths are known."""
    rng = np.random.default_rng(0)

    def leaf(path, shape):
        name = jax.tree_util.keystr(path)
        if "scale" in name:
            return np.ones(shape.shape, np.float32)
        return (rng.standard_normal(shape.shape) * (0.0 if "bias" in name else 0.2)).astype(np.float32)

    params = jax.tree_util.tree_map_with_path(leaf, table.param_shapes(CFG))
    params["lm_head"]["bias"][EOS_ID] = -1e4
    return params


@pytest.fixture(scope="module")
def engine(params, tokenizer, programs):
    engine = serving.Engine(layout(), params, tokenizer, programs=programs, max_batch=4, max_queue=MAX_QUEUE)
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def url(engine, tokenizer):
    app = server.create_app(engine, tokenizer, model_name="tiny-gptj", api_key=KEY)
    with server.BackgroundServer(app) as running:
        yield running.url


@pytest.fixture(scope="module")
def http(url):
    with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {KEY}"}, timeout=120,
                      limits=httpx.Limits(max_connections=100)) as client:
        yield client


@pytest.fixture(scope="module")
def offline(params, tokenizer, programs):
    """What the offline sampler makes of PROMPTS, greedy, NEW tokens each."""
    sampler = sampling.Sampler(layout(), params, programs=programs)
    return sampler.generate_text(tokenizer, PROMPTS, NEW, temperature=0.0, return_logprobs=True)


def stream_text(client, body):
    """(text, chunks) of a streamed completion read with httpx."""
    chunks = []
    with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line:
                assert line.startswith("data: ")
                chunks.append(line[6:])
    assert chunks[-1] == "[DONE]"
    chunks = [json.loads(c) for c in chunks[:-1]]
    return "".join(c["choices"][0]["text"] for c in chunks), chunks


def health(client):
    response = client.get("/health")
    assert response.status_code == 200 and response.json()["status"] == "ok"
    return response.json()


def wait_for(client, predicate, timeout_s=60):
    deadline = time.monotonic() + timeout_s
    while not predicate(state := health(client)):
        assert time.monotonic() < deadline, f"server state never got there: {state}"
        time.sleep(0.02)
    return state


def test_openai_client_completes_streams_and_stops(url, offline):
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0)
    expected = offline[0]
    done = client.completions.create(model="tiny-gptj", prompt=PROMPTS[0], max_tokens=NEW, temperature=0, logprobs=1)
    choice = done.choices[0]
    assert done.object == "text_completion" and done.id.startswith("cmpl-") and done.model == "tiny-gptj"
    assert choice.text == expected.text and choice.finish_reason == "length"
    assert done.usage.completion_tokens == NEW and done.usage.total_tokens == done.usage.prompt_tokens + NEW
    np.testing.assert_allclose(choice.logprobs.token_logprobs, expected.logprobs, atol=1e-4)

    chunks = list(client.completions.create(model="tiny-gptj", prompt=PROMPTS[0], max_tokens=NEW, temperature=0,
                                            stream=True))
    assert "".join(c.choices[0].text for c in chunks) == expected.text
    assert chunks[-1].choices[0].finish_reason == "length" and len(chunks) > 2

    stop = expected.text[len(expected.text) // 2:][:3]
    cut = expected.text[:expected.text.index(stop)]
    stopped = client.completions.create(model="tiny-gptj", prompt=PROMPTS[0], max_tokens=NEW, temperature=0,
                                        stop=[stop, "never there"])
    assert stopped.choices[0].text == cut and stopped.choices[0].finish_reason == "stop"
    chunks = list(client.completions.create(model="tiny-gptj", prompt=PROMPTS[0], max_tokens=NEW, temperature=0,
                                            stop=stop, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == cut and chunks[-1].choices[0].finish_reason == "stop"
    assert [m.id for m in client.models.list().data] == ["tiny-gptj"]


def test_64_concurrent_clients_get_the_offline_greedy_completions(http, offline):
    answers = [None] * len(PROMPTS)

    def ask(i):
        body = {"model": "tiny-gptj", "prompt": PROMPTS[i], "max_tokens": NEW, "temperature": 0}
        if i % 2:
            answers[i] = stream_text(http, body)[0]
        else:
            response = http.post("/v1/completions", json=body)
            answers[i] = response.json()["choices"][0]["text"]

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(PROMPTS))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert answers == [r.text for r in offline]


def test_a_sampled_choice_depends_on_its_seed_not_on_its_batch(http):
    body = {"prompt": PROMPTS[1], "max_tokens": 8, "temperature": 1.0, "top_p": 0.9, "top_k": 40, "seed": 7}
    alone = http.post("/v1/completions", json=body).json()["choices"][0]["text"]
    batch = http.post("/v1/completions", json={**body, "prompt": [PROMPTS[1]] * 3}).json()["choices"]  # seeds 7-9
    assert batch[0]["text"] == alone and len({c["text"] for c in batch}) == 3


def test_request_arriving_mid_generation_finishes_before_the_running_one(http):
    events, first_chunk = [], threading.Event()

    def long_stream():
        body = {"prompt": "Once", "max_tokens": CFG.seq - 8, "temperature": 0, "stream": True}
        with http.stream("POST", "/v1/completions", json=body) as response:
            for line in response.iter_lines():
                if line.startswith("data: {") and not first_chunk.is_set():
                    events.append("long first chunk")
                    first_chunk.set()
        events.append("long done")

    thread = threading.Thread(target=long_stream)
    thread.start()
    assert first_chunk.wait(60)
    short = http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2, "temperature": 0})
    events.append("short done")
    thread.join()
    assert short.status_code == 200 and short.json()["choices"][0]["finish_reason"] == "length"
    assert events == ["long first chunk", "short done", "long done"]


WRONG_TYPES = [{}, [], "x", {"a": 1}, [1]]
BAD_VALUES = {
    "model": [1, True, [], {}],
    "prompt": ["", [], [""], ["a", ""], ["", "ü"], [[]], [1, "a"], [[1], "a"], [-1], [50257], [10 ** 12], [1.5],
               [True], {}, 3, None, [[1, -2]], ["a"] * 65, "word " * 200, [7] * 200, [[7] * 200], "\ud800"],
    "max_tokens": [0, -1, 10 ** 30, 1.5, "16", True, CFG.seq + 1, 1e400, CFG.seq, *WRONG_TYPES],
    "temperature": [-0.1, 2.5, "1", True, 1e400, -1e400, 1e308, *WRONG_TYPES],
    "top_p": [0, -0.5, 1.01, "0.9", False, 1e400, *WRONG_TYPES],
    "top_k": [-1, 1.5, "5", True, 10 ** 20, *WRONG_TYPES],
    "n": [0, -1, 17, 10 ** 9, 1.0, "2", True, *WRONG_TYPES],
    "stream": [1, "true", 0, *WRONG_TYPES],
    "stop": [1, "", ["a", ""], ["a", "b", "c", "d", "e"], [1], {"a": 1}, "x" * 300, [None], True],
    "seed": [1.5, "7", True, 2 ** 64, -(2 ** 64), *WRONG_TYPES],
    "logprobs": [-1, 6, 1.5, True, "1", 10 ** 10, *WRONG_TYPES],
    "echo": [1, "no", *WRONG_TYPES],
    "presence_penalty": [2.5, -2.01, "0", True, 1e400, *WRONG_TYPES],
    "frequency_penalty": [-3, 2.5, "0", *WRONG_TYPES],
    "best_of": [2, 0, "1", 1.5, *WRONG_TYPES],
    "logit_bias": [{"50304": -100}, {"-1": 1}, {"1.5": 1}, {"a": 1}, {"7": 101}, {"7": "1"}, {"7": True},
                   {str(i): 1 for i in range(301)}, [], "x", 1],
    "suffix": ["tail", 1, []],
    "user": [1, [], {}, True],
    "stream_options": ["yes", {"include_usage": 1}, {"other": True}, [], True],
    "funky_field": [1, None, "x"],
    "prömpt": ["ü"],
    "messages": [[{"role": "user", "content": "hi"}]],
}
RAW_BODIES = [b"", b"{", b"not json", b"[]", b"[1, 2]", b'"prompt"', b"null", b"123", b"true", b"{}",
              b'{"prompt": "a", "max_tokens": NaN}', b'{"prompt": "a", "temperature": Infinity}',
              b'{"prompt": "a", "temperature": -Infinity}', b'{"prompt": "a",}', b"\xff\xfe\x00garbage",
              b'{"prompt": "a"' + b" " * 10, b"[" * 100000 + b"]" * 100000, b'{"prompt": "a"}x',
              b'{"prompt": "a", "max_tokens": 1' + b"0" * 5000 + b"}", b'{"max_tokens": 4}', b"{'prompt': 'a'}",
              "{\"prompt\": \"Grüße\"".encode()]


def malformed_cases():
    cases = []
    for field, values in BAD_VALUES.items():
        for value in values:
            body = {"prompt": "Hello", "max_tokens": 4, field: value}
            if field == "prompt" and value is None:
                body = {"max_tokens": 4, "prompt": None}
            cases.append(("json", body, field))
    cases += [("raw", raw, None) for raw in RAW_BODIES]
    return cases


def check_error(response, status=None, param=None):
    assert 400 <= response.status_code < 500, (response.status_code, response.text)
    assert status is None or response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and isinstance(error["message"], str)
    assert error["type"] in ("invalid_request_error", "rate_limit_error")
    assert param is None or error["param"] == param, (param, error)


def test_malformed_requests_get_openai_errors_and_the_server_carries_on(http, url):
    cases = malformed_cases()
    for kind, body, field in cases:
        if kind == "json":
            # Python's json writes inf as Infinity (not JSON); 1e400 is JSON that overflows to inf.
            content = json.dumps(body).replace("Infinity", "1e400")
            check_error(http.post("/v1/completions", content=content), 400, field)
        else:
            check_error(http.post("/v1/completions", content=body))
    # Oversized bodies, by Content-Length and by the bytes actually sent (chunked, no length).
    big = json.dumps({"prompt": "x" * (2 << 20)}).encode()
    check_error(http.post("/v1/completions", content=big), 413)
    check_error(http.post("/v1/completions", content=iter([big[i:i + 65536] for i in range(0, len(big), 65536)])),
                413)
    check_error(http.post("/complete", content=big), 413)
    # The original API, other routes and methods.
    for body, param in [({"context": ""}, "context"), ({"context": 5}, "context"), ({}, "context"),
                        ({"context": "a", "temp": -1}, "temp"), ({"context": "a", "top_p": 2}, "top_p"),
                        ({"context": "a", "length": 0}, "length"), ({"context": "a", "x": 1}, "x")]:
        check_error(http.post("/complete", json=body), 400, param)
    check_error(http.get("/nothing"), 404)
    check_error(http.post("/v1/chat/completions", json={}), 400, "messages")
    check_error(http.get("/v1/completions"), 405)
    check_error(http.delete("/v1/models"), 405)
    check_error(http.post("/health"), 405)
    assert len(cases) + 16 >= 200
    # Valid though unusual: non-ASCII text, token prompts, defaults given as null.
    for body in [{"prompt": "Grüße, 日本語 🙂"}, {"prompt": [15496, 995]}, {"prompt": [[15496], [995, 11]]},
                 {"prompt": ["ä", "b"], "n": 2, "max_tokens": None, "temperature": None, "stop": None, "seed": None,
                  "user": "me", "echo": False, "best_of": 1, "logit_bias": {"50256": -100}, "presence_penalty": 0.5,
                  "frequency_penalty": -0.5}]:
        response = http.post("/v1/completions", json={"temperature": 0, **body, "max_tokens": 3})
        assert response.status_code == 200, response.text
    assert health(http)["slots"]["busy"] == 0
    normal = http.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 5, "temperature": 0})
    assert normal.status_code == 200 and normal.json()["usage"]["completion_tokens"] == 5
    biased = http.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 3, "logit_bias": {"262": 100}})
    assert biased.status_code == 200 and biased.json()["choices"][0]["text"] == " the the the"  # token 262: " the"


def test_api_key_is_required_except_for_health(url):
    body = {"prompt": "Hello", "max_tokens": 2, "temperature": 0}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}, {"Authorization": "Basic x"}):
        response = httpx.post(f"{url}/v1/completions", json=body, headers=headers)
        check_error(response, 401)
        assert response.json()["error"]["code"] == "invalid_api_key"
    check_error(httpx.get(f"{url}/v1/models"), 401)
    check_error(httpx.post(f"{url}/complete", json={"context": "a"}), 401)
    assert httpx.get(f"{url}/health").status_code == 200
    assert httpx.post(f"{url}/v1/completions", json=body, headers={"Authorization": f"Bearer {KEY}"}).status_code == 200


def test_original_complete_api(http, offline):
    response = http.post("/complete", json={"context": PROMPTS[0], "top_p": 0.9, "temp": 0, "length": NEW})
    assert response.status_code == 200 and response.json()["completion"] == offline[0].text


def test_full_queue_answers_429_and_accepted_requests_are_answered(engine, http, tokenizer):
    entered, release = threading.Event(), threading.Event()

    def hold(_event):  # runs on the engine thread: while it waits, the engine takes no step
        entered.set()
        release.wait(60)

    engine.submit([GenerationRequest(tokenizer.encode("hold"), 2, hold, temperature=0.0, stream=True)])
    assert entered.wait(60)
    answers = []
    # Each request fills half of the queue; greedy, as sampling sorts the whole vocabulary (slow on these CPUs).
    body = {"prompt": PROMPTS[:4], "n": MAX_QUEUE // 8, "max_tokens": 2, "temperature": 0}
    threads = [threading.Thread(target=lambda: answers.append(http.post("/v1/completions", json=body)))
               for _ in range(2)]
    for thread in threads:
        thread.start()
    try:
        wait_for(http, lambda s: s["queue"]["waiting"] == MAX_QUEUE)
        refused = http.post("/v1/completions", json={"prompt": "one more", "max_tokens": 2})
        check_error(refused, 429)
        assert int(refused.headers["Retry-After"]) >= 1
    finally:
        release.set()
    for thread in threads:
        thread.join()
    assert [r.status_code for r in answers] == [200, 200]
    assert all(len(r.json()["choices"]) == MAX_QUEUE // 2 for r in answers)


def test_client_disconnecting_mid_stream_frees_its_slot(http):
    cancelled = health(http)["requests"]["cancelled"]
    body = {"prompt": "Once", "max_tokens": CFG.seq - 8, "temperature": 0, "stream": True}
    with http.stream("POST", "/v1/completions", json=body) as response:
        next(line for line in response.iter_lines() if line.startswith("data: {"))
    wait_for(http, lambda s: s["slots"]["busy"] == 0 and s["requests"]["cancelled"] == cancelled + 1)


def test_client_disconnecting_from_a_non_streamed_request_frees_its_slot(engine, http, url):
    """The engine is held (by calls that wait) so that the request sits in its slot when the client goes away; once
    let go, the engine frees the slot before its next decode step."""
    cancelled = health(http)["requests"]["cancelled"]
    body = json.dumps({"prompt": "Once", "max_tokens": CFG.seq - 8, "temperature": 0}).encode()
    host, port = url.removeprefix("http://").split(":")
    first, second = threading.Event(), threading.Event()
    held = [engine.call(first.wait)]
    try:
        with socket.create_connection((host, int(port))) as client:
            client.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                           b"Authorization: Bearer " + KEY.encode() + b"\r\nContent-Length: "
                           + str(len(body)).encode() + b"\r\n\r\n" + body)
            wait_for(http, lambda s: s["queue"]["waiting"] + s["slots"]["busy"] == 1)
            held.append(engine.call(second.wait))  # the engine's next round admits the request, then waits here
            first.set()
            wait_for(http, lambda s: s["slots"]["busy"] == 1)
        deadline = time.monotonic() + 60
        while not any(slot is not None and slot.request.cancelled.is_set() for slot in engine._slots):
            assert time.monotonic() < deadline, "the server never cancelled the request"
            time.sleep(0.01)
    finally:  # the shared engine is let go whatever happened, so a failure here stays this test's
        first.set()
        second.set()
    for future in held:
        future.result(timeout=60)
    wait_for(http, lambda s: s["slots"]["busy"] == 0 and s["requests"]["cancelled"] == cancelled + 1)


def test_eos_ends_a_completion_with_finish_reason_stop(params, tokenizer, engine, offline, programs):
    first = offline[0].tokens[0]  # treat the first greedy token as the end of text: nothing is generated
    eos_engine = serving.Engine(layout(), params, tokenizer, programs=programs, max_batch=4, stop_token_ids=[first])
    events = []
    done = threading.Event()
    request = GenerationRequest(tokenizer.encode(PROMPTS[0]), NEW, lambda e: (events.append(e), done.set()),
                                        temperature=0.0)
    eos_engine.submit([request])
    assert done.wait(60)
    eos_engine.close()
    assert events == [Event("", (), (), "stop")]


def test_requests_ending_early_on_a_stop_token_free_their_slots_for_the_next(params, tokenizer, offline,
                                                                            programs):
    """The engine reads a step's tokens after dispatching the next one: a request that ends on a stop token has one
    more token in flight, which must be dropped, and its slot must serve the next request correctly."""
    stop = offline[0].tokens[5]
    engine = serving.Engine(layout(), params, tokenizer, programs=programs, max_batch=4, max_queue=len(PROMPTS),
                            stop_token_ids=[stop])
    events = {}
    done = threading.Semaphore(0)

    def collect(i):
        def on_event(event):
            events.setdefault(i, []).append(event)
            if event.finish_reason or event.error:
                done.release()
        return on_event

    engine.submit([GenerationRequest(tokenizer.encode(p), NEW, collect(i), temperature=0.0, logprobs=False)
                   for i, p in enumerate(PROMPTS)])
    for _ in PROMPTS:
        assert done.acquire(timeout=120)
    engine.close()
    stopped = 0
    for i, result in enumerate(offline):
        expected = result.tokens[:result.tokens.index(stop)] if stop in result.tokens else result.tokens
        assert [t for e in events[i] for t in e.tokens] == expected
        assert events[i][-1].finish_reason == ("stop" if stop in result.tokens else "length")
        stopped += stop in result.tokens
    assert stopped >= 1


def run_engine(engine, prompts, max_tokens, *, each=None, **request):
    """Each prompt's greedy tokens from this engine, all submitted at once (with `request`'s values, and prompt i's
    own in each[i] where given: prompt i's seed i where they sample)."""
    tokens, done = {}, threading.Semaphore(0)
    request = {"temperature": 0.0, "logprobs": False, **request}
    each = each or [{}] * len(prompts)

    def collect(i):
        def on_event(event):
            assert event.error is None
            tokens.setdefault(i, []).extend(event.tokens)
            if event.finish_reason:
                done.release()
        return on_event

    engine.submit([GenerationRequest(p, max_tokens, collect(i), seed=i, **{**request, **each[i]})
                   for i, p in enumerate(prompts)])
    for _ in prompts:
        assert done.acquire(timeout=120)
    return [tokens[i] for i in range(len(prompts))]


def test_penalties_and_logit_bias_on_the_device_equal_a_numpy_greedy_reference(params, tokenizer, programs):
    """On dp2 x mp4, each row with its own penalties and bias: every greedy token is the argmax of the full
    forward's logits adjusted in NumPy by OpenAI's rule (counts over the completion's tokens so far)."""
    forward = jax.jit(lambda p, ids: gptj.forward(p, ids, CFG, policy=CPU_POLICY))
    rows = [{"presence_penalty": 2.0, "frequency_penalty": 0.0, "logit_bias": {}},
            {"presence_penalty": 0.0, "frequency_penalty": 2.0, "logit_bias": {17: 3.0, 101: 5.0}},
            {"presence_penalty": -1.0, "frequency_penalty": 1.0, "logit_bias": {5: -100.0}},
            {"presence_penalty": 0.0, "frequency_penalty": 0.0, "logit_bias": {}}]
    prompts = [[3, 4, 5], [9, 10, 11, 12], [5, 6], [100, 200, 300]]
    expected = []
    for prompt, row in zip(prompts, rows):
        tokens = []
        for _ in range(6):
            ids = np.zeros((1, CFG.seq), np.int32)
            ids[0, :len(prompt + tokens)] = prompt + tokens
            logits = np.asarray(forward(params, ids))[0, len(prompt + tokens) - 1].astype(np.float64)
            counts = np.bincount(tokens, minlength=CFG.n_vocab)
            logits -= counts * row["frequency_penalty"] + (counts > 0) * row["presence_penalty"]
            for token, value in row["logit_bias"].items():
                logits[token] += value
            tokens.append(int(np.argmax(logits)))
        expected.append(tokens)
    engine = serving.Engine(layout(), params, tokenizer, programs=programs, max_batch=4, prefix_cache=False)
    got, done = {}, threading.Semaphore(0)

    def collect(i):
        def on_event(event):
            got.setdefault(i, []).extend(event.tokens)
            if event.finish_reason:
                done.release()
        return on_event

    engine.submit([GenerationRequest(p, 6, collect(i), temperature=0.0, **row)
                   for i, (p, row) in enumerate(zip(prompts, rows))])
    for _ in prompts:
        assert done.acquire(timeout=120)
    engine.close()
    assert [got[i] for i in range(4)] == expected
    assert len(set(expected[0])) == 6 and 5 not in expected[2]  # the presence penalty and the ban were felt


def test_prefix_cache_reuses_shared_prefixes_and_the_greedy_output_is_unchanged(params, tokenizer, programs):
    """On dp2 x mp4: requests sharing a 37-token prefix reuse its cached blocks (in the slot that holds them, or
    copied into another slot of the group) and compute only their tails; a follow-up turn reuses the prompt and the
    completion before it; every greedy completion equals the offline sampler's, which computes whole prompts."""
    rng = random.Random(0)
    shared = [rng.randrange(1, 1000) for _ in range(37)]
    first = [shared + [rng.randrange(1, 1000) for _ in range(1 + i % 5)] for i in range(10)]
    expected = sampling.Sampler(layout(), params, programs=programs).generate(first, 8, temperature=0.0)
    engine = serving.Engine(layout(), params, tokenizer, programs=programs, max_batch=4, max_queue=len(first))
    assert run_engine(engine, first[:1], 8) == [expected[0].tokens]  # one slot holds the prefix now
    assert run_engine(engine, first[1:], 8) == [r.tokens for r in expected[1:]]
    hits = engine.stats()["prefix_cache"]["hit_tokens"]
    assert hits >= 32 * (len(first) - 1 - 4)  # at least the requests that found the prefix in their group
    turn_1 = [2000 + i for i in range(20)]  # one block; with its 14 tokens' completion (13 written), two
    (answer,) = run_engine(engine, [turn_1], 14)
    turn_2 = [turn_1 + answer + [11]]
    again = sampling.Sampler(layout(), params, programs=programs).generate(turn_2, 6, temperature=0.0)
    assert run_engine(engine, turn_2, 6) == [again[0].tokens]
    assert engine.stats()["prefix_cache"]["hit_tokens"] - hits == 32
    engine.close()
    off = serving.Engine(layout(), params, tokenizer, programs=programs, max_batch=4, max_queue=len(first),
                         prefix_cache=False)
    assert run_engine(off, first, 8) == [r.tokens for r in expected]
    assert off.stats()["prefix_cache"] == {"enabled": False, "queried_tokens": 0, "hit_tokens": 0}
    off.close()


@pytest.mark.parametrize("pages", [None, 32])
def test_a_finished_requests_cached_prompt_is_intact_after_steps_it_sat_through(params, tokenizer, programs, pages):
    """A request whose last token is in flight sits through the next decode step (another request still runs) and
    writes nowhere it holds: a later request reusing its cached prompt (a slot's blocks, or its named pages) makes
    the offline sampler's greedy tokens and log-probs, on dp2 x mp4."""
    rng = random.Random(3)
    shared = [rng.randrange(1, 1000) for _ in range(32)]
    other = [rng.randrange(1, 1000) for _ in range(5)]
    later = shared + [rng.randrange(1, 1000) for _ in range(3)]
    expected = sampling.Sampler(layout(), params, programs=programs).generate([later], 6, temperature=0.0,
                                                                             return_logprobs=True)
    engine = serving.Engine(layout(), params, tokenizer, programs=programs, max_batch=2, max_queue=4,
                            **({"n_pages": pages, "page_size": 8} if pages else {}))
    events, done = collections.defaultdict(list), threading.Semaphore(0)

    def collect(i):
        def on_event(event):
            events[i].append(event)
            if event.finish_reason:
                done.release()
        return on_event

    engine.submit([GenerationRequest(shared, 2, collect(0), temperature=0.0),
                   GenerationRequest(other, 20, collect(1), temperature=0.0)])
    assert done.acquire(timeout=120) and done.acquire(timeout=120)
    engine.submit([GenerationRequest(later, 6, collect(2), temperature=0.0)])
    assert done.acquire(timeout=120)
    assert [t for e in events[2] for t in e.tokens] == expected[0].tokens
    np.testing.assert_allclose([p for e in events[2] for p in e.logprobs], expected[0].logprobs, atol=1e-4)
    assert engine.stats()["prefix_cache"]["hit_tokens"] >= 32
    # Closed, the engine gives its cache back to the devices (the next engine can take that memory).
    cache = (programs.abstract_pages(pages, 8) if pages
             else programs.abstract_cache(engine.n_slots, list(engine.schedule.block_sizes)))
    held = live_bytes()
    engine.close()
    assert held - live_bytes() >= sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(cache))


def test_busy_slots_move_down_so_decode_steps_compute_the_rows_they_need(params, tokenizer, programs, monkeypatch):
    """Paged, on dp2 x mp4, 16 slots a group (steps of 1, 4 or 16 rows): 12 requests take local slots 0-5 of each
    group; once the 8 short ones end, the 4 long ones (at 4 and 5) move to 0 and 1 with their pages, device rows and
    tokens in flight, and the steps compute 4 rows, not 16. Every request's greedy tokens and log-probs are the
    offline sampler's."""
    rows, paged_decode = [], programs.paged_decode
    monkeypatch.setattr(programs, "paged_decode", lambda *a, **k: (rows.append(k["rows"]), paged_decode(*a, **k))[1])
    prompts = [list(range(3 + i, 10 + i)) for i in range(12)]
    new = [3] * 8 + [16] * 4
    sampler = sampling.Sampler(layout(), params, programs=programs)
    expected = (sampler.generate(prompts[:8], 3, temperature=0.0, return_logprobs=True)
                + sampler.generate(prompts[8:], 16, temperature=0.0, return_logprobs=True))
    engine = serving.Engine(layout(), params, tokenizer, programs=programs, max_batch=32, max_queue=32, n_pages=128,
                            page_size=8)
    events, done = collections.defaultdict(list), threading.Semaphore(0)

    def collect(i):
        def on_event(event):
            assert event.error is None
            events[i].append(event)
            if event.finish_reason:
                done.release()
        return on_event

    engine.submit([GenerationRequest(p, n, collect(i), temperature=0.0) for i, (p, n) in enumerate(zip(prompts, new))])
    for _ in prompts:
        assert done.acquire(timeout=120)
    engine.close()
    for i, want in enumerate(expected):
        assert [t for e in events[i] for t in e.tokens] == want.tokens
        np.testing.assert_allclose([p for e in events[i] for p in e.logprobs], want.logprobs, atol=1e-4)
    assert rows[0] == 16 and rows[-1] == 4


def live_bytes() -> int:
    gc.collect()
    return sum(x.nbytes for x in jax.live_arrays())


@pytest.mark.parametrize("prompt, max_tokens", [([], 4), ([1] * CFG.seq, 1), ([1], CFG.seq), ([CFG.n_vocab], 1),
                                                ([1], 0)], ids=["empty", "no-room", "too-many", "bad-id", "zero"])
def test_engine_refuses_requests_that_cannot_run(engine, prompt, max_tokens):
    with pytest.raises(ValueError):
        engine.submit([GenerationRequest(prompt, max_tokens, lambda _event: None)])
    assert engine.error is None


def test_streamable_length_holds_back_stop_prefixes_and_partial_characters():
    assert streamable_length("Hello wor", ["world"]) == 6
    assert streamable_length("Hello", ["xyz"]) == 5
    assert streamable_length("ab\ufffd", []) == 2
    assert streamable_length("a\n\n", ["\n\n\n", "b"]) == 1
    assert streamable_length("", ["a"]) == 0


@pytest.mark.parametrize("flags, named", [(["--bogus"], "--bogus"), (["--kv-pages", "0"], "--kv-pages"),
                                          (["--kv-pages", "off", "--kv-cache-dtype", "int8"], "--kv-pages off"),
                                          (["--kv-pages", "many"], "--kv-pages"),
                                          (["--kv-pages", "off", "--kv-reserve"], "--kv-reserve"),
                                          (["--memory-fraction", "1.5"], "--memory-fraction")])
def test_device_serve_bad_flag_is_a_one_line_error(flags, named):
    result = subprocess.run([sys.executable, "device_serve.py", "--config", "configs/bench.json", *flags],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert result.stderr.strip().count("\n") == 0 and named in result.stderr


def test_slots_at_different_positions_across_uneven_cache_blocks_match_offline(params, tokenizer, programs):
    """Blocks of 24, 24 and 16 positions: two requests of different lengths cross block edges at different steps,
    side by side, and still make the offline sampler's greedy tokens."""
    engine = serving.Engine(layout(), params, tokenizer, programs=programs, max_batch=4, min_span=24)
    assert engine.schedule.block_sizes == (24, 24, 16)
    prompts = [tokenizer.encode(PROMPTS[0])[:3], tokenizer.encode(PROMPTS[5])[:16]]
    n_new = CFG.seq - 16
    got, logprobs, done = {}, {}, threading.Semaphore(0)

    def collect(i):
        def on_event(event):
            got.setdefault(i, []).extend(event.tokens)
            logprobs.setdefault(i, []).extend(event.logprobs)
            if event.finish_reason or event.error:
                done.release()
        return on_event

    engine.submit([GenerationRequest(p, n_new, collect(i), temperature=0.0, logprobs=i == 1)
                   for i, p in enumerate(prompts)])
    for _ in prompts:
        assert done.acquire(timeout=120)
    engine.close()
    sampler = sampling.Sampler(layout(), params, programs=programs)
    expected = sampler.generate(prompts, n_new, temperature=0.0, stop_token_ids=[], return_logprobs=True)
    assert [got[0], got[1]] == [r.tokens for r in expected]
    assert logprobs[0] == [] and len(logprobs[1]) == n_new  # only the request that asked gets them
    np.testing.assert_allclose(logprobs[1], expected[1].logprobs, atol=1e-4)


def hostile_requests(n: int, seed: int = 0):
    """(method, path, content bytes) of n generated hostile requests: every route and some that are not, every
    method, bodies of wrong types, broken JSON or UTF-8, lone surrogates, huge or negative numbers, deep nesting,
    chat messages of every wrong shape."""
    rng = random.Random(seed)
    atoms = [None, True, 0, -1, 2 ** 70, 1.5, -1e308, "", "x", "\ud800", "日本", [], {}, [1, "a"], {"a": None},
             "NaN", 65, [[1], [2 ** 40]], ["\udfff"], [[]], "\x00", {"role": "user", "content": "hi"},
             {"role": "tool", "content": None}, {"type": "text", "text": "\ud800"}, {"type": "image_url"}]
    fields = ["prompt", "context", "max_tokens", "length", "temperature", "temp", "top_p", "top_k", "n", "stream",
              "stop", "seed", "logprobs", "echo", "stream_options", "model", "suffix", "best_of", "user", "bogus",
              "messages", "max_completion_tokens", "top_logprobs", "tools", "response_format"]
    messages = [[{"role": "user", "content": "Hi"}], [{"role": "system", "content": ""}, {"role": "user"}],
                [{"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "image_url"}]}],
                [{"role": "assistant", "content": [], "name": 1}], [{"role": "developer", "content": "\ud83d"}]]

    def value(depth=0):
        if depth < 3 and rng.random() < 0.15:
            return [value(depth + 1) for _ in range(rng.randint(0, 3))]
        return rng.choice(atoms)

    def body() -> bytes:
        kind = rng.random()
        if kind < 0.1:
            return rng.choice([b"", b"{", b"[1,", b"\xff\xfe{}", b'{"prompt": "\xc3"}', b"null", b"[]", b"1e999",
                               b'{"prompt": "a"}' * 2, b"[" * 5000 + b"]" * 5000])
        obj = {rng.choice(fields): value() for _ in range(rng.randint(0, 5))}
        if rng.random() < 0.5:  # near-valid: most requests reach the field checks, a few run
            route = rng.random()
            if route < 0.3:
                obj.setdefault("messages", rng.choice(messages))
            else:
                obj.setdefault("prompt" if route < 0.75 else "context", rng.choice(["Hi", "\ud83d", [15496], ""]))
            obj["length" if "context" in obj else "max_tokens"] = rng.choice([1, 2, 0, -3, 10 ** 9, "2", None])
        return json.dumps(obj).encode("utf-8", "surrogatepass")

    paths = ["/complete", "/v1/completions", "/v1/chat/completions", "/v1/chat/completions", "/v1/models", "/health",
             "/metrics", "/", "/v1", "/v1/completions/x", "/%ff"]
    for _ in range(n):
        yield rng.choice(["POST", "POST", "POST", "GET", "PUT", "DELETE", "PATCH"]), rng.choice(paths), body()


def test_1000_hostile_requests_get_4xx_json_and_the_server_stays_well(http, offline):
    statuses = collections.Counter()
    for method, path, content in hostile_requests(1000):
        response = http.request(method, path, content=content, headers={"Content-Type": "application/json"})
        statuses[response.status_code] += 1
        assert response.status_code < 500, (method, path, content[:200], response.text)
        if response.status_code >= 400:
            check_error(response)
        elif response.headers["content-type"].startswith("application/json"):
            response.json()
    assert sum(n for status, n in statuses.items() if status >= 400) > 900, statuses
    assert health(http)["slots"]["busy"] == 0
    response = http.post("/complete", json={"context": PROMPTS[0], "top_p": 0.9, "temp": 0, "length": NEW})
    assert response.status_code == 200 and response.json()["completion"] == offline[0].text


@pytest.mark.parametrize("cache", ["slots", "pages"])
def test_warm_up_compiles_every_program_ahead_and_serving_compiles_no_more(params, tokenizer, offline, cache):
    """A warmed-up engine (its own programs, so the count starts at 0) serves prompts of every bucket, one at a
    time and many together, across both cache blocks (or 1 to 4 pages), whole and after a cached prefix (the long
    prompts share one), without compiling again; its greedy answers are the offline sampler's."""
    programs = Programs(layout())
    paged = {"n_pages": 32, "page_size": 16} if cache == "pages" else {}
    engine = serving.Engine(layout(), params, tokenizer, programs=programs, max_batch=4, warm_up=True, **paged)
    # Ready: every program compiled.
    assert engine.warmed.is_set() and not any(programs.compile(*p) for p in engine.programs())
    compiled = programs.traces
    # Prefill: rows {1, 2} x buckets {16, 32, 64}, whole and after a cached prefix (paged: a row a group); decode:
    # rows x blocks {1, 2} (pages read {1, 2, 4}); paged, the slots' moves.
    assert compiled == len(engine.programs()) == (2 * 3 + 3 + 2 * 3 + 1 if paged else 2 * 3 * 2 + 2 * 2)
    prompts = [tokenizer.encode(p) for p in PROMPTS[:5]]
    long_prompts = [list(range(100, 100 + n)) for n in (20, 40, 63)]
    got, done = {}, threading.Semaphore(0)

    def collect(i):
        def on_event(event):
            got.setdefault(i, []).extend(event.tokens)
            if event.finish_reason or event.error:
                done.release()
        return on_event

    batches = [[(0, prompts[0], NEW)], [(i, p, NEW) for i, p in enumerate(prompts) if i],
               *[[(5 + i, p, CFG.seq - len(p))] for i, p in enumerate(long_prompts)]]
    for batch in batches:
        engine.submit([GenerationRequest(p, n, collect(i), temperature=0.0) for i, p, n in batch])
        for _ in batch:
            assert done.acquire(timeout=120)
    assert engine.stats()["prefix_cache"]["hit_tokens"] == 16 + 32  # the 40- and 63-token prompts' cached blocks
    engine.close()
    assert programs.traces == compiled
    assert [tokenizer.decode(got[i]) for i in range(5)] == [r.text for r in offline[:5]]
    assert [len(got[5 + i]) for i in range(3)] == [CFG.seq - len(p) for p in long_prompts]
    if paged:  # every page back: free, or cached under its name
        assert engine.stats()["pages"] == {"total": 32, "available": 32, "page_size": 16}


def test_paged_engine_waits_for_pages_reuses_shared_prefix_pages_and_keeps_the_greedy_output(params, tokenizer,
                                                                                           programs):
    """On dp2 x mp4 with pages for only a few requests at once: ten requests sharing a 37-token prefix (two full
    pages of 16) wait for pages rather than fail, reuse the prefix's pages in the group that holds them, and make
    the offline sampler's greedy tokens; a request that could never get its pages is refused at once."""
    rng = random.Random(0)
    shared = [rng.randrange(1, 1000) for _ in range(37)]
    first = [shared + [rng.randrange(1, 1000) for _ in range(1 + i % 5)] for i in range(10)]
    expected = sampling.Sampler(layout(), params, programs=programs).generate(first, 8, temperature=0.0)
    # 8 pages a group: a 38-42 + 8 token request holds 4 pages alone, 2 more beside one sharing its prefix.
    engine = serving.Engine(layout(), params, tokenizer, programs=programs, max_batch=8, max_queue=len(first),
                            n_pages=16, page_size=16)
    assert run_engine(engine, first[:1], 8) == [expected[0].tokens]
    assert run_engine(engine, first[1:], 8) == [r.tokens for r in expected[1:]]
    stats = engine.stats()
    assert stats["prefix_cache"]["hit_tokens"] >= 32 * 5 and stats["pages"]["available"] == 16
    engine.close()
    small = serving.Engine(layout(), params, tokenizer, programs=programs, n_pages=4, page_size=16)
    with pytest.raises(ValueError, match="need 4 cache pages of 16 tokens; the cache has 2 per dp group"):
        small.submit([GenerationRequest([1] * 60, 4, lambda event: None)])
    small.close()
    with pytest.raises(config.ConfigError, match="multiple of the data-parallel size 2"):
        serving.Engine(layout(), params, tokenizer, programs=programs, n_pages=5)


@pytest.mark.parametrize("prefix_cache", [True, False])
def test_paged_engine_preempts_the_latest_request_when_pages_run_out_and_its_output_is_unchanged(
        params, tokenizer, programs, prefix_cache, caplog):
    """On dp2 x mp4 with 8 pages of 8 tokens a group, eight requests of 9-16 prompt tokens and 24 new (up to 5 pages
    each) are admitted on their prompts' pages and grow until a group runs out: its latest admitted request is
    preempted (a warning says so) and later resumes from its prompt and tokens so far. Greedy and seeded sampled
    tokens (streamed) equal those of an engine with room for all (the offline sampler's, greedy); with
    `reserve_pages` none is preempted; a request with penalties holds all its pages from the start (never preempted)
    and its tokens equal its own alone."""
    rng = random.Random(2)
    prompts = [[rng.randrange(1, 1000) for _ in range(9 + i)] for i in range(8)]
    expected = [r.tokens for r in sampling.Sampler(layout(), params, programs=programs).generate(prompts, 24,
                                                                                                  temperature=0.0)]

    def paged(n_pages, **kw):
        return serving.Engine(layout(), params, tokenizer, programs=programs, max_batch=8, max_queue=16,
                              n_pages=n_pages, page_size=8, prefix_cache=prefix_cache, **kw)

    roomy = paged(64)
    sampled = run_engine(roomy, prompts, 24, temperature=1.0, top_k=4)
    penalties = {"presence_penalty": 1.5, "frequency_penalty": 0.5}
    penalized = run_engine(roomy, prompts[:1], 24, **penalties)
    assert roomy.stats()["requests"]["preempted"] == 0
    roomy.close()
    tight = paged(16)
    assert run_engine(tight, prompts, 24) == expected
    assert tight.stats()["requests"]["preempted"] > 0
    assert "a request was preempted for want of KV-cache pages (1 so far)" in caplog.text
    preempted = tight.stats()["requests"]["preempted"]
    assert run_engine(tight, prompts, 24, temperature=1.0, top_k=4, stream=True) == sampled  # (streamed on)
    assert tight.stats()["requests"]["preempted"] > preempted
    # the penalized request (first admitted, holding all its pages) beside the others, preempted around it
    assert run_engine(tight, prompts, 24, each=[penalties] + [{}] * 7) == penalized + expected[1:]
    stats = tight.stats()
    tight.close()
    assert stats["pages"]["available"] == 16 and stats["slots"]["busy"] == 0 and stats["queue"]["waiting"] == 0
    reserved = paged(16, reserve_pages=True)
    assert run_engine(reserved, prompts, 24) == expected
    assert reserved.stats()["requests"]["preempted"] == 0
    reserved.close()


def test_paged_engine_with_preemption_cancellation_and_shared_prefixes_keeps_every_output_and_page(
        params, tokenizer, programs):
    """On dp2 x mp4 with 8 pages of 8 tokens a group and the prefix cache: 16 streamed requests submitted at once,
    half sharing a 20-token prefix, of 1 to 24 new tokens, three cancelled at their first event: the others make the
    offline sampler's greedy tokens while requests are preempted and resumed around them, and every slot and page
    comes back."""
    rng = random.Random(4)
    shared = [rng.randrange(1, 1000) for _ in range(20)]
    prompts = [(shared if i % 2 else []) + [rng.randrange(1, 1000) for _ in range(3 + i % 7)] for i in range(16)]
    lengths = [1 + 5 * i % 24 for i in range(16)]
    full = sampling.Sampler(layout(), params, programs=programs).generate(prompts, 24, temperature=0.0)
    engine = serving.Engine(layout(), params, tokenizer, programs=programs, max_batch=8, max_queue=16, n_pages=16,
                            page_size=8)
    cancelled, got, done = {3, 8, 13}, collections.defaultdict(list), threading.Semaphore(0)
    requests = []

    def collect(i):
        def on_event(event):
            assert event.error is None
            got[i].extend(event.tokens)
            if i in cancelled:
                engine.cancel([requests[i]])
            elif event.finish_reason:
                done.release()
        return on_event

    requests.extend(GenerationRequest(p, n, collect(i), temperature=0.0, stream=True, logprobs=False)
                    for i, (p, n) in enumerate(zip(prompts, lengths)))
    engine.submit(requests)
    for _ in range(len(prompts) - len(cancelled)):
        assert done.acquire(timeout=120)
    deadline = time.monotonic() + 60
    while (stats := engine.stats())["slots"]["busy"] or stats["queue"]["waiting"]:
        assert time.monotonic() < deadline, stats
        time.sleep(0.01)
    engine.close()
    assert {i: got[i] for i in range(16) if i not in cancelled} == {
        i: full[i].tokens[:lengths[i]] for i in range(16) if i not in cancelled}
    assert all(got[i] == full[i].tokens[:len(got[i])] for i in cancelled)
    assert stats["pages"]["available"] == 16 and stats["requests"]["preempted"] > 0
    assert stats["requests"]["completed"] == 13 and stats["requests"]["cancelled"] == 3


@pytest.mark.parametrize("prefix_cache", [True, False])
def test_paged_engine_prefills_long_prompts_in_pieces_with_the_greedy_output(params, tokenizer, programs,
                                                                           monkeypatch, prefix_cache):
    """With pieces of 16 tokens (the chunk a paged engine prefills a row in), prompts of 5 to 60 tokens, two sharing
    a 37-token prefix, make the offline sampler's greedy tokens on dp2 x mp4, every page given back; no prefill
    program is wider than a piece."""
    monkeypatch.setattr(schedule, "PREFILL_CHUNK", 16)
    rng = random.Random(1)
    shared = [rng.randrange(1, 1000) for _ in range(37)]
    prompts = [[rng.randrange(1, 1000) for _ in range(n)] for n in (5, 17, 40, 60)] + [shared + [7], shared + [9, 4]]
    expected = sampling.Sampler(layout(), params, programs=programs).generate(prompts, 4, temperature=0.0)
    engine = serving.Engine(layout(), params, tokenizer, programs=programs, max_batch=4, max_queue=len(prompts),
                            n_pages=32, page_size=8, prefix_cache=prefix_cache)
    assert engine.schedule.chunk == 16 and max(engine.schedule.prefill_rows) == 16
    assert run_engine(engine, prompts[:4], 4) == [r.tokens for r in expected[:4]]
    assert run_engine(engine, prompts[4:5], 4) == [expected[4].tokens]
    assert run_engine(engine, prompts[5:], 4) == [expected[5].tokens]
    stats = engine.stats()
    engine.close()
    assert stats["pages"]["available"] == 32
    assert stats["prefix_cache"]["hit_tokens"] == (32 if prefix_cache else 0)  # the shared prefix's 4 full pages


def test_server_keeps_idle_connections_past_the_clients_expiry_and_still_stops_at_once():
    """A client drops an idle pooled connection after its keep-alive expiry (httpx's, the openai client's: 5 s); a
    server closing at that same moment races a reuse ("connection reset"), so the server's is longer. Stopping the
    server does not wait for a client's idle connection."""
    from fastapi import FastAPI

    app = FastAPI()
    app.get("/ping")(lambda: {"ok": True})
    running = server.BackgroundServer(app)
    assert running.server.config.timeout_keep_alive > httpx.Limits().keepalive_expiry
    with httpx.Client() as client:
        with running:
            assert client.get(f"{running.url}/ping").json() == {"ok": True}
            start = time.monotonic()  # the client holds its idle connection as the server stops
        assert not running._thread.is_alive() and time.monotonic() - start < 5
