"""Tokenizer model and ensembles through the real tritonserver, on the real Qwen vocabulary."""
from __future__ import annotations

import json
import queue
import urllib.request

import numpy as np
import pytest
import tritonclient.grpc as grpcclient

from backend_lib.tokenizer import Tokenizer
from client.http_stream import generate_stream
from client.stream import stream_generate
from client.triton_inputs import build_inputs
from helpers import CONVERSATIONS, GREEDY, collect, tokenizer_model

pytestmark = [pytest.mark.slow, pytest.mark.server]

PROMPTS = {
    "chinese": "介绍一下北京故宫",
    "emoji": "Party time 🎉🫠👩‍👩‍👧‍👦 — what next?",
    "spaces": "English  with  double spaces\nand newlines\n\n  indented",
    "code": "def add(a, b):\n    return a + b\n\nprint(add(2, 3))\n",
}


@pytest.fixture(scope="module")
def tok(bf16_ckpt):
    return Tokenizer(bf16_ckpt)


@pytest.mark.parametrize("model", ["qwen3_a8w8_ensemble", "qwen3_a8w8", "qwen3_tq_ensemble"])
@pytest.mark.parametrize("kind", sorted(PROMPTS))
def test_streamed_text_equals_whole_text_equals_decoding_all_ids(triton, tok, model, kind):
    prompt = PROMPTS[kind]
    streamed = collect(triton.grpc_url, model, prompt=prompt, max_tokens=24, **GREEDY)
    assert streamed[-1][2] and all(r[0] != "ERROR" for r in streamed)
    text = "".join(t for t, _, _ in streamed)
    ids = [i for _, got, _ in streamed for i in got]
    assert len(ids) == 24
    whole = collect(triton.grpc_url, model, prompt=prompt, max_tokens=24, stream=False, exclude_input_in_output=True,
                    **GREEDY)
    assert len(whole) == 1
    assert whole[0][1] == ids
    assert whole[0][0].encode() == text.encode()
    assert tok.hf.decode(ids, skip_special_tokens=True).encode() == text.encode()
    with_prompt = collect(triton.grpc_url, model, prompt=prompt, max_tokens=24, stream=False, **GREEDY)
    assert with_prompt[0][0] == prompt + text


def test_tokenizer_model_round_trips_real_text(triton, tok):
    for prompt in PROMPTS.values():
        ids = tokenizer_model(triton.grpc_url, text_input=prompt)
        assert ids == tok.encode(prompt)
        assert tok.decode(ids) == prompt


@pytest.mark.parametrize("kind", sorted(PROMPTS))
def test_ensemble_tokens_equal_llm_tokens(triton, kind):
    a = stream_generate(triton.grpc_url, "qwen3_a8w8_ensemble", PROMPTS[kind], max_tokens=16, **GREEDY)
    b = stream_generate(triton.grpc_url, "qwen3_a8w8", PROMPTS[kind], max_tokens=16, **GREEDY)
    assert a["output_ids"] == b["output_ids"] and a["text"] == b["text"]


@pytest.mark.parametrize("conv", range(len(CONVERSATIONS)))
@pytest.mark.parametrize("thinking", [True, False])
def test_tokenizer_model_equals_transformers_apply_chat_template(triton, bf16_ckpt, conv, thinking):
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(bf16_ckpt))
    msgs = CONVERSATIONS[conv]
    theirs = hf.apply_chat_template(msgs, add_generation_prompt=True, enable_thinking=thinking, tokenize=True)
    theirs = list(theirs["input_ids"] if hasattr(theirs, "keys") else theirs)
    ours = tokenizer_model(triton.grpc_url, messages=json.dumps(msgs, ensure_ascii=False), enable_thinking=thinking)
    assert ours == theirs


def test_chat_through_the_ensemble_uses_the_template(triton, tok):
    msgs = [{"role": "user", "content": "介绍一下北京故宫"}]
    client = grpcclient.InferenceServerClient(triton.grpc_url)
    results: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: results.put((result, error)))
    inputs = build_inputs(None, stream=False, max_tokens=4, return_num_input_tokens=True, **GREEDY)
    m = grpcclient.InferInput("messages", [1], "BYTES")
    m.set_data_from_numpy(np.array([json.dumps(msgs).encode()], dtype=np.object_))
    e = grpcclient.InferInput("enable_thinking", [1], "BOOL")
    e.set_data_from_numpy(np.array([False]))
    client.async_stream_infer("qwen3_tq_ensemble", inputs + [m, e])
    r, err = results.get(timeout=60)
    client.stop_stream()
    client.close()
    assert err is None
    expected = tok.apply_chat_template(msgs, add_generation_prompt=True, enable_thinking=False)
    assert expected.endswith("<think>\n\n</think>\n\n")
    assert r.as_numpy("num_input_tokens")[0] == len(tok.encode(expected))
    assert r.as_numpy("text_output")[0].decode().startswith(expected)


