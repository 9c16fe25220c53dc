"""/v1/chat/completions: messages validated and rendered by the tokenizer's chat template (or the plain default), the
openai client's chat calls streamed and not, and the chat logprobs format."""
import json
import subprocess
import sys

import httpx
import openai
import pytest

from mesh_transformer.config import ConfigError
from mesh_transformer.serve import api, chat
from mesh_transformer.tokenizer import load_tokenizer
from tests.helpers import EVAL_CFG, tiny_server

KEY = "chat-key"
MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Say hi"}]
# A template in the style of the Hub's: special tokens, the loop's state, raise_exception, tojson, generation tags.
TEMPLATE = ("{{ bos_token }}{% for m in messages %}"
            "{% if m['role'] == 'user' and m['content'] == 'forbidden' %}{{ raise_exception('no forbidden') }}"
            "{% endif %}"
            "<|{{ m['role'] }}|>\n"
            "{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] }}{% endgeneration %}"
            "{% else %}{{ m['content'] }}{% endif %}{{ eos_token }}\n"
            "{% if loop.last and m.get('name') %}{{ m['name'] | tojson }}{% endif %}"
            "{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")


@pytest.fixture(scope="module")
def url():
    with tiny_server(model_name="tiny-chat", api_key=KEY) as running:
        yield running


@pytest.fixture(scope="module")
def http(url):
    with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {KEY}"}, timeout=120) as client:
        yield client


@pytest.fixture(scope="module")
def client(url):
    return openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0)


@pytest.fixture(scope="module")
def templated_tokenizer_dir(tmp_path_factory):
    """The GPT-2 tokenizer saved with TEMPLATE as the chat_template of its tokenizer_config.json."""
    directory = tmp_path_factory.mktemp("chat_tokenizer")
    load_tokenizer().save_pretrained(directory)
    config_path = directory / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config_path.write_text(json.dumps({**config, "chat_template": TEMPLATE}))
    return str(directory)


def test_default_template_is_plain_dialogue_ending_with_the_assistant_cue_and_stops_at_the_next_user_turn():
    template = chat.template_for(load_tokenizer())
    messages = chat.parse_messages([*MESSAGES, {"role": "assistant", "content": "Hi."},
                                    {"role": "developer", "content": [{"type": "text", "text": "Be kind."},
                                                                      {"type": "text", "text": "Always."}]},
                                    {"role": "user", "content": "Again"}])
    assert template.render(messages) == ("System: You are terse.\nUser: Say hi\nAssistant: Hi.\n"
                                         "System: Be kind.\nAlways.\nUser: Again\nAssistant:")
    assert template.stop == ("\nUser:",)
    params = chat.parse_chat({"messages": MESSAGES, "stop": "END"}, load_tokenizer(),
                             api.Limits(context=EVAL_CFG.seq, vocab=EVAL_CFG.n_vocab), template)
    assert params.stop == ("END", "\nUser:")


def test_tokenizer_chat_template_renders_as_transformers_apply_chat_template(templated_tokenizer_dir):
    tokenizer = load_tokenizer(templated_tokenizer_dir)
    template = chat.template_for(tokenizer)
    messages = [*MESSAGES, {"role": "assistant", "content": "Hi."}, {"role": "user", "content": "Ü?", "name": "ann"}]
    rendered = template.render(chat.parse_messages(messages))
    assert rendered == ("<|endoftext|><|system|>\nYou are terse.<|endoftext|>\n<|user|>\nSay hi<|endoftext|>\n"
                        "<|assistant|>\nHi.<|endoftext|>\n<|user|>\nÜ?<|endoftext|>\n\"ann\"<|assistant|>\n")
    assert rendered == tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert template.stop == ()
    params = chat.parse_chat({"messages": messages}, tokenizer,
                             api.Limits(context=EVAL_CFG.seq, vocab=EVAL_CFG.n_vocab), template)
    expected_ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)
    assert list(params.prompts[0]) == list(expected_ids)


