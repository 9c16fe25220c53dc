"""The HTTP front of the serving engine (FastAPI + uvicorn): OpenAI-compatible /v1/completions and
/v1/chat/completions (streamed as server-sent events too) and /v1/models, the original /complete, /health and
Prometheus /metrics. Handlers only validate, enqueue and stream; the engine's thread owns the device, and its events
reach the event loop through call_soon_threadsafe (timed on the way, serve/metrics.py).
"""
from __future__ import annotations

import asyncio
import dataclasses
import hmac
import json
import logging
import socket
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from functools import partial
from typing import Any

import uvicorn
from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from mesh_transformer.infer.score import Scorer
from mesh_transformer.serve import api, chat
from mesh_transformer.serve.adapters import AdapterSlots, add_adapter_routes
from mesh_transformer.serve.echo import Scoring, echoed, scored
from mesh_transformer.serve.api import ApiError, CompletionParams
from mesh_transformer.serve.completion import Event, GenerationRequest
from mesh_transformer.serve.engine import Engine, EngineStopped, QueueFull
from mesh_transformer.serve.metrics import CONTENT_TYPE, ServingMetrics

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 1 << 20
RETRY_AFTER_S = 1
_ERROR_TYPES = {401: "invalid_request_error", 404: "invalid_request_error", 405: "invalid_request_error",
                413: "invalid_request_error", 429: "rate_limit_error", 503: "server_error"}


class _Job:
    """The engine requests behind one HTTP request (prompts x n); their events are timed for the metrics where they
    are made and arrive on the event loop's queue."""

    def __init__(self, engine: Engine, params: CompletionParams, metrics: ServingMetrics,
                 adapters: AdapterSlots | None = None):
        self.engine, self.events_queue, loop = engine, asyncio.Queue(), asyncio.get_running_loop()
        n = len(params.prompts) * params.n
        # The adapter the request names holds its slot until every choice has ended (`release`).
        self.adapters, (self.slot, key) = adapters, adapters.acquire(params.model, n) if adapters else (-1, 0)
        self.requests = [
            GenerationRequest(list(prompt), params.max_tokens, partial(self._deliver, loop, index),
                              temperature=params.temperature, top_k=params.top_k, top_p=params.top_p,
                              seed=params.seed + index, stop=params.stop, stream=params.stream,
                              logprobs=params.logprobs is not None, presence_penalty=params.presence_penalty,
                              frequency_penalty=params.frequency_penalty, logit_bias=dict(params.logit_bias),
                              adapter=self.slot, adapter_key=key)
            for index, prompt in enumerate(p for p in params.prompts for _ in range(params.n))]
        model = params.model if self.slot >= 0 else None
        self.timers = [metrics.timer(request, model) for request in self.requests]
        self._released = False

    def _deliver(self, loop: asyncio.AbstractEventLoop, index: int, event: Event) -> None:
        self.timers[index].on_event(event)
        loop.call_soon_threadsafe(self.events_queue.put_nowait, (index, event))

    def submit(self) -> None:
        try:
            self.engine.submit(self.requests)
        except QueueFull as e:
            self.release()
            raise ApiError(429, f"{e}; please retry shortly", type="rate_limit_error", code="rate_limit_exceeded",
                           headers={"Retry-After": str(RETRY_AFTER_S)}) from None
        except EngineStopped as e:
            self.release()
            raise ApiError(503, str(e), type="server_error") from None
        except BaseException:
            self.release()
            raise

    async def events(self) -> AsyncIterator[tuple[int, Event]]:
        """(choice index, event) until every choice has finished; an engine error ends them all."""
        running = len(self.requests)
        while running:
            index, event = await self.events_queue.get()
            yield index, event
            if event.error:
                return
            running -= event.finish_reason is not None

    def cancel(self) -> None:
        """Ends the job: its requests stop (a no-op for those finished) and its adapter slot is released."""
        self.engine.cancel(self.requests)
        self.release()

    def release(self) -> None:
        if self.adapters is not None and not self._released:
            self._released = True
            self.adapters.release(self.slot, len(self.requests))