def test_generate_stream_events_are_json_and_concatenate_to_generate(triton):
    for model in ("qwen3_a8w8_ensemble", "qwen3_tq_ensemble"):
        body = {"text_input": PROMPTS["chinese"], "max_tokens": 12, "temperature": 0,
                "exclude_input_in_output": True, "sampling_parameters": json.dumps({"ignore_eos": True})}
        req = urllib.request.Request(f"http://{triton.http_url}/v2/models/{model}/generate",
                                     data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as r:
            whole = json.loads(r.read())
        events = list(generate_stream(triton.http_url, model, {**body, "stream": True}))   # each parsed as JSON
        assert len(events) == 12
        assert "".join(e["text_output"] for e in events) == whole["text_output"]


@pytest.mark.parametrize("inputs, field", [
    ({"prompt": ""}, "text_input"),
    ({"prompt": "word " * 2000}, "max_model_len"),
])
def test_tokenizer_errors_name_the_field_through_the_ensemble(triton, inputs, field):
    res = collect(triton.grpc_url, "qwen3_a8w8_ensemble", max_tokens=4, **inputs)
    assert res[0][0] == "ERROR" and field in res[0][1]


@pytest.mark.parametrize("messages, field", [
    ("not json", "messages: malformed JSON"),
    (json.dumps([{"role": "wizard", "content": "x"}]), "messages[0].role"),
    (json.dumps([{"role": "user", "content": 5}]), "messages[0].content"),
    (json.dumps([]), "messages"),
])
def test_malformed_messages_are_rejected(triton, messages, field):
    with pytest.raises(Exception) as err:
        tokenizer_model(triton.grpc_url, messages=messages)
    assert field in str(err.value)


def test_cancellation_through_the_ensemble_stops_the_stream_not_a_running_llm_step(triton):
    """What an ensemble cancel can and cannot stop (Triton 2.51, core PR #263): the ensemble checks for
    cancellation between steps, so a cancel ends the client's stream at once and cancels steps not yet
    started, but an LLM step that is already generating is not told: it runs to max_tokens (or a stop) and
    frees its pages then. The LLM models themselves abort within one step (test_triton_server)."""
    m = "qwen3_tq"
    cancelled, length = triton.finished_total(m, "cancelled"), triton.finished_total(m, "length")
    client = grpcclient.InferenceServerClient(triton.grpc_url)
    got: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: got.put((result, error)))
    client.async_stream_infer("qwen3_tq_ensemble", build_inputs(PROMPTS["code"], max_tokens=900, **GREEDY))
    for _ in range(5):
        r, e = got.get(timeout=60)
        assert e is None
    client.stop_stream(cancel_requests=True)
    client.close()
    triton.wait_until(lambda: (triton.finished_total(m, "length"), triton.finished_total(m, "cancelled"))
                      != (length, cancelled), 120, poll=0.1)
    # the LLM step ran to its max_tokens: if this fails with a cancellation instead, Triton now propagates
    # ensemble cancellation into running steps: update the README and this test
    assert triton.finished_total(m, "cancelled") == cancelled
    assert triton.finished_total(m, "length") == length + 1
    triton.wait_until(lambda: triton.metric("vllm:kv_cache_pages_used", m) == 0, 5)
    assert triton.metric("vllm:kv_cache_pages_used", m) == 0
    assert len(stream_generate(triton.grpc_url, "qwen3_tq_ensemble", "hi", max_tokens=3, **GREEDY)["output_ids"]) == 3


TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}}]


def test_tokenizer_model_renders_tools_as_transformers_does(triton, bf16_ckpt):
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(bf16_ckpt))
    msgs = [{"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": "", "tool_calls": [
                {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
            {"role": "tool", "content": '{"temp": 21}'}]
    theirs = hf.apply_chat_template(msgs, tools=TOOLS, add_generation_prompt=True, tokenize=True)
    theirs = list(theirs["input_ids"] if hasattr(theirs, "keys") else theirs)
    ours = tokenizer_model(triton.grpc_url, messages=json.dumps(msgs), tools=json.dumps(TOOLS))
    assert ours == theirs
    with pytest.raises(Exception, match=r"tools\[0\]"):
        tokenizer_model(triton.grpc_url, messages=json.dumps(msgs), tools=json.dumps([{"type": "function"}]))


@pytest.mark.parametrize("model", ["qwen3_a8w8_ensemble", "qwen3_tq"])
def test_structured_outputs_through_triton_inputs(triton, model):
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}},
              "required": ["n"], "additionalProperties": False}
    sp = {"temperature": 1.0, "seed": 3, "structured_outputs": {"json": schema, "disable_any_whitespace": True}}
    r = stream_generate(triton.grpc_url, model, PROMPTS["chinese"], max_tokens=30, sampling_parameters=sp)
    assert 0 <= json.loads(r["text"])["n"] <= 99
    r = stream_generate(triton.grpc_url, model, PROMPTS["chinese"], max_tokens=30,
                        sampling_parameters={"temperature": 0, "guided_choice": ["left", "right"]})
    assert r["text"] in ("left", "right")
    bad = collect(triton.grpc_url, model, prompt=PROMPTS["chinese"], max_tokens=4,
                  sampling_parameters={"structured_outputs": {"json": {"type": "strin"}}})
    assert bad[0][0] == "ERROR" and "structured_outputs.json" in bad[0][1]