def test_a_template_refusing_the_messages_is_a_400_naming_messages_and_a_broken_one_a_config_error(
        templated_tokenizer_dir):
    template = chat.template_for(load_tokenizer(templated_tokenizer_dir))
    with pytest.raises(api.ApiError) as refused:
        template.render([{"role": "user", "content": "forbidden"}])
    assert refused.value.status == 400 and refused.value.param == "messages"
    assert "no forbidden" in refused.value.message
    with pytest.raises(ConfigError, match="does not compile"):
        chat.ChatTemplate("{% for m in messages %}")


def test_a_given_template_replaces_the_tokenizers():
    template = chat.template_for(load_tokenizer(), "{% for m in messages %}[{{ m.content }}]{% endfor %}>")
    assert template.render([{"role": "user", "content": "a"}]) == "[a]>" and template.stop == ()


def test_openai_client_chat_completion_matches_the_completions_route_on_the_rendered_prompt(client, http):
    done = client.chat.completions.create(model="tiny-chat", messages=MESSAGES, max_tokens=8, temperature=0, n=2,
                                          logprobs=True, top_logprobs=2)
    assert done.object == "chat.completion" and done.id.startswith("chatcmpl-") and done.model == "tiny-chat"
    rendered = "System: You are terse.\nUser: Say hi\nAssistant:"
    prompt_tokens = len(load_tokenizer().encode(rendered))
    reference = http.post("/v1/completions", json={"prompt": rendered, "max_tokens": 8, "temperature": 0,
                                                   "stop": "\nUser:"}).json()["choices"][0]
    for index, choice in enumerate(done.choices):
        assert choice.index == index and choice.message.role == "assistant"
        assert choice.message.content == reference["text"] and choice.finish_reason == reference["finish_reason"]
        for entry in choice.logprobs.content:  # greedy: the chosen token is the most likely, with its own log-prob
            assert len(entry.top_logprobs) == 2 and entry.top_logprobs[0].token == entry.token
            assert entry.top_logprobs[0].logprob == entry.logprob <= 0
            assert bytes(entry.bytes) == entry.token.encode()
    completion_tokens = 2 * len(done.choices[0].logprobs.content)
    assert (done.usage.prompt_tokens, done.usage.completion_tokens) == (prompt_tokens, completion_tokens)
    shorter = client.chat.completions.create(model="tiny-chat", messages=MESSAGES, max_completion_tokens=2,
                                             temperature=0)
    assert shorter.choices[0].logprobs is None and shorter.usage.completion_tokens <= 2