async def _read_body(request: Request, limit: int) -> bytes:
    """The body, refused with 413 past `limit` bytes (by Content-Length, then by the bytes actually read)."""
    declared = request.headers.get("content-length")
    if declared is not None and not declared.isdigit():
        raise ApiError(400, "Content-Length must be a number of bytes")
    if declared is not None and int(declared) > limit:
        raise ApiError(413, f"The request body is {declared} bytes; at most {limit} are accepted")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise ApiError(413, f"The request body is over {limit} bytes; at most {limit} are accepted")
        chunks.append(chunk)
    return b"".join(chunks)


async def _until_disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _authorizer(api_key: str | None) -> Callable[[Request], None]:
    """A route dependency: with an api_key, the request must carry `Authorization: Bearer <api_key>`."""
    def check_key(request: Request) -> None:
        if api_key is None:
            return
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not given.strip():
            raise ApiError(401, "You didn't provide an API key: send 'Authorization: Bearer YOUR_KEY'",
                           code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
        if not hmac.compare_digest(given.strip().encode(), api_key.encode()):
            raise ApiError(401, "Incorrect API key provided", code="invalid_api_key",
                           headers={"WWW-Authenticate": "Bearer"})

    return check_key


def _add_error_handlers(app: FastAPI) -> None:
    """Every error as OpenAI-style JSON: ours, the framework's (404, 405...) and unexpected ones (500)."""
    @app.exception_handler(ApiError)
    async def api_error(_: Request, e: ApiError) -> JSONResponse:
        return JSONResponse(e.body(), e.status, headers=e.headers)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, e: StarletteHTTPException) -> JSONResponse:
        kind = _ERROR_TYPES.get(e.status_code, "invalid_request_error" if e.status_code < 500 else "server_error")
        return JSONResponse(api.error_body(str(e.detail), kind), e.status_code, headers=e.headers)

    @app.exception_handler(Exception)
    async def server_error(_: Request, e: Exception) -> JSONResponse:
        log.exception("request failed")
        return JSONResponse(api.error_body("The server had an error while processing your request", "server_error"),
                            500)


async def _run(job: _Job, request: Request) -> tuple[list[Event], float] | None:
    """Submit the job: every choice's whole completion (one merged Event each) and the seconds taken, or None when
    the client went away first."""
    job.submit()
    start_s = time.perf_counter()

    async def collect() -> list[Event]:
        pieces: list[list[Event]] = [[] for _ in job.requests]
        async for index, event in job.events():
            if event.error:
                raise ApiError(503, event.error, type="server_error")
            pieces[index].append(event)
        return [Event("".join(e.text for e in p), sum((e.tokens for e in p), ()), sum((e.logprobs for e in p), ()),
                      p[-1].finish_reason, alternatives=sum((e.alternatives for e in p), ())) for p in pieces]

    collecting, watching = asyncio.ensure_future(collect()), asyncio.ensure_future(_until_disconnected(request))
    try:
        await asyncio.wait({collecting, watching}, return_when=asyncio.FIRST_COMPLETED)
        return (collecting.result(), time.perf_counter() - start_s) if collecting.done() else None
    finally:
        for task in (collecting, watching):
            task.cancel()
        job.cancel()  # frees the slots of a client that went away; a no-op once finished


async def _stream(job: _Job | None, params: CompletionParams, tokenizer: Any, meta: dict, prompt_tokens: int,
                  scoring: Scoring) -> AsyncIterator[dict | str]:
    """A streamed completion's data, ending with [DONE]; with echo, each prompt comes first."""
    n_choices = len(params.prompts) * params.n
    offsets, completion_tokens = [0] * n_choices, 0
    if params.echo:
        echoes = await echoed(scoring, params, tokenizer, [Event(finish_reason=None if job else "length")
                                                            for _ in range(n_choices)])
        for index, (event, alternatives) in enumerate(echoes):
            chunk = api.choice(index, event, tokenizer, params.logprobs, 0, alternatives)
            yield api.completion(**meta, choices=[chunk])
            offsets[index] = len(event.text)
    async for index, event in (job.events() if job else _nothing()):
        if event.error:
            yield api.error_body(event.error, "server_error")
            return
        event, alternatives = scored(event, [], None, False, params.logprobs)
        chunk = api.choice(index, event, tokenizer, params.logprobs, offsets[index], alternatives)
        offsets[index] += len(event.text)
        completion_tokens += len(event.tokens)
        yield api.completion(**meta, choices=[chunk])
    if params.include_usage:
        yield api.completion(**meta, choices=[], usage=api.usage(prompt_tokens, completion_tokens))
    yield "[DONE]"


