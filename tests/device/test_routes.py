"""The server's HTTP routes over the chip's engine, with no socket: a chip's machine may allow none (on the lent v5e,
binding or connecting even to 127.0.0.1 fails). Starlette's TestClient calls the app as ASGI on an event loop of its
own thread: it hands a streamed body over piece by piece as the app sends it, and closing a stream mid-way cancels
the app's task, as a server does when its client goes away (httpx's ASGITransport buffers the whole response).

In f32 at full precision the routes' greedy text is the CPU's offline sampler's on the same weights. The prompts are
token ids (and the chat message text) below the model's 1,024-token vocabulary."""
import contextlib
import json
import threading
import time
from collections.abc import Iterator

import jax
import numpy as np
import pytest

from mesh_transformer.infer.params import make_inference_layout
from mesh_transformer.infer.sampler import Sampler
from mesh_transformer.parallel.mesh import make_dp_mp
from mesh_transformer.serve.engine import Engine
from mesh_transformer.serve.server import create_app
from mesh_transformer.tokenizer import load_tokenizer
from tests.device.model import CFG, trained_scale_params
from tests.device.test_serving import F32, RTOL_F32

from starlette.testclient import TestClient  # in-process, no socket: needs httpx (requirements.txt)

NEW = 12
PROMPTS = [[464, 3, 977, 21, 640, 88, 13, 501, 7], [12, 845, 0, 330, 76, 1001, 5, 260, 419, 64, 38, 700, 2, 95]]
CHAT_TEMPLATE = "{% for message in messages %}{{ message['content'] }}\n{% endfor %}"
MESSAGES = [{"role": "system", "content": "I think so"}, {"role": "user", "content": "A man had it all"}]
CHAT_PROMPT = [40, 892, 523, 198, 32, 582, 550, 340, 477, 198]  # GPT-2's tokens of CHAT_TEMPLATE over MESSAGES


@pytest.fixture(scope="module")
def params():
    return trained_scale_params(CFG)


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer()


@pytest.fixture(scope="module")
def served(params, tokenizer, chip) -> Iterator[tuple[Engine, TestClient]]:
    """An f32 engine on the chip (4 slots) and a client of the app over it."""
    engine = Engine(make_inference_layout(F32, mesh=make_dp_mp(1, 1, [chip])), params, tokenizer, max_batch=4,
                    max_queue=8, stop_token_ids=())
    app = create_app(engine, tokenizer, model_name="device-tier", chat_template=CHAT_TEMPLATE)
    try:
        with TestClient(app) as client:
            yield engine, client
    finally:
        engine.close()


@pytest.fixture(scope="module")
def offline(params, host):
    """The CPU sampler's greedy results (f32, full precision) for PROMPTS and then CHAT_PROMPT, NEW tokens each."""
    sampler = Sampler(make_inference_layout(F32, mesh=make_dp_mp(1, 1, [host])), params)
    with jax.default_matmul_precision("highest"):
        return sampler.generate([*PROMPTS, CHAT_PROMPT], NEW, temperature=0.0, stop_token_ids=[],
                                return_logprobs=True)


def test_completions_route_on_the_chip_answers_the_cpus_greedy_text(served, offline, tokenizer, highest_precision):
    _, client = served
    response = client.post("/v1/completions", json={"prompt": PROMPTS, "max_tokens": NEW, "temperature": 0,
                                                     "logprobs": 0})
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["usage"] == {"prompt_tokens": sum(map(len, PROMPTS)), "completion_tokens": NEW * len(PROMPTS),
                             "total_tokens": sum(map(len, PROMPTS)) + NEW * len(PROMPTS)}
    for choice, expected in zip(body["choices"], offline[:len(PROMPTS)], strict=True):
        assert choice["text"] == tokenizer.decode(expected.tokens) and choice["finish_reason"] == "length"
        got, want = np.array(choice["logprobs"]["token_logprobs"]), np.array(expected.logprobs)
        assert np.abs(got - want).max() <= RTOL_F32 * np.abs(want).max()


def test_chat_route_on_the_chip_completes_the_rendered_messages(served, offline, tokenizer, highest_precision):
    assert tokenizer.encode("I think so\nA man had it all\n") == CHAT_PROMPT
    _, client = served
    response = client.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": NEW, "temperature": 0})
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["object"] == "chat.completion" and body["usage"]["prompt_tokens"] == len(CHAT_PROMPT)
    choice = body["choices"][0]
    assert choice["message"] == {"role": "assistant", "content": tokenizer.decode(offline[-1].tokens)}
    assert choice["finish_reason"] == "length"


def streamed(response) -> list[dict | str]:
    """A server-sent event stream's data, each JSON object parsed ("[DONE]" as it is)."""
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
    data = [line.removeprefix("data: ") for line in response.iter_lines() if line]
    return [json.loads(d) if d != "[DONE]" else d for d in data]


def test_a_streamed_completion_on_the_chip_comes_in_pieces_of_the_greedy_text(served, offline, tokenizer,
                                                                              highest_precision):
    _, client = served
    body = {"prompt": PROMPTS[0], "max_tokens": NEW, "temperature": 0, "stream": True}
    with client.stream("POST", "/v1/completions", json=body) as response:
        *chunks, done = streamed(response)
    assert done == "[DONE]" and len(chunks) > 2
    assert "".join(c["choices"][0]["text"] for c in chunks) == tokenizer.decode(offline[0].tokens)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


@contextlib.contextmanager
def slowed(engine: Engine, pause_s: float) -> Iterator[None]:
    """The engine taking at least `pause_s` a decode step while inside: a call between two steps that sleeps and
    queues itself again, so a request's tokens outlast the client's reading of the first."""
    slowing = threading.Event()
    slowing.set()

    def pause() -> None:
        time.sleep(pause_s)
        if slowing.is_set():
            engine.call(pause)

    engine.call(pause)
    try:
        yield
    finally:
        slowing.clear()


def test_a_stream_closed_mid_way_on_the_chip_frees_its_slot(served):
    engine, client = served
    before = engine.stats()["requests"]
    body = {"prompt": PROMPTS[0], "max_tokens": CFG.seq - len(PROMPTS[0]), "temperature": 0, "stream": True}
    with slowed(engine, pause_s=0.05):
        with client.stream("POST", "/v1/completions", json=body) as response:
            assert next(line for line in response.iter_lines() if line).startswith("data: {")
            assert engine.stats()["slots"]["busy"] == 1
    deadline = time.monotonic() + 60
    while (stats := engine.stats())["slots"]["busy"] or stats["requests"]["cancelled"] == before["cancelled"]:
        assert time.monotonic() < deadline, f"the closed stream's request never left its slot: {stats}"
        time.sleep(0.01)
    assert stats["requests"] == {**before, "cancelled": before["cancelled"] + 1}
