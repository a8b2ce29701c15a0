"""Untrusted input, without a server: every path that parses what a client sent (sampling_parameters, Triton
request parameters, chat messages and tools, structured-output specs, OpenAI bodies) answers the classes of
odd JSON (huge integers, numbers that overflow, NaN / Infinity literals, duplicate keys, lone surrogates,
deep nesting) with one error naming the field, and conflicting inputs with an error naming both."""
from __future__ import annotations

import json
import os

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from backend_lib.contract.json_input import MAX_DEPTH, loads, nested_deeper_than
from backend_lib.contract.errors import RequestError
from backend_lib.contract.fields import SamplingLimits
from backend_lib.sampling.params import SamplingParams
from backend_lib.serving.request import parse_abort, parse_request
from backend_lib.serving.triton_tokenizer import parse_messages, parse_tools
from openai_frontend.app import parse_json_body
from openai_frontend.errors import APIError
from openai_frontend.params import parse_chat, parse_completion

FUZZ = settings(max_examples=int(os.environ.get("QWEN3_FUZZ_EXAMPLES", "60")), deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.too_slow])

# Raw JSON fragments of each hostile class (as a client would write them: legal JSON text, or the literals
# Python's json accepts although they are not JSON)
HUGE_INT = "1" + "0" * 400
HOSTILE_VALUES = {
    "huge_int": HUGE_INT,
    "huge_negative": "-" + HUGE_INT,
    "overflowing_float": "1e400",
    "nan": "NaN",
    "infinity": "Infinity",
    "surrogate": '"\\ud800"',
    "low_surrogate_in_text": '"ab\\udfffcd"',
    "deep": "[" * 100_000 + "]" * 100_000,
    "deep_objects": '{"a":' * 5_000 + "1" + "}" * 5_000,
}


def test_strict_parse_of_each_hostile_class_names_the_path():
    for kind, raw in HOSTILE_VALUES.items():
        with pytest.raises(RequestError) as exc:
            loads('{"temperature": %s}' % raw, "sampling_parameters")
        assert str(exc.value).startswith("sampling_parameters"), (kind, exc.value)
        if kind not in ("deep", "deep_objects"):
            assert str(exc.value).startswith("sampling_parameters.temperature"), (kind, exc.value)
    with pytest.raises(RequestError, match=r"sampling_parameters: duplicate key 'max_tokens'"):
        loads('{"max_tokens": 5, "max_tokens": 500}', "sampling_parameters")
    with pytest.raises(RequestError, match=r"messages\[0\].content: contains a lone UTF-16 surrogate"):
        loads('{"messages": [{"content": "\\ud800"}]}', "")
    with pytest.raises(RequestError, match="not valid UTF-8"):
        loads(b'{"a": "\xff"}', "x")


def test_what_is_valid_stays_valid():
    doc = {"a": [1, -2, 3.5, 1e300, 2**63, "\U0001F600 é 中"], "b": {"c": None, "d": True}, "e": ""}
    assert loads(json.dumps(doc), "x") == doc
    assert loads(json.dumps(doc, ensure_ascii=False).encode(), "x") == doc
    nested = "[" * MAX_DEPTH + "]" * MAX_DEPTH
    assert loads(nested, "x") is not None and nested_deeper_than(nested.encode(), MAX_DEPTH - 1)
    assert not nested_deeper_than(b'{"s": "[[[[[[[[[[\\"[[[["}', 3)   # brackets in strings do not count


@FUZZ
@given(doc=st.recursive(st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False,
                                                                                        allow_infinity=False),
                                  st.text()),
                        lambda kids: st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=5), kids,
                                                                                  max_size=4), max_leaves=20))
def test_any_json_a_standard_encoder_writes_parses_back_equal(doc):
    try:
        text = json.dumps(doc, ensure_ascii=True)
    except ValueError:
        return
    surrogate = any(0xD800 <= ord(c) <= 0xDFFF for c in text.encode().decode("unicode_escape", "ignore")) \
        if "\\ud" in text else False
    try:
        assert loads(text, "x") == doc
    except RequestError as exc:   # integers past 40 digits or lone surrogates that hypothesis wrote
        assert surrogate or "out of range" in str(exc), exc


def _arrays(**fields) -> dict:
    out = {}
    for name, value in fields.items():
        if isinstance(value, str):
            out[name] = np.array([value.encode("utf-8", "surrogatepass")], dtype=np.object_)
        elif isinstance(value, bool):
            out[name] = np.array([value])
        elif isinstance(value, list):
            out[name] = np.array(value, dtype=np.int32)
        else:
            out[name] = np.array([value], dtype=np.int32)
    return out


