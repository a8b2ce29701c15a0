"""The Responses API (/v1/responses): request translation onto the chat path, the output items and typed stream
events built from Qwen3 text, the bounded store (no server), then the openai SDK's client.responses.create and
client.responses.stream against the real tritonserver + front."""
from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
import requests

from harness.openai_front import Front
from openai_frontend.errors import APIError
from openai_frontend.gateway import Delta
from openai_frontend.generation import Tally
from openai_frontend.responses_api import ResponseRun
from openai_frontend.responses_params import parse_responses
from openai_frontend.responses_store import ResponseStore

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
WEATHER = {"type": "function", "name": "get_weather", "description": "Weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
                          "required": ["city"], "additionalProperties": False}}
NO_THINK = {"chat_template_kwargs": {"enable_thinking": False}}


# ----- request translation ------------------------------------------------------------------------------
def test_input_items_become_chat_messages():
    req = parse_responses({
        "model": "m", "instructions": "Be terse.", "max_output_tokens": 9, "temperature": 0.5,
        "input": [{"role": "user", "content": [{"type": "input_text", "text": "Weather?"}]},
                  {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "hmm"}]},
                  {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
                  {"type": "function_call_output", "call_id": "call_1", "output": '{"temp": 21}'},
                  {"type": "message", "role": "developer", "content": "And?"}],
        "tools": [WEATHER], "tool_choice": {"type": "function", "name": "get_weather"}})
    assert req.gen.messages == [
        {"role": "system", "content": "Be terse."}, {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "", "reasoning_content": "hmm", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "content": '{"temp": 21}', "tool_call_id": "call_1"}, {"role": "system", "content": "And?"}]
    assert req.history == req.gen.messages[1:]      # a follow-up continues without the instructions
    assert req.gen.fields["max_tokens"] == 9 and req.gen.fields["temperature"] == 0.5
    assert req.gen.tools.name == "get_weather" and req.gen.tools.tools[0]["function"]["name"] == "get_weather"
    assert req.store and not req.stream


def test_text_format_json_schema_and_previous_history():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    req = parse_responses({"model": "m", "input": "x", "previous_response_id": "resp_1",
                           "text": {"format": {"type": "json_schema", "name": "n", "schema": schema, "strict": True}}},
                          lambda rid: [{"role": "user", "content": "before"}, {"role": "assistant", "content": "ok"}])
    assert req.gen.sampling["structured_outputs"] == {"json": schema}
    assert [m["content"] for m in req.gen.messages] == ["before", "ok", "x"]


@pytest.mark.parametrize("body, param, words", [
    ({"reasoning": {"effort": "high"}}, "reasoning", "reasoning.effort"),
    ({"truncation": "auto"}, "truncation", "truncation"),
    ({"background": True}, "background", "background"),
    ({"include": ["reasoning.encrypted_content"]}, "include", "include"),
    ({"prompt": {"id": "p"}}, "prompt", "prompt"),
    ({"conversation": "c"}, "conversation", "conversation"),
    ({"max_tool_calls": 3}, "max_tool_calls", "max_tool_calls"),
    ({"no_such_field": 1}, "no_such_field", "no_such_field"),
    ({"context_management": [{}]}, "context_management", "context_management"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input",
     "input[0].content[0].type"),
    ({"input": [{"type": "item_reference", "id": "x"}]}, "input", "input[0].type"),
    ({"input": [{"type": "reasoning", "encrypted_content": "abc", "summary": []}]}, "input", "encrypted_content"),
    ({"input": [{"role": "wizard", "content": "hi"}]}, "input", "input[0].role"),
    ({"input": []}, "input", "input"),
    ({"tools": [{"type": "web_search"}]}, "tools", "tools[0].type"),
    ({"text": {"format": {"type": "xml"}}}, "text.format", "text.format"),
    ({"text": {"verbosity": "low"}}, "text", "text.verbosity"),
    ({"max_output_tokens": 0}, "max_output_tokens", "max_output_tokens"),
    ({"max_output_tokens": 2**40}, "max_output_tokens", "max_output_tokens"),
    ({"temperature": -1}, "temperature", "temperature"),
    ({"metadata": {"k": 1}}, "metadata", "metadata"),
    ({"store": "yes"}, "store", "store"),
])
def test_what_is_not_implemented_is_a_400_naming_it(body, param, words):
    with pytest.raises(APIError) as err:
        parse_responses({"model": "m", "input": "hi", **body})
    assert err.value.status == 400 and err.value.param == param and words in err.value.message, err.value.message