def test_openai_client_chat_stream_sends_the_role_then_the_text_then_usage(client):
    whole = client.chat.completions.create(model="tiny-chat", messages=MESSAGES, max_tokens=10, temperature=0)
    chunks = list(client.chat.completions.create(model="tiny-chat", messages=MESSAGES, max_tokens=10, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[0].choices[0].delta.content == ""
    pieces = [c.choices[0] for c in chunks[1:-1]]
    assert "".join(p.delta.content or "" for p in pieces) == whole.choices[0].message.content
    assert pieces[-1].finish_reason == whole.choices[0].finish_reason and len(pieces) > 1
    assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens == whole.usage.total_tokens


def test_chat_stream_is_server_sent_events_ending_with_done(http):
    body = {"messages": MESSAGES, "max_tokens": 3, "temperature": 0, "stream": True, "logprobs": True}
    with http.stream("POST", "/v1/chat/completions", json=body) as response:
        assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in response.iter_lines() if line]
    assert all(line.startswith("data: ") for line in lines) and lines[-1] == "data: [DONE]"
    chunks = [json.loads(line[6:]) for line in lines[:-1]]
    assert sum(len(c["choices"][0]["logprobs"]["content"]) for c in chunks[1:]) == 3
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


BAD_BODIES = [
    ({}, "messages"),
    ({"messages": None}, "messages"),
    ({"messages": []}, "messages"),
    ({"messages": "hi"}, "messages"),
    ({"messages": {"role": "user", "content": "hi"}}, "messages"),
    ({"messages": ["hi"]}, "messages[0]"),
    ({"messages": [MESSAGES[1], None]}, "messages[1]"),
    ({"messages": [{"content": "hi"}]}, "messages[0].role"),
    ({"messages": [{"role": "bot", "content": "hi"}]}, "messages[0].role"),
    ({"messages": [{"role": "tool", "content": "hi", "tool_call_id": "1"}]}, "messages[0].role"),
    ({"messages": [{"role": ["user"], "content": "hi"}]}, "messages[0].role"),
    ({"messages": [{"role": "user"}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": None}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": {"text": "hi"}}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": "\ud800"}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages[0].content"),
    ({"messages": [{"role": "user", "content": [{"type": "text"}]}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": ["hi"]}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": "hi", "name": 5}]}, "messages[0].name"),
    ({"messages": [{"role": "assistant", "content": "x", "tool_calls": [{"id": "1"}]}]}, "messages[0].tool_calls"),
    ({"messages": MESSAGES, "prompt": "hi"}, "prompt"),
    ({"messages": MESSAGES, "echo": True}, "echo"),
    ({"messages": MESSAGES, "max_tokens": 0}, "max_tokens"),
    ({"messages": MESSAGES, "max_completion_tokens": "4"}, "max_completion_tokens"),
    ({"messages": MESSAGES, "max_tokens": EVAL_CFG.seq}, "max_tokens"),
    ({"messages": MESSAGES, "max_completion_tokens": EVAL_CFG.seq - 1}, "max_completion_tokens"),
    ({"messages": [{"role": "user", "content": "word " * 80}]}, "messages"),
    ({"messages": MESSAGES, "logprobs": 2}, "logprobs"),
    ({"messages": MESSAGES, "top_logprobs": 2}, "top_logprobs"),
    ({"messages": MESSAGES, "logprobs": True, "top_logprobs": 6}, "top_logprobs"),
    ({"messages": MESSAGES, "n": 0}, "n"),
    ({"messages": MESSAGES, "temperature": -1}, "temperature"),
    ({"messages": MESSAGES, "stop": [""]}, "stop"),
    ({"messages": MESSAGES, "tools": [{"type": "function"}]}, "tools"),
    ({"messages": MESSAGES, "response_format": {"type": "json_object"}}, "response_format"),
    ({"messages": MESSAGES, "presence_penalty": 3}, "presence_penalty"),
    ({"messages": MESSAGES, "logit_bias": {"x": 1}}, "logit_bias"),
]


@pytest.mark.parametrize("body, param", BAD_BODIES, ids=[f"{i}-{p}" for i, (_, p) in enumerate(BAD_BODIES)])
def test_bad_chat_requests_get_a_400_naming_the_param(http, body, param):
    response = http.post("/v1/chat/completions", content=json.dumps(body).encode("utf-8", "surrogatepass"))
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error", error
    assert "\n" not in error["message"]


def test_chat_needs_the_api_key(url):
    response = httpx.post(f"{url}/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 2},
                          headers={"Authorization": "Bearer wrong"})
    assert response.status_code == 401 and response.json()["error"]["code"] == "invalid_api_key"


def test_accepted_unusual_messages(http):
    """Content parts, names, null defaults and the empty fields of an answer sent back are all accepted."""
    messages = [{"role": "developer", "content": [{"type": "text", "text": "Grüße 🙂"}], "name": "dev"},
                {"role": "user", "content": ""},
                {"role": "assistant", "content": "ok", "refusal": None, "tool_calls": None, "function_call": None},
                {"role": "user", "content": "日本語"}]
    body = {"messages": messages, "max_tokens": 2, "temperature": None, "n": None, "stop": None, "seed": 3,
            "tools": None, "response_format": {"type": "text"}, "tool_choice": "none", "user": "me"}
    response = http.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["finish_reason"] in ("stop", "length")


def test_device_serve_missing_chat_template_file_is_a_one_line_error_before_loading():
    result = subprocess.run([sys.executable, "device_serve.py", "--config", "configs/bench.json", "--chat-template",
                             "no/such/template.jinja"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().count("\n") == 0 and "no/such/template.jinja" in result.stderr
