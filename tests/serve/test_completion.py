"""The per-request acceptance and streaming rules, without a device: a Completion fed tokens by hand."""
from mesh_transformer.serve.completion import Completion, Event, GenerationRequest


class Letters:
    """A tokenizer whose token i is the i-th letter (0 = 'a'); 26 decodes to U+FFFD, as a partial UTF-8 character
    does."""

    def decode(self, tokens):
        return "".join("\ufffd" if t == 26 else chr(ord("a") + t) for t in tokens)


def completion(**kwargs):
    return Completion(GenerationRequest([0], kwargs.pop("max_tokens", 8), lambda event: None, **kwargs))


def feed(c, tokens, stop_ids=(25,)):
    events = []
    for i, token in enumerate(tokens):
        events += c.accept(token, -float(i), Letters(), frozenset(stop_ids), ((token, -float(i)), (0, -9.0)))
    return events


def tops(tokens):
    """What `feed` gave as the alternatives of these tokens."""
    return tuple(((t, -float(i)), (0, -9.0)) for i, t in enumerate(tokens))


def test_without_streaming_one_event_at_the_end_with_every_token():
    events = feed(completion(max_tokens=3), [7, 4, 11, 11])
    assert events == [Event("hel", (7, 4, 11), (-0.0, -1.0, -2.0), "length", alternatives=tops([7, 4, 11]))]


def test_a_stop_token_ends_it_and_is_not_returned():
    c = completion()
    assert feed(c, [7, 8, 25, 3]) == [Event("hi", (7, 8), (-0.0, -1.0), "stop", alternatives=tops([7, 8]))]
    assert c.finished


def test_a_stop_string_cuts_text_and_tokens_before_it():
    events = feed(completion(stop=("ll",)), [7, 4, 11, 11, 14])
    assert events == [Event("he", (7, 4), (-0.0, -1.0), "stop", alternatives=tops([7, 4]))]


def test_streaming_holds_back_a_possible_stop_and_a_partial_character():
    events = feed(completion(stream=True, stop=("xy",), max_tokens=5), [0, 23, 1, 26, 2])
    # "a" goes at once; "x" waits (it may start "xy"); the placeholder waits for the next token.
    assert [e.text for e in events] == ["a", "xb", "\ufffdc", ""]
    assert events[-1].finish_reason == "length" and sum(len(e.tokens) for e in events) == 5


def test_without_logprobs_events_carry_none_and_cancelled_requests_take_no_tokens():
    c = completion(logprobs=False, max_tokens=2)
    assert feed(c, [1, 2]) == [Event("bc", (1, 2), (), "length")]
    c = completion()
    c.request.cancelled.set()
    assert feed(c, [1]) == [] and not c.needs_step


class Pieces:
    """A SentencePiece-like tokenizer: token i is " " + the i-th letter, and a text's leading space is dropped."""

    def decode(self, tokens):
        return "".join(" " + chr(ord("a") + t) for t in tokens).lstrip(" ")


def test_the_text_decoded_incrementally_is_the_whole_decode_at_every_token():
    import numpy as np

    from mesh_transformer.tokenizer import load_tokenizer

    gpt2 = load_tokenizer("gpt2")
    rng = np.random.default_rng(0)
    # GPT-2's byte tokens (ids 0-255 hold single bytes, many of them parts of UTF-8 characters), words, and text
    # with multi-byte characters split across tokens.
    mixed = gpt2.encode("héllo 日本語 🙂 wörld") + [int(t) for t in rng.integers(0, 256, 40)]
    for tokenizer, tokens in [(gpt2, mixed), (gpt2, [int(t) for t in rng.integers(0, 50256, 60)]),
                              (Pieces(), [3, 0, 19, 18]), (Letters(), [0, 26, 26, 1, 26])]:
        c = completion(max_tokens=len(tokens))
        for i, token in enumerate(tokens):
            c.tokens.append(token)
            assert c.text(tokenizer) == tokenizer.decode(tokens[:i + 1])