def test_neutral_values_are_accepted():
    req = parse_responses({"model": "m", "input": "hi", "truncation": "disabled", "background": False, "include": [],
                           "service_tier": "auto", "top_logprobs": 0, "reasoning": {"effort": None}, "store": False,
                           "metadata": {"k": "v"}, "user": "u", "text": {"format": {"type": "text"}}})
    assert not req.store and req.echo["metadata"] == {"k": "v"}


# ----- output items and events -----------------------------------------------------------------------------
def _run(text: str, cuts: list[int], reason: str = "stop", **body):
    req = parse_responses({"model": "m", "input": "hi", **body})
    run = ResponseRun(req, reasoning=True)
    events = run.start()
    tally = Tally()
    pieces = [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]
    for k, piece in enumerate(pieces):
        delta = Delta(piece, [k], finish_reason=reason if k == len(pieces) - 1 else None, num_input_tokens=5,
                      final=k == len(pieces) - 1)
        tally.add(delta)
        events += run.feed(delta)
    return run, events + run.finish(tally)


@pytest.mark.parametrize("cuts", [[], [1, 2, 3], list(range(1, 60)), [9, 30]])
def test_reasoning_message_and_calls_stream_equals_the_final_output(cuts):
    text = "<think>\nweather\n</think>\n\nLet me check." + CALL
    run, events = _run(text, cuts, tools=[WEATHER])
    out = run.response["output"]
    assert [i["type"] for i in out] == ["reasoning", "message", "function_call"]
    assert out[0]["content"][0]["text"] == "\nweather\n"
    assert out[1]["content"][0]["text"] == "\n\nLet me check." and out[1]["status"] == "completed"
    assert (out[2]["name"], json.loads(out[2]["arguments"])) == ("get_weather", {"city": "Paris"})
    assert out[2]["call_id"].startswith("call_")
    kinds = [e["type"] for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert "".join(e["delta"] for e in events if e["type"] == "response.reasoning_text.delta") == "\nweather\n"
    assert "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta") == "\n\nLet me check."
    assert kinds.count("response.output_item.added") == kinds.count("response.output_item.done") == 3
    done = [e["item"] for e in events if e["type"] == "response.output_item.done"]
    assert done == out and events[-1]["response"]["output"] == out
    assert run.response["usage"]["output_tokens"] == len(cuts) + 1
    assert run.conversation()[-1] == {"role": "assistant", "content": "\n\nLet me check.", "reasoning_content":
                                      "\nweather\n", "tool_calls": [{"id": out[2]["call_id"], "type": "function",
                                                                     "function": {"name": "get_weather",
                                                                                  "arguments": out[2]["arguments"]}}]}


def test_a_cut_reply_is_incomplete_and_thinking_off_is_all_text():
    run, events = _run("<think>still", [3], reason="length")
    assert run.response["status"] == "incomplete" and events[-1]["type"] == "response.incomplete"
    assert run.response["incomplete_details"] == {"reason": "max_output_tokens"}
    assert [i["type"] for i in run.response["output"]] == ["reasoning"]
    run, _ = _run("<think>x</think>y", [], chat_template_kwargs={"enable_thinking": False})
    assert [(i["type"], i["content"][0]["text"]) for i in run.response["output"]] == [("message", "<think>x</think>y")]
    assert run.response["usage"]["output_tokens_details"]["reasoning_tokens"] == 0