async def _nothing() -> AsyncIterator[tuple[int, Event]]:
    for item in ():
        yield item


def _event_stream(data: AsyncIterator[dict | str], job: _Job | None) -> StreamingResponse:
    """Data as server-sent events; the job is cancelled when the stream ends or its client goes away (its slots
    are freed at the next step)."""
    async def events() -> AsyncIterator[str]:
        try:
            async for item in data:
                yield f"data: {json.dumps(item) if not isinstance(item, str) else item}\n\n"
        finally:
            if job:
                job.cancel()

    return StreamingResponse(events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


@dataclasses.dataclass(frozen=True)
class _Served:
    """What the generating routes share: the engine, its tokenizer and model name, the limits and the metrics."""
    engine: Engine
    tokenizer: Any
    model_name: str
    limits: api.Limits
    metrics: ServingMetrics
    max_body_bytes: int
    adapters: AdapterSlots | None = None

    async def body(self, request: Request) -> dict:
        return api.parse_json_object(await _read_body(request, self.max_body_bytes))

    def job(self, params: CompletionParams) -> _Job:
        return _Job(self.engine, params, self.metrics, self.adapters)

    def meta(self, id_prefix: str, params: CompletionParams | None = None) -> dict:
        """A response's id, time and model: the adapter it names, else the base (an unknown name: OpenAI's 404)."""
        served = self.adapters is not None and params is not None and params.model not in (None, self.model_name)
        if served:
            self.adapters.check(params.model)
        return {"id": f"{id_prefix}-{uuid.uuid4().hex}", "created": int(time.time()),
                "model": params.model if served else self.model_name}


def _add_completion_routes(app: FastAPI, served: _Served, authorized: list, scoring: Scoring) -> None:
    """/v1/completions and the original /complete."""
    tokenizer = served.tokenizer

    @app.post("/v1/completions", dependencies=authorized)
    async def completions(request: Request) -> Response:
        params = api.parse_completion(await served.body(request), tokenizer, served.limits)
        meta, prompt_tokens = served.meta("cmpl", params), sum(map(len, params.prompts))
        if params.stream:
            job = None
            if params.max_tokens > 0:
                job = served.job(params)
                job.submit()
            return _event_stream(_stream(job, params, tokenizer, meta, prompt_tokens, scoring), job)
        events = [Event(finish_reason="length")] * len(params.prompts) * params.n
        if params.max_tokens > 0:
            done = await _run(served.job(params), request)
            if done is None:
                return Response(status_code=499)  # nobody is listening
            events = done[0]
        usage = api.usage(prompt_tokens, sum(len(e.tokens) for e in events))
        choices = [api.choice(i, event, tokenizer, params.logprobs, 0, alternatives)
                   for i, (event, alternatives) in enumerate(await echoed(scoring, params, tokenizer, events))]
        return JSONResponse(api.completion(**meta, choices=choices, usage=usage))

    @app.post("/complete", dependencies=authorized)
    async def complete(request: Request) -> Response:
        """The original mesh-transformer-jax API: {"context", "top_p", "temp"[, "length"]} -> {"completion"}."""
        params = api.parse_complete(await served.body(request), tokenizer, served.limits)
        done = await _run(served.job(params), request)
        if done is None:
            return Response(status_code=499)
        events, compute_s = done
        return JSONResponse({"completion": events[0].text, "compute_time": compute_s})


def _add_chat_route(app: FastAPI, served: _Served, authorized: list, template: chat.ChatTemplate) -> None:
    """/v1/chat/completions: the messages rendered by the template, completed as one prompt."""
    tokenizer = served.tokenizer

    @app.post("/v1/chat/completions", dependencies=authorized)
    async def chat_completions(request: Request) -> Response:
        params = chat.parse_chat(await served.body(request), tokenizer, served.limits, template)
        meta, prompt_tokens, job = served.meta("chatcmpl", params), len(params.prompts[0]), served.job(params)
        if params.stream:
            job.submit()
            return _event_stream(chat.chunks(job.events(), tokenizer, params, meta, prompt_tokens), job)
        done = await _run(job, request)
        if done is None:
            return Response(status_code=499)
        return JSONResponse(chat.chat_completion(meta, done[0], tokenizer, params, prompt_tokens))


def create_app(engine: Engine, tokenizer: Any, *, model_name: str, api_key: str | None = None,
               max_body_bytes: int = MAX_BODY_BYTES, scorer: Scorer | None = None,
               chat_template: str | None = None, lora_modules: list[tuple[str, str]] = ()) -> FastAPI:
    """The HTTP app over a running engine. With `api_key`, every route but /health needs `Authorization: Bearer`.
    `scorer` (by default one over the engine's params) scores echoed prompts and finds top_logprobs;
    `chat_template` (jinja source) replaces the tokenizer's (serve/chat.py). Where the engine serves LoRA adapters
    (its config's `max_loras`), `lora_modules` (name, path) are loaded first and /v1/load_lora_adapter and
    /v1/unload_lora_adapter load and unload more (serve/adapters.py)."""
    app = FastAPI(title="mesh-transformer serving", docs_url=None, redoc_url=None, openapi_url=None)
    created = int(time.time())
    vocab = min(len(tokenizer), engine.cfg.n_vocab)
    limits = api.Limits(context=engine.cfg.seq, vocab=vocab, max_choices=min(api.MAX_PROMPTS, engine.max_queue))
    adapters = AdapterSlots(engine, model_name) if engine.cfg.max_loras else None
    if lora_modules and adapters is None:
        raise ValueError("LoRA modules need adapter slots: give --max-loras")
    for name, path in lora_modules:
        try:
            adapters.load(name, path)
        except ApiError as e:
            raise ValueError(f"--lora-modules {name}={path}: {e.message}") from None
    metrics = ServingMetrics(engine.stats, model_name, adapters and adapters.info)
    served = _Served(engine, tokenizer, model_name, limits, metrics, max_body_bytes, adapters)
    authorized = [Depends(_authorizer(api_key))]
    _add_error_handlers(app)
    _add_completion_routes(app, served, authorized,
                           Scoring(engine, scorer or Scorer(engine.layout, engine.params, batch_rows=4), adapters))
    _add_chat_route(app, served, authorized, chat.template_for(tokenizer, chat_template))

    @app.get("/metrics", dependencies=authorized)
    async def prometheus_metrics() -> Response:
        return Response(metrics.exposition(), media_type=CONTENT_TYPE)

    @app.get("/v1/models", dependencies=authorized)
    async def models() -> dict:
        base = {"id": model_name, "object": "model", "created": created, "owned_by": "mesh-transformer-jax",
                "root": model_name, "parent": None}
        return {"object": "list", "data": [base] + [
            {"id": a.name, "object": "model", "created": a.created, "owned_by": "mesh-transformer-jax",
             "root": a.path, "parent": model_name} for a in (adapters.names() if adapters else [])]}

    if adapters is not None:
        add_adapter_routes(app, served.body, authorized, adapters)

    @app.get("/health")
    async def health() -> JSONResponse:
        stats = engine.stats()
        status = "error" if engine.error else "ok"
        return JSONResponse({"status": status, **stats, **({"error": engine.error} if engine.error else {})},
                            200 if status == "ok" else 503)

    return app


# An idle connection's life: beyond clients' keep-alive expiry (httpx's, the openai client's: 5 s), so the client
# closes first; at uvicorn's default, also 5 s, a client reusing its connection can meet the close ("connection reset").
KEEP_ALIVE_S = 75


def serve(app: FastAPI, host: str = "127.0.0.1", port: int = 5000) -> None:
    """Serve until interrupted."""
    uvicorn.run(app, host=host, port=port, log_level="info", timeout_keep_alive=KEEP_ALIVE_S)


class BackgroundServer:
    """uvicorn serving an app from a background thread on a port of its own (tests, benchmarks, notebooks)."""

    def __init__(self, app: FastAPI, host: str = "127.0.0.1", port: int = 0):
        # proto IPPROTO_TCP, not 0: asyncio sets TCP_NODELAY only on such sockets (else ~40 ms per response).
        self._socket = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        self._socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._socket.bind((host, port))  # bound here, so the port is known and cannot be taken meanwhile
        self.host, self.port = host, self._socket.getsockname()[1]
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_keep_alive=KEEP_ALIVE_S))
        self._thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self._socket]}, daemon=True)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def __enter__(self) -> BackgroundServer:
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the server on {self.url} did not start")
            time.sleep(0.01)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self._thread.join(10)
        self._socket.close()
