"""The Qwen3 reasoning and Hermes tool-call parsers of the OpenAI front: whole outputs, and streams split anywhere."""
from __future__ import annotations

import json
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from openai_frontend.reasoning import Qwen3ReasoningParser, partial_tag_len
from openai_frontend.tool_calls import ToolCall, ToolCallStream, parse

THINK_ANSWER = "<think>\nThe user greets me.\n</think>\n\nHello! 你好 👋"
THINK_TOOLS = (
    "<think>\nTwo lookups: weather and a booking.\n</think>\n\n"
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "北京", "unit": "celsius"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "book", "arguments": {"who": {"name": "Zoë", "tags": ["a", "b"]}, "n": 2, "ok": true,'
    ' "note": null}}\n</tool_call>'
)
CONTENT_AND_CALL = ('Let me check.\n\n<tool_call>\n{"name": "lookup", "arguments": {"q": "x<y"}}\n</tool_call>\n'
                    "trailing words")
MALFORMED = '<tool_call>\n{"name": "lookup", "arguments": {"q": }\n</tool_call>'
CUT_IN_CALL = 'Checking.<tool_call>\n{"name": "lookup", "argu'

CALL_ID = re.compile(r"call_[0-9a-f]{24}")


def splits(text: str, cuts) -> list[str]:
    bounds = [0, *sorted(set(cuts)), len(text)]
    return [text[a:b] for a, b in zip(bounds, bounds[1:])]


def every_split(text: str):
    """Each single cut, and one character per delta."""
    yield [text]
    for i in range(1, len(text)):
        yield [text[:i], text[i:]]
    yield list(text)


def stream_reasoning(parser: Qwen3ReasoningParser, deltas) -> tuple[str | None, str | None]:
    stream = parser.stream()
    pairs = [stream.feed(d) for d in deltas] + [stream.finish()]
    return "".join(r for r, _ in pairs) or None, "".join(c for _, c in pairs) or None


def stream_tools(deltas) -> tuple[str | None, list[tuple[str, str]], list[dict]]:
    stream = ToolCallStream()
    out = [d for delta in deltas for d in stream.feed(delta)] + stream.finish()
    content = "".join(d["content"] for d in out if "content" in d) or None
    calls: dict[int, dict] = {}
    for d in out:
        for tc in d.get("tool_calls", []):
            call = calls.setdefault(tc["index"], {"name": "", "arguments": ""})
            call["name"] += tc["function"].get("name", "")
            call["arguments"] += tc["function"]["arguments"]
    return content, [(c["name"], c["arguments"]) for _, c in sorted(calls.items())], out


def named(calls: list[ToolCall]) -> list[tuple[str, str]]:
    return [(c.name, c.arguments) for c in calls]


# --- reasoning, whole outputs ---------------------------------------------------------------------

@pytest.mark.parametrize("text, expected", [
    (THINK_ANSWER, ("\nThe user greets me.\n", "\n\nHello! 你好 👋")),
    ("thinking, the prompt opened the block</think>answer", ("thinking, the prompt opened the block", "answer")),
    ("<think>\ncut by max_tokens", ("\ncut by max_tokens", None)),
    ("no tags at all", ("no tags at all", None)),
    ("<think>\nR\n</think>", ("\nR\n", None)),
    ("</think>\n\nonly content", (None, "\n\nonly content")),
    ("<think>a</think>b</think>c<think>d", ("a", "b</think>c<think>d")),
    ("x<think>a</think>b", ("x<think>a", "b")),
    ("<thi", ("<thi", None)),
    ("", (None, None)),
])
def test_split_thinking(text, expected):
    assert Qwen3ReasoningParser().split(text) == expected


@pytest.mark.parametrize("text", ["\n\nHello!", "<think>a</think>b", ""])
def test_split_thinking_off_is_all_content(text):
    assert Qwen3ReasoningParser(thinking=False).split(text) == (None, text or None)


# --- reasoning, streams ---------------------------------------------------------------------------

@pytest.mark.parametrize("thinking", [True, False])
@pytest.mark.parametrize("text", [THINK_ANSWER, THINK_TOOLS, "<think>\ncut", "R</think>C", "<thi", "</thi",
                                  "<think></think>", "a<</think>b", "<<think>x", "<think><think>x</think>"])
def test_reasoning_stream_matches_split_for_every_split(text, thinking):
    parser = Qwen3ReasoningParser(thinking)
    for deltas in every_split(text):
        assert stream_reasoning(parser, deltas) == parser.split(text), deltas


def test_reasoning_stream_holds_back_only_possible_tags():
    stream = Qwen3ReasoningParser().stream()
    assert stream.feed("<th") == ("", "")
    assert stream.feed("ink>\nI think <b> and </th") == ("\nI think <b> and ", "")
    assert stream.feed("ink") == ("", "")
    assert stream.feed(">\n\nAn") == ("", "\n\nAn")
    assert stream.feed("swer </think>") == ("", "swer </think>")
    assert stream.finish() == ("", "")


def test_reasoning_stream_finish_releases_a_partial_tag_as_reasoning():
    stream = Qwen3ReasoningParser().stream()
    assert stream.feed("<think>a</thi") == ("a", "")
    assert stream.finish() == ("</thi", "")


def test_reasoning_stream_thinking_off_passes_text_through():
    stream = Qwen3ReasoningParser(thinking=False).stream()
    assert stream.feed("<think>") == ("", "<think>")
    assert stream.feed("x</think>") == ("", "x</think>")
    assert stream.finish() == ("", "")


def test_partial_tag_len():
    assert partial_tag_len("abc</thi", "</think>") == 5
    assert partial_tag_len("abc<", "</think>") == 1
    assert partial_tag_len("abc</think>", "</think>") == 0
    assert partial_tag_len("abc", "</think>") == 0


# --- tool calls, whole outputs --------------------------------------------------------------------

def test_two_calls_after_reasoning():
    reasoning, content = Qwen3ReasoningParser().split(THINK_TOOLS)
    assert reasoning == "\nTwo lookups: weather and a booking.\n"
    text, calls = parse(content)
    assert text is None  # "\n\n" before the first call is dropped
    assert named(calls) == [
        ("get_weather", '{"city": "北京", "unit": "celsius"}'),
        ("book", '{"who": {"name": "Zoë", "tags": ["a", "b"]}, "n": 2, "ok": true, "note": null}'),
    ]
    assert all(CALL_ID.fullmatch(c.id) for c in calls) and calls[0].id != calls[1].id
    assert calls[0].to_openai() == {"id": calls[0].id, "type": "function", "function": {
        "name": "get_weather", "arguments": '{"city": "北京", "unit": "celsius"}'}}


def test_content_before_a_call_is_kept_and_text_after_it_dropped():
    content, calls = parse(CONTENT_AND_CALL)
    assert content == "Let me check.\n\n"
    assert named(calls) == [("lookup", '{"q": "x<y"}')]


def test_arguments_are_reserialized():
    _, calls = parse('<tool_call>{"arguments":{"a":[1,2.5,"\\u00e9"],"b":{}},"name":"f"}</tool_call>')
    assert named(calls) == [("f", '{"a": [1, 2.5, "é"], "b": {}}')]


@pytest.mark.parametrize("text", [
    MALFORMED,
    CUT_IN_CALL,
    '<tool_call>{"name": "f", "arguments": {}}</tool_call><tool_call>{"name": "g"}</tool_call>',
    '<tool_call>{"name": 3, "arguments": {}}</tool_call>',
    '<tool_call>["f", {}]</tool_call>',
    "<tool_call></tool_call>",
    'a <tool_call> b',
])
def test_any_bad_block_makes_the_whole_text_content(text):
    assert parse(text) == (text, [])


def test_unclosed_block_with_complete_json_is_a_call():
    content, calls = parse('Hi <tool_call>\n{"name": "f", "arguments": {"x": 1}}\n')
    assert content == "Hi "
    assert named(calls) == [("f", '{"x": 1}')]
    cut_in_end_tag = 'Hi <tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_'
    assert parse(cut_in_end_tag) == (cut_in_end_tag, [])  # the partial tag is part of the JSON text


def test_names_are_not_checked_against_tools():
    assert named(parse('<tool_call>{"name": "anything", "arguments": "s"}</tool_call>')[1]) == [("anything", '"s"')]


@pytest.mark.parametrize("text, content", [("plain answer", "plain answer"), ("", None), ("  \n", "  \n")])
def test_no_calls(text, content):
    assert parse(text) == (content, [])


# --- tool calls, streams --------------------------------------------------------------------------

TOOL_TEXTS = ['\n\n<tool_call>\n{"name": "f", "arguments": {"a": {"b": "ü"}}}\n</tool_call>',
              CONTENT_AND_CALL, MALFORMED, CUT_IN_CALL, "plain < text <tool", "  \n", "",
              '<tool_call>{"name": "f", "arguments": 1}</tool_call><tool_call>{"name": "g", "arguments": []}']


@pytest.mark.parametrize("text", TOOL_TEXTS)
def test_tool_stream_matches_parse_for_every_split(text):
    content, calls = parse(text)
    for deltas in every_split(text):
        streamed_content, streamed_calls, _ = stream_tools(deltas)
        assert (streamed_content, streamed_calls) == (content, named(calls)), deltas


def test_tool_stream_delta_shapes():
    stream = ToolCallStream()
    assert stream.feed("Let me check.\n\n<tool") == [{"content": "Let me check.\n\n"}]
    assert stream.feed('_call>\n{"name": "lookup", "arguments": {"q": "x<y"}}\n</tool_call>') == []
    out = stream.finish()
    call_id = out[0]["tool_calls"][0]["id"]
    assert CALL_ID.fullmatch(call_id)
    assert out == [
        {"tool_calls": [{"index": 0, "id": call_id, "type": "function",
                         "function": {"name": "lookup", "arguments": ""}}]},
        {"tool_calls": [{"index": 0, "function": {"arguments": '{"q": "x<y"}'}}]},
    ]


def test_tool_stream_holds_only_possible_tag_text():
    stream = ToolCallStream()
    assert stream.feed("\n\n") == []  # whitespace-only: content only if no call follows
    assert stream.feed("a <b> <to") == [{"content": "\n\na <b> "}]
    assert stream.feed("ol") == []
    assert stream.feed("s>") == [{"content": "<tools>"}]
    assert stream.finish() == []


def test_tool_stream_malformed_call_flushes_everything_as_content():
    stream = ToolCallStream()
    assert stream.feed("See: <tool_call>\n{") == [{"content": "See: "}]
    assert stream.feed('"name": }</tool_call>') == []
    assert stream.finish() == [{"content": '<tool_call>\n{"name": }</tool_call>'}]


# --- reasoning then tool calls, as the front chains them ------------------------------------------

def chained_stream(parser: Qwen3ReasoningParser, deltas):
    reasoning_stream, tool_stream = parser.stream(), ToolCallStream()
    reasoning, out = [], []
    for r, c in [reasoning_stream.feed(d) for d in deltas] + [reasoning_stream.finish()]:
        reasoning.append(r)
        out += tool_stream.feed(c)
    out += tool_stream.finish()
    return "".join(reasoning) or None, out


def collect(out):
    content = "".join(d["content"] for d in out if "content" in d) or None
    calls = [(tc["function"]["name"], None) for d in out for tc in d.get("tool_calls", []) if "id" in tc]
    args = [tc["function"]["arguments"] for d in out for tc in d.get("tool_calls", []) if "id" not in tc]
    return content, [(name, a) for (name, _), a in zip(calls, args)]


TRANSCRIPTS = [THINK_ANSWER, THINK_TOOLS, "<think>\ncut inside", CUT_IN_CALL, MALFORMED, CONTENT_AND_CALL,
               "R</think>\n\n" + MALFORMED]


@settings(max_examples=200, deadline=None)
@given(st.sampled_from(TRANSCRIPTS), st.booleans(), st.lists(st.integers(0, 400), max_size=25))
def test_random_splits_match_whole_output(text, thinking, cuts):
    parser = Qwen3ReasoningParser(thinking)
    deltas = splits(text, [c for c in cuts if c < len(text)])
    reasoning, content = parser.split(text)
    tool_content, calls = parse(content or "")
    streamed_reasoning, out = chained_stream(parser, deltas)
    assert streamed_reasoning == reasoning
    assert collect(out) == (tool_content, named(calls))


@settings(max_examples=200, deadline=None)
@given(st.lists(st.sampled_from([*"ab \n<>/{}\":", "<think>", "</think>", "<tool_call>", "</tool_call>",
                                  '{"name": "f", "arguments": {"k": "v"}}']), max_size=40).map("".join),
       st.booleans(), st.lists(st.integers(0, 200), max_size=12))
def test_random_texts_stream_like_whole_output(text, thinking, cuts):
    parser = Qwen3ReasoningParser(thinking)
    deltas = splits(text, [c for c in cuts if c < len(text)])
    assert stream_reasoning(parser, deltas) == parser.split(text)
    content, calls = parse(text)
    streamed_content, streamed_calls, _ = stream_tools(deltas)
    assert (streamed_content, streamed_calls) == (content, named(calls))


def test_streamed_arguments_are_json():
    _, out = chained_stream(Qwen3ReasoningParser(), [THINK_TOOLS])
    assert [json.loads(a) for _, a in collect(out)[1]][1] == {
        "who": {"name": "Zoë", "tags": ["a", "b"]}, "n": 2, "ok": True, "note": None}


def test_a_forced_call_cut_by_max_tokens_keeps_the_complete_calls_before_it():
    from openai_frontend import tool_calls

    one = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    cut = one + '\n<tool_call>\n{"name": "get_weather", "arguments": {"ci'
    # vLLM's rule (auto): a block that fails turns everything back into content
    assert tool_calls.parse(cut) == (cut, [])
    content, calls = tool_calls.parse(cut, keep_complete=True)
    assert content is None and [(c.name, c.arguments) for c in calls] == [("get_weather", '{"city": "Paris"}')]
    # a malformed *closed* block, or a cut first block, is no complete call: content as before
    bad = one + "\n<tool_call>\n{nope}\n</tool_call>"
    assert tool_calls.parse(bad, keep_complete=True) == (bad, [])
    first_cut = '<tool_call>\n{"name": "get_w'
    assert tool_calls.parse(first_cut, keep_complete=True) == (first_cut, [])
    for split in range(1, len(cut), 7):   # streamed: the same calls
        stream = tool_calls.ToolCallStream(keep_complete=True)
        deltas = stream.feed(cut[:split]) + stream.feed(cut[split:]) + stream.finish()
        assert [d["tool_calls"][0]["function"].get("name") for d in deltas if "tool_calls" in d] == ["get_weather", None]
        assert not any("content" in d for d in deltas)