# ----- store ------------------------------------------------------------------------------------------------
def test_the_store_is_bounded_in_count_and_bytes_oldest_first():
    store = ResponseStore(max_responses=3, max_bytes=10_000)
    for i in range(5):
        assert store.put({"id": f"r{i}", "x": "a" * 100}, [])
    assert [store.get(f"r{i}") is not None for i in range(5)] == [False, False, True, True, True]
    assert store.put({"id": "big", "x": "b" * 9_950}, [])   # fits alone: everything older goes
    assert len(store) == 1 and store.get("big") and store.bytes <= 10_000
    assert not store.put({"id": "huge", "x": "c" * 20_000}, [])   # over the bound by itself: not stored
    assert store.get("huge") is None and store.get("big")
    assert store.delete("big") and not store.delete("big") and store.bytes == 0


# ----- the real server ----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def front(triton, tmp_path_factory):
    server = Front(triton.grpc_url, tmp_path_factory.mktemp("responses") / "front.log",
                   "--responses-store-count", "4")
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(front):
    return front.client()


@pytest.mark.slow
@pytest.mark.server
def test_create_and_retrieve_equal_chat_on_the_same_prompt(client):
    kw = dict(model="qwen3_a8w8", max_output_tokens=12, temperature=0, extra_body={**NO_THINK, "ignore_eos": True})
    res = client.responses.create(input="Tell me about Paris.", instructions="You are terse.", **kw)
    chat = client.chat.completions.create(
        model="qwen3_a8w8", messages=[{"role": "system", "content": "You are terse."},
                                      {"role": "user", "content": "Tell me about Paris."}],
        max_tokens=12, temperature=0, extra_body={**NO_THINK, "ignore_eos": True})
    assert res.object == "response" and res.id.startswith("resp_") and res.status == "incomplete"
    assert res.incomplete_details.reason == "max_output_tokens"
    assert res.output_text == chat.choices[0].message.content
    assert (res.usage.input_tokens, res.usage.output_tokens) == (chat.usage.prompt_tokens, 12)
    assert res.instructions == "You are terse." and res.max_output_tokens == 12
    got = client.responses.retrieve(res.id)
    assert got.output_text == res.output_text and got.id == res.id
    again = client.responses.create(input="Tell me about Paris.", instructions="You are terse.", **kw)
    assert again.output_text == res.output_text
    # the same whole prompt again: every token but the last one served by the prefix cache, and reported
    assert again.usage.input_tokens_details.cached_tokens == again.usage.input_tokens - 1


@pytest.mark.slow
@pytest.mark.server
def test_stream_events_and_final_response(client):
    kw = dict(model="qwen3_tq", input=[{"role": "user", "content": "Hi!"}], max_output_tokens=10, temperature=0,
              extra_body={"ignore_eos": True, "chat_template_kwargs": {"enable_thinking": True}})
    whole = client.responses.create(**kw)
    with client.responses.stream(**kw) as stream:
        events = list(stream)
    # cut by max_output_tokens: the last event is response.incomplete, as OpenAI sends it (the SDK's
    # get_final_response() waits for response.completed only), carrying the final response
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.incomplete"
    final = events[-1].response
    assert final.status == "incomplete" and final.incomplete_details.reason == "max_output_tokens"
    # thinking on, 10 random tokens: all reasoning, streamed as reasoning_text deltas
    assert [i.type for i in final.output] == ["reasoning"] == [i.type for i in whole.output]
    streamed = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert streamed == final.output[0].content[0].text == whole.output[0].content[0].text
    assert final.usage.output_tokens == 10 and final.usage.output_tokens_details.reasoning_tokens == 10
    assert [e.sequence_number for e in events] == list(range(len(events)))


