"""The OpenAI-compatible completions API as pure functions: request validation with OpenAI-style errors (the field
checks chat.py shares too), and the response objects. No HTTP here (server.py) and no device (engine.py).
"""
from __future__ import annotations

import dataclasses
import json
import math
import numbers
import secrets
from collections.abc import Collection, Sequence
from typing import Any

from mesh_transformer.infer.sizes import MAX_LOGIT_BIAS, prompt_problem
from mesh_transformer.serve.completion import Event

DEFAULT_MAX_TOKENS = 16
MAX_N = 16
MAX_PROMPTS = 64
MAX_STOP, MAX_STOP_CHARS = 4, 256
MAX_LOGPROBS = 5
MAX_SEED = 2 ** 63 - 1
COMPLETE_DEFAULT_LENGTH = 512  # what the original /complete generated


class ApiError(Exception):
    """An error answered as OpenAI does: {"error": {message, type, param, code}} with an HTTP status."""

    def __init__(self, status: int, message: str, param: str | None = None, type: str = "invalid_request_error",
                 code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.type, self.code = status, message, param, type, code
        self.headers = headers or {}

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


@dataclasses.dataclass(frozen=True)
class Limits:
    """What the served model allows: its context, the token ids the tokenizer knows, choices per request."""
    context: int
    vocab: int
    max_choices: int = MAX_PROMPTS


@dataclasses.dataclass(frozen=True)
class CompletionParams:
    """A validated completion request: token prompts and how to sample n choices of each."""
    prompts: tuple[tuple[int, ...], ...]
    max_tokens: int = DEFAULT_MAX_TOKENS
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    n: int = 1
    stream: bool = False
    stop: tuple[str, ...] = ()
    seed: int = 0
    logprobs: int | None = None
    include_usage: bool = False
    echo: bool = False  # the prompt comes back first, with its tokens' log-probs (the first null) if asked
    presence_penalty: float = 0.0  # OpenAI's penalties and logit bias ((token id, value) pairs): choose.adjusted
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    model: str | None = None  # the model the request names: the base, or a served LoRA adapter (serve/adapters.py)


# --------------------------------------------------------------------------------------------------------- parsing
def _reject_constant(name: str) -> None:
    raise ValueError(f"{name} is not valid JSON")


def parse_json_object(raw: bytes) -> dict:
    """The request body as a JSON object; NaN and Infinity are refused (they are not JSON)."""
    try:
        body = json.loads(raw, parse_constant=_reject_constant)
    except (ValueError, RecursionError) as e:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        raise ApiError(400, f"We could not parse the JSON body of your request: {str(e)[:200]}") from None
    if not isinstance(body, dict):
        raise ApiError(400, f"The request body must be a JSON object, got {type(body).__name__}")
    return body


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)


def _get(body: dict, name: str, default: Any) -> Any:
    """The field's value; a missing field and null both mean the default, as in OpenAI's API."""
    value = body.get(name)
    return default if value is None else value


def int_field(body: dict, name: str, default: Any, low: int, high: int) -> Any:
    value = body.get(name)
    if value is None:
        return default
    if not _is_int(value):
        raise ApiError(400, f"'{name}' must be an integer, got {json.dumps(value)[:50]}", name)
    if not low <= value <= high:
        raise ApiError(400, f"'{name}' must be in [{low}, {high}], got {value}", name)
    return value


def number_field(body: dict, name: str, default: float, low: float, high: float, open_low: bool = False) -> float:
    value = _get(body, name, default)
    if not _is_number(value):
        raise ApiError(400, f"'{name}' must be a finite number, got {json.dumps(value)[:50]}", name)
    if not (low < value if open_low else low <= value) or value > high:
        interval = f"{'(' if open_low else '['}{low:g}, {high:g}]"
        raise ApiError(400, f"'{name}' must be in {interval}, got {value}", name)
    return float(value)


def bool_field(body: dict, name: str) -> bool:
    value = _get(body, name, False)
    if not isinstance(value, bool):
        raise ApiError(400, f"'{name}' must be true or false, got {json.dumps(value)[:50]}", name)
    return value