@pytest.mark.parametrize("kind", sorted(HOSTILE_VALUES))
@pytest.mark.parametrize("key", ["max_tokens", "temperature", "top_p", "min_p", "presence_penalty", "seed",
                                 "stop", "stop_token_ids", "cache_salt", "structured_outputs"])
def test_sampling_parameters_with_a_hostile_value_name_the_field(kind, key):
    raw = '{"%s": %s}' % (key, HOSTILE_VALUES[kind])
    with pytest.raises(RequestError) as exc:
        req = parse_request(_arrays(text_input="hi", sampling_parameters=raw), None)
        SamplingParams.from_dict(req.sampling).validate(SamplingLimits(), 1000)
    assert str(exc.value).startswith("sampling_parameters"), exc.value


@pytest.mark.parametrize("value", [10**400, -(10**400), 10**39, float("inf")])
@pytest.mark.parametrize("key", ["max_tokens", "temperature", "top_p", "min_p", "frequency_penalty",
                                 "repetition_penalty", "seed", "top_k"])
def test_numbers_no_field_can_hold_are_out_of_range_on_the_python_api_too(key, value):
    with pytest.raises(RequestError, match=key):
        SamplingParams.from_dict({key: value}).validate(SamplingLimits(), 1000)


def test_request_parameters_are_strict():
    base = _arrays(text_input="hi")
    for params, field in [({"bogus_key": 1}, "bogus_key"), ({"max_tokenz": 5}, "max_tokenz"),
                          ({"temperatur": 0.5}, "temperatur"), ({"stream": 7}, "parameters.stream"),
                          ({"n": 17}, "n must be"), ({"n": 0}, "n must be"),
                          ({"n": "x"}, "n must be"), ({"sampling_parameters": "{}"}, "sampling_parameters"),
                          ({"max_tokens": "1" * 400}, "max_tokens"), ({"cache_salt": "\ud800"}, "parameters")]:
        with pytest.raises(RequestError, match=field):
            parse_request(base, json.dumps(params))
    # what the HTTP generate extension sends for JSON keys that are not inputs, and vLLM-backend strings
    req = parse_request(base, json.dumps({"max_tokens": "16", "temperature": 0.5, "stream": "true", "n": 1}))
    assert req.sampling == {"max_tokens": 16, "temperature": 0.5} and req.stream and req.n == 1
    assert parse_request(base, json.dumps({"stream": True, "n": "3"})).n == 3
    assert parse_request(base, json.dumps({"n": 2})).n == 2   # without stream: each choice's one response


def test_a_field_given_twice_must_agree():
    sp = json.dumps({"max_tokens": 8, "temperature": 0.7})
    req = parse_request({**_arrays(text_input="hi", max_tokens=8, sampling_parameters=sp),
                         "temperature": np.array([0.7], dtype=np.float32)}, json.dumps({"max_tokens": 8}))
    assert req.sampling["max_tokens"] == 8 and abs(req.sampling["temperature"] - 0.7) < 1e-6
    with pytest.raises(RequestError, match=r"max_tokens: given in sampling_parameters \(8\) and in an input "
                                           r"tensor \(32\)"):
        parse_request(_arrays(text_input="hi", max_tokens=32, sampling_parameters=sp), None)
    with pytest.raises(RequestError, match="max_tokens: given in the request parameters"):
        parse_request(_arrays(text_input="hi", sampling_parameters=sp), json.dumps({"max_tokens": 9}))


def test_inputs_that_exclude_each_other_name_both():
    with pytest.raises(RequestError, match="text_input and input_ids"):
        parse_request(_arrays(text_input="hi", input_ids=[1, 2]), None)
    with pytest.raises(RequestError, match="abort_request_id: .* got also text_input"):
        parse_abort(_arrays(abort_request_id="r1", abort_token="t", text_input="hi"), None)
    with pytest.raises(RequestError, match="abort_request_id: .* got also request parameters"):
        parse_abort(_arrays(abort_request_id="r1", abort_token="t"), json.dumps({"max_tokens": 3}))
    with pytest.raises(RequestError, match="abort_token: an abort needs"):
        parse_abort(_arrays(abort_request_id="r1"), None)
    assert parse_abort(_arrays(abort_request_id="r1", abort_token="t"), None).token == "t"
    assert parse_abort(_arrays(text_input="hi"), None) is None
    with pytest.raises(RequestError, match="return_abort_token: needs stream true"):
        parse_request(_arrays(text_input="hi", return_abort_token=True), None)
    assert parse_request(_arrays(text_input="hi", return_abort_token=True, stream=True), None).return_abort_token


