"""OpenAI's chat completions as pure functions: `messages` validated, rendered into one prompt by a chat template,
and the chat.completion / chat.completion.chunk bodies. No HTTP here (server.py) and no device (engine.py).

The template is the tokenizer's `chat_template` (from its directory's tokenizer_config.json or chat_template.jinja),
or one given to the server (`device_serve.py --chat-template FILE`). It is rendered as transformers'
`apply_chat_template` renders it: jinja2's immutable sandbox with trim_blocks and lstrip_blocks, the variables
`messages`, `add_generation_prompt` (true) and the tokenizer's special tokens (`bos_token`, `eos_token`, ...), the
helpers `raise_exception(message)` (a 400 naming `messages`), `strftime_now(format)` and the `tojson` filter, the
`{% generation %}` tag; the text is tokenized without adding special tokens.

GPT-J has no template. For a tokenizer without one the prompt is plain dialogue text, one line per message, its
role capitalized, then the assistant's cue; generation stops at the next user turn ("\\nUser:"), so a plain
language model does not write the user's part too:

    System: You are terse.
    User: Hi!
    Assistant:

Messages: role system, developer (rendered as system), user or assistant; content a string or a list of
{"type": "text", "text": ...} parts (joined with newlines, as vLLM joins them); an optional string `name`.
"""
from __future__ import annotations

import datetime
import json
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

from mesh_transformer.config import ConfigError
from mesh_transformer.serve import api
from mesh_transformer.serve.api import ApiError, CompletionParams, Limits
from mesh_transformer.serve.completion import Event

DEFAULT_TEMPLATE = ("{% for message in messages %}{{ message['role'] | capitalize }}: {{ message['content'] }}\n"
                    "{% endfor %}{% if add_generation_prompt %}Assistant:{% endif %}")
DEFAULT_STOP = ("\nUser:",)
ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}
# Message fields a client may send back from an earlier answer; accepted while empty (no tools, audio, ...).
_EMPTY_OK = {"refusal", "tool_calls", "function_call", "audio", "annotations"}
_DEFAULT_ONLY = {
    **api.DEFAULT_ONLY,
    "response_format": (lambda v: v is None or v == {"type": "text"}, 'only {"type": "text"} is supported'),
    "tools": (lambda v: v is None or v == [], "tools are not supported"),
    "tool_choice": (lambda v: v is None or v == "none", 'only "none" is supported'),
}
_FIELDS = {*api.SHARED_FIELDS, "messages", "max_completion_tokens", "top_logprobs", *_DEFAULT_ONLY}