def _token_prompt(ids: list, vocab: int) -> tuple[int, ...]:
    if problem := prompt_problem(ids, vocab):
        raise ApiError(400, f"'prompt' {problem}"[:200], "prompt")
    return tuple(ids)


def _text_prompt(text: str, tokenizer: Any, name: str = "prompt") -> tuple[int, ...]:
    if not text:
        raise ApiError(400, f"'{name}' must not be empty", name)
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate escape such as "\ud800" is valid JSON but not text
        raise ApiError(400, f"'{name}' must be valid Unicode text", name) from None
    return tuple(tokenizer.encode(text))


def parse_prompts(prompt: Any, tokenizer: Any, vocab: int) -> tuple[tuple[int, ...], ...]:
    """Token prompts from a string, a list of strings, a list of token ids or a list of lists of token ids."""
    kinds = "a string, a list of strings, a list of token ids or a list of lists of token ids"
    if isinstance(prompt, str):
        return (_text_prompt(prompt, tokenizer),)
    if not isinstance(prompt, list):
        raise ApiError(400, f"'prompt' must be {kinds}", "prompt")
    if not prompt:
        raise ApiError(400, "'prompt' must not be empty", "prompt")
    if len(prompt) > MAX_PROMPTS and not all(_is_int(p) for p in prompt):
        raise ApiError(400, f"'prompt' may hold at most {MAX_PROMPTS} prompts, got {len(prompt)}", "prompt")
    if all(isinstance(p, str) for p in prompt):
        return tuple(_text_prompt(p, tokenizer) for p in prompt)
    if all(isinstance(p, list) for p in prompt):
        return tuple(_token_prompt(p, vocab) for p in prompt)
    if all(_is_int(p) for p in prompt):
        return (_token_prompt(prompt, vocab),)
    raise ApiError(400, f"'prompt' must be {kinds}", "prompt")


def _stop(body: dict) -> tuple[str, ...]:
    stop = _get(body, "stop", ())
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, (list, tuple)) or len(stops) > MAX_STOP or not all(
            isinstance(s, str) and 0 < len(s) <= MAX_STOP_CHARS for s in stops):
        raise ApiError(400, f"'stop' must be a string or a list of at most {MAX_STOP} strings, each of 1 to "
                            f"{MAX_STOP_CHARS} characters", "stop")
    return tuple(stops)


def check_context(prompts: Sequence[Sequence[int]], max_tokens: int, context: int, prompt_param: str = "prompt",
                  tokens_param: str = "max_tokens") -> None:
    """Refuses prompts that leave no room in the context, or too little for max_tokens (errors name the params)."""
    longest = max(map(len, prompts))
    if longest > context or (longest == context and max_tokens > 0):
        raise ApiError(400, f"This model's maximum context length is {context} tokens; the prompt has {longest} "
                            f"tokens and leaves no room for a completion. Please shorten the prompt.", prompt_param)
    if longest + max_tokens > context:
        raise ApiError(400, f"This model's maximum context length is {context} tokens, however you requested "
                            f"{longest + max_tokens} tokens ({longest} in your prompt; {max_tokens} for the "
                            f"completion). Please reduce your prompt or completion length.", tokens_param)


# Known OpenAI fields that this server accepts only at their defaults: (is it the default?, what to say).
DEFAULT_ONLY = {
    "user": (lambda v: v is None or isinstance(v, str), "it must be a string"),
}
_COMPLETION_DEFAULT_ONLY = {
    **DEFAULT_ONLY,
    "best_of": (lambda v: v is None or (_is_int(v) and v == 1), "only 1 (or null) is supported"),
    "suffix": (lambda v: v is None or v == "", "only null is supported"),
}
# The fields every generating route takes: check_fields reads model, parse_sampling the sampling ones; each route
# reads max_tokens and logprobs its own way.
SHARED_FIELDS = {"model", "max_tokens", "temperature", "top_p", "top_k", "n", "stream", "stream_options", "stop",
                 "seed", "logprobs", "presence_penalty", "frequency_penalty", "logit_bias"}
_FIELDS = {*SHARED_FIELDS, "prompt", "echo", *_COMPLETION_DEFAULT_ONLY}