@pytest.mark.parametrize("kind", sorted(HOSTILE_VALUES))
def test_chat_messages_and_tools_with_hostile_values_name_the_field(kind):
    raw = HOSTILE_VALUES[kind]
    with pytest.raises(RequestError, match=r"^messages"):
        parse_messages('[{"role": "user", "content": %s}]' % raw)
    with pytest.raises(RequestError, match=r"^tools"):
        parse_tools('[{"type": "function", "function": {"name": "f", "parameters": {"maximum": %s}}}]' % raw)


def _body_error(raw: str) -> APIError:
    with pytest.raises(APIError) as exc:
        body = parse_json_body(raw.encode())
        parse_chat(body) if "messages" in body else parse_completion(body)
    assert exc.value.status == 400, exc.value.message
    return exc.value


@pytest.mark.parametrize("kind", sorted(HOSTILE_VALUES))
@pytest.mark.parametrize("template, param", [
    ('{"model": "m", "prompt": "hi", "temperature": %s}', "temperature"),
    ('{"model": "m", "prompt": "hi", "max_tokens": %s}', "max_tokens"),
    ('{"model": "m", "prompt": %s}', "prompt"),
    ('{"model": %s, "prompt": "hi"}', "model"),
    ('{"model": "m", "prompt": "hi", "cache_salt": %s}', "cache_salt"),
    ('{"model": "m", "prompt": "hi", "stop": [%s]}', "stop"),
    ('{"model": "m", "messages": [{"role": "user", "content": %s}]}', "messages"),
    ('{"model": "m", "messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function", '
     '"function": {"name": "f", "parameters": {"type": "object", "maximum": %s}}}], "tool_choice": "required"}',
     "tools"),
])
def test_openai_bodies_with_hostile_values_get_400_naming_the_field(kind, template, param):
    err = _body_error(template % HOSTILE_VALUES[kind])
    if kind in ("deep", "deep_objects"):
        assert "nested deeper" in err.message
    else:
        assert err.param == param and err.message.startswith(param), (err.param, err.message)


def test_openai_duplicate_keys_and_max_tokens_conflicts():
    err = _body_error('{"model": "m", "prompt": "hi", "max_tokens": 5, "max_tokens": 9}')
    assert "duplicate key 'max_tokens'" in err.message
    err = _body_error('{"model": "m", "messages": [{"role": "user", "content": "x"}], "max_tokens": 5, '
                      '"max_completion_tokens": 9}')
    assert err.param == "max_tokens" and "max_completion_tokens" in err.message
    same = parse_chat(parse_json_body(b'{"model": "m", "messages": [{"role": "user", "content": "x"}], '
                                      b'"max_tokens": 7, "max_completion_tokens": 7}'))
    assert same.fields["max_tokens"] == 7


def test_openai_message_refusal_and_reasoning_reach_the_template_or_are_refused():
    chat = parse_chat({"model": "m", "messages": [
        {"role": "user", "content": "x"}, {"role": "assistant", "content": None, "refusal": "I can't."},
        {"role": "assistant", "content": "ok", "reasoning": "think"}, {"role": "user", "content": "y"}]})
    assert chat.messages[1]["content"] == "I can't." and chat.messages[2]["reasoning_content"] == "think"
    for m in ({"role": "user", "content": "x", "refusal": "no"},
              {"role": "assistant", "content": "x", "refusal": "no"},
              {"role": "assistant", "content": "x", "reasoning": "a", "reasoning_content": "b"}):
        with pytest.raises(APIError) as exc:
            parse_chat({"model": "m", "messages": [{"role": "user", "content": "q"}, m]})
        assert exc.value.param == "messages" and "messages[1]" in exc.value.message


def test_a_tool_schema_that_cannot_be_enforced_names_the_tool():
    body = {"model": "m", "messages": [{"role": "user", "content": "x"}], "tool_choice": "required",
            "tools": [{"type": "function", "function": {"name": "ok", "parameters": {"type": "object"}}},
                      {"type": "function", "function": {"name": "bad", "parameters": {"type": "wizard"}}}]}
    with pytest.raises(APIError) as exc:
        parse_chat(body)
    assert exc.value.param == "tools" and exc.value.message.startswith("tools[1].function.parameters")
    parse_chat({**body, "tool_choice": {"type": "function", "function": {"name": "ok"}}})   # only "ok" enforced