# -------------------------------------------------------------------------------------------------------- template
class _Generation(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` (transformers marks the assistant's text with it): its body."""
    tags = {"generation"}

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body, lineno=lineno)


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    # jinja2's own tojson escapes HTML characters; transformers' does not
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda format: datetime.datetime.now().strftime(format)
    return env


class ChatTemplate:
    """A chat template compiled once: validated messages -> the prompt text; `stop` the strings that end a turn."""

    def __init__(self, source: str, special_tokens: Mapping[str, str] | None = None, stop: Sequence[str] = ()):
        try:
            self._template = _environment().from_string(source)
        except jinja2.TemplateSyntaxError as e:
            raise ConfigError(f"the chat template does not compile: {e.message} (line {e.lineno})") from None
        self.source, self.stop, self._special_tokens = source, tuple(stop), dict(special_tokens or {})

    def render(self, messages: list[dict]) -> str:
        """The prompt, ending with the assistant's cue; a template's refusal (raise_exception) is a 400."""
        try:
            return self._template.render(**self._special_tokens, messages=messages, add_generation_prompt=True)
        except jinja2.TemplateError as e:
            message = " ".join(str(e).split())[:300]  # one line
            raise ApiError(400, f"The chat template refused these messages: {message}", "messages") from None


def template_for(tokenizer: Any, source: str | None = None) -> ChatTemplate:
    """The template to serve: `source` if given, else the tokenizer's chat_template (its "default" one where it
    has several), else DEFAULT_TEMPLATE with DEFAULT_STOP."""
    if source is None:
        source = getattr(tokenizer, "chat_template", None)
        source = source.get("default") if isinstance(source, dict) else source
    special_tokens = {name: value for name, value in getattr(tokenizer, "special_tokens_map", {}).items()
                      if isinstance(value, str)}
    if not source:
        return ChatTemplate(DEFAULT_TEMPLATE, special_tokens, DEFAULT_STOP)
    return ChatTemplate(source, special_tokens)


# --------------------------------------------------------------------------------------------------------- parsing
def _content(content: Any, where: str) -> str:
    """A message's text: a string, or the text parts of a list of content parts joined with newlines."""
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise ApiError(400, f"'{where}[{j}]' must be a text part {{\"type\": \"text\", \"text\": \"...\"}}; "
                                    f"{json.dumps(kind)[:40]} parts are not supported", where)
            texts.append(part["text"])
        content = "\n".join(texts)
    if not isinstance(content, str):
        raise ApiError(400, f"'{where}' must be a string or a list of text parts", where)
    try:
        content.encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate escape such as "\ud800" is valid JSON but not text
        raise ApiError(400, f"'{where}' must be valid Unicode text", where) from None
    return content


def _message(message: Any, where: str) -> dict:
    if not isinstance(message, dict):
        raise ApiError(400, f"'{where}' must be an object with 'role' and 'content'", where)
    role = message.get("role")
    if not isinstance(role, str) or role not in ROLES:
        raise ApiError(400, f"'{where}.role' must be one of {', '.join(ROLES)}; got {json.dumps(role)[:40]}",
                       f"{where}.role")
    for name, value in message.items():
        if name not in ("role", "content", "name") and not (name in _EMPTY_OK and not value):
            raise ApiError(400, f"'{where}.{name}' is not supported", f"{where}.{name}")
    if "content" not in message:
        raise ApiError(400, f"'{where}.content' is required", f"{where}.content")
    out = {"role": ROLES[role], "content": _content(message["content"], f"{where}.content")}
    if message.get("name") is not None:
        if not isinstance(message["name"], str):
            raise ApiError(400, f"'{where}.name' must be a string", f"{where}.name")
        out["name"] = message["name"]
    return out


def parse_messages(messages: Any) -> list[dict]:
    """Validated messages as the template sees them: {"role", "content": str[, "name"]} each."""
    if messages is None:
        raise ApiError(400, "'messages' is required", "messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "'messages' must be a non-empty list of messages", "messages")
    return [_message(message, f"messages[{i}]") for i, message in enumerate(messages)]


def parse_chat(body: dict, tokenizer: Any, limits: Limits, template: ChatTemplate) -> CompletionParams:
    """A validated /v1/chat/completions request as the one prompt to complete n times; raises ApiError(400)."""
    api.check_fields(body, _FIELDS, _DEFAULT_ONLY)
    prompt = tuple(tokenizer.encode(template.render(parse_messages(body.get("messages"))), add_special_tokens=False))
    if not prompt:
        raise ApiError(400, "The chat template made an empty prompt of these messages", "messages")
    sampling = api.parse_sampling(body, limits, 1)
    max_tokens = api.int_field(body, "max_tokens", None, 1, limits.context)
    max_completion_tokens = api.int_field(body, "max_completion_tokens", None, 1, limits.context)
    tokens_param = "max_tokens" if max_completion_tokens is None else "max_completion_tokens"
    max_tokens = max_completion_tokens or max_tokens or max(1, limits.context - len(prompt))
    api.check_context([prompt], max_tokens, limits.context, "messages", tokens_param)
    logprobs = api.bool_field(body, "logprobs")
    top_logprobs = api.int_field(body, "top_logprobs", None, 0, api.MAX_LOGPROBS)
    if top_logprobs is not None and not logprobs:
        raise ApiError(400, "'top_logprobs' needs 'logprobs': true", "top_logprobs")
    sampling["stop"] += template.stop
    return CompletionParams(prompts=(prompt,), max_tokens=max_tokens,
                            logprobs=(top_logprobs or 0) if logprobs else None, model=body.get("model"), **sampling)


# ------------------------------------------------------------------------------------------------------- responses
def _token_logprob(text: str, logprob: float) -> dict:
    return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}


def logprobs_content(tokenizer: Any, event: Event, k: int | None) -> dict | None:
    """The chat `logprobs` of an event's tokens: each token's log-prob and the k most likely at its position (the
    chosen one, when among them, with its own log-prob, the same number); None when not asked for."""
    if k is None:
        return None
    content = []
    for token, logprob, top in zip(event.tokens, event.logprobs, event.alternatives or [()] * len(event.tokens)):
        entry = _token_logprob(tokenizer.decode([token]), logprob)
        entry["top_logprobs"] = [_token_logprob(tokenizer.decode([alt_id]), logprob if alt_id == token else alt)
                                 for alt_id, alt in top[:k]]
        content.append(entry)
    return {"content": content, "refusal": None}


def _body(meta: dict, obj: str, choices: list[dict], usage: dict | None = None) -> dict:
    body = {**meta, "object": obj, "choices": choices}
    if usage is not None:
        body["usage"] = usage
    return body


def chat_completion(meta: dict, events: list[Event], tokenizer: Any, params: CompletionParams,
                    prompt_tokens: int) -> dict:
    """A chat.completion of whole choices; `meta` holds id, created and model."""
    choices = [{"index": index, "message": {"role": "assistant", "content": event.text},
                "logprobs": logprobs_content(tokenizer, event, params.logprobs), "finish_reason": event.finish_reason}
               for index, event in enumerate(events)]
    usage = api.usage(prompt_tokens, sum(len(e.tokens) for e in events))
    return _body(meta, "chat.completion", choices, usage)


async def chunks(events: AsyncIterator[tuple[int, Event]], tokenizer: Any, params: CompletionParams, meta: dict,
                 prompt_tokens: int) -> AsyncIterator[dict | str]:
    """A streamed chat completion's data: each choice's role first, then its text as it comes (the last piece with
    its finish_reason), the usage when asked, then "[DONE]"; an engine error ends it with an error object."""
    def chunk(choices: list[dict], usage: dict | None = None) -> dict:
        return _body(meta, "chat.completion.chunk", choices, usage)

    for index in range(params.n):
        yield chunk([{"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                      "finish_reason": None}])
    completion_tokens = 0
    async for index, event in events:
        if event.error:
            yield api.error_body(event.error, "server_error")
            return
        completion_tokens += len(event.tokens)
        delta = {"content": event.text} if event.text or event.finish_reason is None else {}
        yield chunk([{"index": index, "delta": delta, "logprobs": logprobs_content(tokenizer, event, params.logprobs),
                      "finish_reason": event.finish_reason}])
    if params.include_usage:
        yield chunk([], api.usage(prompt_tokens, completion_tokens))
    yield "[DONE]"