def check_fields(body: dict, known: Collection[str], default_only: dict) -> None:
    """Refuses a field the route does not know, a known one away from its one supported value, a non-string model."""
    for name in body:
        if name not in known:
            raise ApiError(400, f"Unrecognized request argument supplied: {name}", name)
    for name, (is_default, meaning) in default_only.items():
        if name in body and not is_default(body[name]):
            raise ApiError(400, f"'{name}' is not supported with value {json.dumps(body[name])[:50]}: {meaning}",
                           name)
    if body.get("model") is not None and not isinstance(body["model"], str):
        raise ApiError(400, "'model' must be a string", "model")


def parse_sampling(body: dict, limits: Limits, n_prompts: int) -> dict:
    """What the generating routes share, as CompletionParams fields: n (n_prompts x n choices must fit one
    request), temperature, top_p, top_k, stream with stream_options, stop, seed, penalties and logit bias."""
    n = int_field(body, "n", 1, 1, MAX_N)
    if n_prompts * n > limits.max_choices:
        raise ApiError(400, f"{n_prompts} prompt(s) x n={n} is {n_prompts * n} completions; at most "
                            f"{limits.max_choices} fit in one request", "n")
    options = _get(body, "stream_options", {})
    if not isinstance(options, dict) or set(options) - {"include_usage"} or not isinstance(
            options.get("include_usage", False), bool):
        raise ApiError(400, "'stream_options' must be null or {\"include_usage\": true|false}", "stream_options")
    seed = int_field(body, "seed", None, -MAX_SEED, MAX_SEED)
    return {"n": n, "temperature": number_field(body, "temperature", 1.0, 0.0, 2.0),
            "top_p": number_field(body, "top_p", 1.0, 0.0, 1.0, open_low=True),
            "top_k": int_field(body, "top_k", 0, 0, limits.vocab), "stream": bool_field(body, "stream"),
            "include_usage": options.get("include_usage", False), "stop": _stop(body),
            "seed": secrets.randbits(32) if seed is None else seed,
            "presence_penalty": number_field(body, "presence_penalty", 0.0, -2.0, 2.0),
            "frequency_penalty": number_field(body, "frequency_penalty", 0.0, -2.0, 2.0),
            "logit_bias": _logit_bias(body, limits.vocab)}


def _logit_bias(body: dict, vocab: int) -> tuple[tuple[int, float], ...]:
    """OpenAI's logit_bias: null or an object of token ids (as strings) to values in [-100, 100], at most
    MAX_LOGIT_BIAS of them."""
    bias = _get(body, "logit_bias", {})
    if not isinstance(bias, dict) or len(bias) > MAX_LOGIT_BIAS:
        raise ApiError(400, f"'logit_bias' must be null or an object of at most {MAX_LOGIT_BIAS} token ids to "
                            "numbers", "logit_bias")
    pairs = []
    for key, value in bias.items():
        if not (key.isascii() and key.isdigit() and int(key) < vocab):
            raise ApiError(400, f"'logit_bias' key {json.dumps(key)[:50]} is not a token id in [0, {vocab})",
                           "logit_bias")
        if not _is_number(value) or not -100 <= value <= 100:
            raise ApiError(400, f"'logit_bias' value for token {key} must be a number in [-100, 100], got "
                                f"{json.dumps(value)[:50]}", "logit_bias")
        pairs.append((int(key), float(value)))
    return tuple(pairs)


def parse_completion(body: dict, tokenizer: Any, limits: Limits) -> CompletionParams:
    """A validated /v1/completions request; raises ApiError(400) naming the first bad field."""
    check_fields(body, _FIELDS, _COMPLETION_DEFAULT_ONLY)
    if "prompt" not in body:
        raise ApiError(400, "'prompt' is required", "prompt")
    prompts = parse_prompts(body["prompt"], tokenizer, limits.vocab)
    sampling = parse_sampling(body, limits, len(prompts))
    echo = bool_field(body, "echo")
    max_tokens = int_field(body, "max_tokens", DEFAULT_MAX_TOKENS, 0, limits.context)
    if max_tokens == 0 and not echo:
        raise ApiError(400, "'max_tokens' must be at least 1 unless 'echo' is true", "max_tokens")
    params = CompletionParams(prompts=prompts, max_tokens=max_tokens, echo=echo,
                              logprobs=int_field(body, "logprobs", None, 0, MAX_LOGPROBS), model=body.get("model"),
                              **sampling)
    check_context(prompts, max_tokens, limits.context)
    return params