@pytest.mark.slow
@pytest.mark.server
def test_text_stream_with_the_sdk_helpers(client):
    # a reply that ends by itself (a random-weights model does when a grammar ends it): response.completed
    fmt = {"format": {"type": "json_schema", "name": "w", "schema": {"enum": ["a long enough answer", "no"]}}}
    with client.responses.stream(model="qwen3_a8w8", input="Hello", max_output_tokens=30, temperature=0, text=fmt,
                                 extra_body=NO_THINK) as stream:
        events = list(stream)
        final = stream.get_final_response()
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert events[-1].type == "response.completed" and final.status == "completed"
    assert len(deltas) >= 2 and "".join(deltas) == final.output_text and json.loads(final.output_text) in (
        "a long enough answer", "no")
    assert [e.type for e in events if "content_part" in e.type or "output_item" in e.type] == [
        "response.output_item.added", "response.content_part.added", "response.content_part.done",
        "response.output_item.done"]


@pytest.mark.slow
@pytest.mark.server
def test_function_tools_and_their_outputs_round_trip(client):
    res = client.responses.create(model="qwen3_a8w8", input="Weather in Paris?", tools=[WEATHER], tool_choice="required",
                                  parallel_tool_calls=False, max_output_tokens=80, temperature=0, extra_body=NO_THINK)
    calls = [i for i in res.output if i.type == "function_call"]
    assert res.status == "completed" and len(calls) == 1 and calls[0].name == "get_weather"
    assert len(json.loads(calls[0].arguments)["city"]) <= 12
    follow = client.responses.create(
        model="qwen3_a8w8", previous_response_id=res.id, tools=[WEATHER], max_output_tokens=4, temperature=0,
        input=[{"type": "function_call_output", "call_id": calls[0].call_id, "output": '{"temp_c": 21}'}],
        extra_body=NO_THINK)
    manual = client.responses.create(
        model="qwen3_a8w8", tools=[WEATHER], max_output_tokens=4, temperature=0, extra_body=NO_THINK,
        input=[{"role": "user", "content": "Weather in Paris?"},
               {"type": "function_call", "call_id": calls[0].call_id, "name": "get_weather",
                "arguments": calls[0].arguments},
               {"type": "function_call_output", "call_id": calls[0].call_id, "output": '{"temp_c": 21}'}])
    # previous_response_id carries the same conversation as the items sent by hand
    assert follow.usage.input_tokens == manual.usage.input_tokens > res.usage.input_tokens
    assert follow.output_text == manual.output_text
    with client.responses.stream(model="qwen3_tq", input="Weather in Paris?", tools=[WEATHER], tool_choice="required",
                                 max_output_tokens=80, temperature=0, extra_body=NO_THINK) as stream:
        events = list(stream)
        final = stream.get_final_response()
    streamed = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    assert streamed == [i.arguments for i in final.output if i.type == "function_call"] and streamed
    assert events[-1].type == "response.completed"


@pytest.mark.slow
@pytest.mark.server
def test_json_schema_text_format(client):
    import jsonschema

    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                               "n": {"type": "integer", "minimum": 0, "maximum": 9}},
              "required": ["name", "n"], "additionalProperties": False}
    res = client.responses.create(model="qwen3_a8w8", input="A city as JSON", max_output_tokens=60, temperature=1.0,
                                  text={"format": {"type": "json_schema", "name": "city", "schema": schema, "strict": True}},
                                  extra_body={**NO_THINK, "structured_outputs": {"disable_any_whitespace": True}})
    assert res.status == "completed"
    jsonschema.validate(json.loads(res.output_text), schema)
    assert res.text.format.type == "json_schema"