_HOSTILE = st.sampled_from([v for k, v in HOSTILE_VALUES.items() if not k.startswith("deep")] +
                           ["[" * 70 + "1" + "]" * 70, '"\\udbff\\udbff"', "-0", "1e-400", "123456789" * 5])
_KEYS = st.sampled_from(["max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids",
                         "logprobs", "presence_penalty", "ignore_eos", "cache_salt", "structured_outputs",
                         "guided_json", "messages", "prompt", "model", "tools", "bogus"])


def _doc(pairs) -> str:
    """A JSON object text whose values are raw fragments (hostile ones among them), keys possibly repeated."""
    return "{" + ", ".join(f'"{k}": {v}' for k, v in pairs) + "}"


@FUZZ
@given(pairs=st.lists(st.tuples(_KEYS, st.one_of(_HOSTILE, st.sampled_from(['1', '0.5', '"x"', '[1, 2]', 'true',
                                                                          'null', '{"json": {}}']))),
                      min_size=1, max_size=5))
def test_fuzzed_hostile_documents_get_a_result_or_one_error_naming_a_field_on_every_path(pairs):
    raw = _doc(pairs)
    sent = {k for k, _ in pairs}
    paths = [
        lambda: SamplingParams.from_dict(parse_request(_arrays(text_input="hi", sampling_parameters=raw), None)
                                         .sampling).validate(SamplingLimits(), 1000),
        lambda: parse_request(_arrays(text_input="hi"), raw),
        lambda: parse_messages("[" + raw + "]"),
        lambda: parse_tools('[{"type": "function", "function": {"name": "f", "parameters": ' + raw + "}}]"),
    ]
    for path in paths:
        try:
            path()
        except RequestError as exc:
            message = str(exc)
            assert message.split(":")[0].split(".")[0].split("[")[0] in (
                "sampling_parameters", "parameters", "messages", "tools", *sent) or \
                any(k in message for k in sent), message
    for parse in (parse_completion, parse_chat):
        try:
            parse(parse_json_body(raw.encode()))
        except APIError as exc:
            assert exc.status == 400 and (exc.param is None or exc.param in sent or exc.param in
                                          ("messages", "prompt", "model")), (exc.param, exc.message)


def test_token_masks_and_prompt_logprobs_reach_sampling_from_every_place():
    from backend_lib.serving.request import parse_request
    import numpy as np
    base = {"text_input": np.array([b"hi"], dtype=np.object_)}
    req = parse_request(base, json.dumps({"logit_bias": '{"5": 2}', "bad_words": "foo", "allowed_token_ids": "[1, 2]",
                                          "prompt_logprobs": "2"}))
    assert req.sampling == {"logit_bias": {"5": 2}, "bad_words": ["foo"], "allowed_token_ids": [1, 2],
                            "prompt_logprobs": 2}
    sp = {"sampling_parameters": np.array([json.dumps({"logit_bias": {"5": 2}}).encode()], dtype=np.object_)}
    assert parse_request({**base, **sp}, None).sampling == {"logit_bias": {"5": 2}}
    with pytest.raises(RequestError, match="logit_bias"):
        parse_request({**base, **sp}, json.dumps({"logit_bias": {"5": 3}}))   # given twice, different values


def test_vllm_backend_and_trt_llm_dialect_fields():
    from backend_lib.serving.request import parse_request
    text = {"text_input": np.array([b"hi"], dtype=np.object_)}
    flag = lambda v: np.array([v], dtype=bool)   # noqa: E731
    with pytest.raises(RequestError, match="exclude_input_in_output"):   # vllm_backend refuses it too
        parse_request({**text, "stream": flag(True), "exclude_input_in_output": flag(False)}, None)
    with pytest.raises(RequestError, match="exclude_input_in_output"):
        parse_request({**text, "stream": flag(True)}, json.dumps({"exclude_input_in_output": False}))
    assert parse_request({**text, "stream": flag(True), "exclude_input_in_output": flag(True)}, None).stream
    req = parse_request({**text, "return_cumulative_logprob": flag(True)}, None)
    assert req.return_cumulative_logprob and req.sampling["logprobs"] == 0
    assert parse_request(text, json.dumps({"min_length": 3})).sampling == {"min_tokens": 3}
    with pytest.raises(RequestError, match="min_length"):
        parse_request(text, json.dumps({"min_length": 3, "min_tokens": 4}))
    params = SamplingParams.from_dict({"top_k": -1}).validate(SamplingLimits(), 100)
    assert params.top_k == 0   # vLLM's "off"
    with pytest.raises(RequestError, match="top_k"):
        SamplingParams.from_dict({"top_k": -2}).validate(SamplingLimits(), 100)