def parse_complete(body: dict, tokenizer: Any, limits: Limits) -> CompletionParams:
    """A validated request of the original API: {"context": str, "top_p": float, "temp": float, "length": int}."""
    for name in body:
        if name not in ("context", "top_p", "temp", "length"):
            raise ApiError(400, f"Unrecognized request argument supplied: {name}", name)
    context = body.get("context")
    if not isinstance(context, str) or not context:
        raise ApiError(400, "'context' must be a non-empty string", "context")
    prompt = _text_prompt(context, tokenizer, "context")
    length = int_field(body, "length", None, 1, limits.context)
    length = min(COMPLETE_DEFAULT_LENGTH, max(1, limits.context - len(prompt))) if length is None else length
    check_context([prompt], length, limits.context)
    return CompletionParams(prompts=(prompt,), max_tokens=length,
                            temperature=number_field(body, "temp", 1.0, 0.0, 2.0),
                            top_p=number_field(body, "top_p", 0.9, 0.0, 1.0, open_low=True), seed=secrets.randbits(32))


# ------------------------------------------------------------------------------------------------------- responses
Alternatives = Sequence[tuple[int, float]]  # the k most likely (token id, log-prob) at a position, best first


def top_dicts(tokenizer: Any, tokens: Sequence[int], logprobs: Sequence[float | None],
              alternatives: Sequence[Alternatives | None]) -> list[dict | None]:
    """`top_logprobs` entries: {token text: log-prob} of the k most likely tokens at each position (null where the
    log-prob is, at an echoed prompt's first token). The chosen token, when among them, carries its own log-prob
    (the same number as token_logprobs), so a client's "was it the argmax" test is exact."""
    out: list[dict | None] = []
    for token, logprob, top in zip(tokens, logprobs, alternatives):
        if logprob is None or top is None:
            out.append(None)
            continue
        entry: dict[str, float] = {}
        for alt_id, alt_logprob in top:
            entry.setdefault(tokenizer.decode([alt_id]), logprob if alt_id == token else alt_logprob)
        out.append(entry)
    return out


def logprobs_object(tokenizer: Any, tokens: Sequence[int], logprobs: Sequence[float | None], text_offset: int,
                    top: Sequence[dict | None] | None) -> dict:
    """The legacy completions `logprobs`: chosen tokens as text, their log-probs, the top alternatives and where
    each token starts. Offsets count from the start of the choice's text (the echoed prompt's, with echo)."""
    pieces = [tokenizer.decode([t]) for t in tokens]
    offsets = []
    for piece in pieces:
        offsets.append(text_offset)
        text_offset += len(piece)
    return {"tokens": pieces, "token_logprobs": list(logprobs), "top_logprobs": None if top is None else list(top),
            "text_offset": offsets}


def choice(index: int, event: Event, tokenizer: Any, want_logprobs: int | None, text_offset: int = 0,
           alternatives: Sequence[Alternatives | None] | None = None) -> dict:
    """One entry of `choices` (a whole completion, or one streamed piece of it); `alternatives` per token when
    want_logprobs > 0 (without them top_logprobs lists the chosen token only)."""
    logprobs = None
    if want_logprobs is not None:
        top = None
        if want_logprobs > 0:
            top = (top_dicts(tokenizer, event.tokens, event.logprobs, alternatives) if alternatives is not None
                   else [{tokenizer.decode([t]): lp} for t, lp in zip(event.tokens, event.logprobs)])
        logprobs = logprobs_object(tokenizer, event.tokens, event.logprobs, text_offset, top)
    return {"text": event.text, "index": index, "logprobs": logprobs, "finish_reason": event.finish_reason}


def completion(id: str, created: int, model: str, choices: list[dict], usage: dict | None = None) -> dict:
    """A text_completion object (a whole response, or a stream chunk when usage is None)."""
    body = {"id": id, "object": "text_completion", "created": created, "model": model, "choices": choices}
    if usage is not None:
        body["usage"] = usage
    return body


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}