@pytest.mark.slow
@pytest.mark.server
def test_previous_response_id_store_false_and_eviction(client, front):
    first = client.responses.create(model="qwen3_a8w8", input="My name is Ada.", max_output_tokens=4, temperature=0,
                                    extra_body=NO_THINK)
    second = client.responses.create(model="qwen3_a8w8", input="What is my name?", previous_response_id=first.id,
                                     max_output_tokens=4, temperature=0, extra_body=NO_THINK)
    alone = client.responses.create(model="qwen3_a8w8", input="What is my name?", max_output_tokens=4, temperature=0,
                                    extra_body=NO_THINK, store=False)
    assert second.previous_response_id == first.id
    assert second.usage.input_tokens > alone.usage.input_tokens + first.usage.output_tokens
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(alone.id)                       # store: false is not kept
    with pytest.raises(openai.NotFoundError) as err:
        client.responses.create(model="qwen3_a8w8", input="x", previous_response_id=alone.id, max_output_tokens=2)
    assert err.value.body["param"] == "previous_response_id"
    for _ in range(4):   # the store holds 4 (--responses-store-count 4): the oldest goes first
        client.responses.create(model="qwen3_a8w8", input="filler", max_output_tokens=2, extra_body=NO_THINK)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)
    assert requests.delete(f"{front.url}/v1/responses/{second.id}", timeout=10).status_code == 404   # evicted too


@pytest.mark.slow
@pytest.mark.server
def test_a_hostile_request_fails_alone_naming_its_field(triton, client):
    good = dict(model="qwen3_a8w8", input="Hello", max_output_tokens=16, temperature=0,
                extra_body={**NO_THINK, "ignore_eos": True})
    expected = client.responses.create(**good).output_text
    hostile = [dict(model="qwen3_a8w8", input="x", reasoning={"effort": "high"}),
               dict(model="qwen3_a8w8", input=[{"type": "item_reference", "id": "x"}]),
               dict(model="qwen3_a8w8", input="x", text={"format": {"type": "json_schema", "name": "b",
                                                                    "schema": {"type": "strin"}}}),
               dict(model="qwen3_a8w8", input="x", tools=[{"type": "file_search", "vector_store_ids": []}]),
               dict(model="qwen3_a8w8", input="x", extra_body={"background": True})]
    names = ["reasoning", "input[0].type", "text.format", "tools[0].type", "background"]

    def bad(kw):
        try:
            client.responses.create(**kw)
            return "accepted"
        except openai.BadRequestError as exc:
            return exc.message

    with ThreadPoolExecutor(len(hostile) + 2) as pool:
        goods = [pool.submit(lambda: client.responses.create(**good).output_text) for _ in range(2)]
        bads = [pool.submit(bad, kw) for kw in hostile]
        assert [g.result() for g in goods] == [expected, expected]
        for name, b in zip(names, bads):
            assert name in b.result(), (name, b.result())
    assert triton.model_ready("qwen3_a8w8")


@pytest.mark.slow
@pytest.mark.server
def test_closing_a_stream_aborts_its_triton_request(triton, client):
    model = "qwen3_tq"
    aborted = triton.finished_total(model, "abort")
    stream = client.responses.create(model=model, input="Write a long story.", max_output_tokens=900, temperature=0,
                                     stream=True, extra_body={**NO_THINK, "ignore_eos": True})
    for i, _ in enumerate(stream):
        if i == 6:
            break
    assert triton.wait_until(lambda: triton.metric("vllm:kv_cache_pages_used", model) > 0, 5)
    stream.close()
    assert triton.wait_until(lambda: triton.metric("vllm:kv_cache_pages_used", model) == 0, 2.0)
    assert triton.wait_until(lambda: triton.finished_total(model, "abort") == aborted + 1, 2.0)


@pytest.mark.slow
@pytest.mark.server
def test_the_api_key_guards_the_responses_routes(triton, tmp_path):
    keyed = Front(triton.grpc_url, tmp_path / "keyed.log", "--api-key", "k3y")
    try:
        with pytest.raises(openai.AuthenticationError):
            keyed.client("wrong").responses.create(model="qwen3_a8w8", input="hi", max_output_tokens=2)
        assert requests.get(f"{keyed.url}/v1/responses/resp_x", timeout=10).status_code == 401
        res = keyed.client("k3y").responses.create(model="qwen3_a8w8", input="hi", max_output_tokens=2)
        assert keyed.client("k3y").responses.retrieve(res.id).id == res.id
        assert requests.get(f"{keyed.url}/v1/responses/{res.id}", timeout=10).status_code == 401
    finally:
        keyed.stop()
