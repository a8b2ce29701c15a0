"""The OpenAI front's application surface without a server: chat output formatting (reasoning split, tool
calls, finish reasons) streamed and whole, the request-field audit, tool grammars and response_format."""
from __future__ import annotations

import json

import pytest

from backend_lib.contract.structured import StructuredSpec
from openai_frontend.errors import APIError
from openai_frontend.formats import ChatFormat, TokenNames
from openai_frontend.gateway import Delta
from openai_frontend.params import parse_chat, parse_completion
from openai_frontend.protocol import ChatCompletionRequest, CompletionRequest

MSGS = [{"role": "user", "content": "hi"}]
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
TRANSCRIPT = "<think>\nThe user wants weather.\n</think>\n\n" + CALL
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]


def _fmt(**kw):
    return ChatFormat("m", TokenNames(), **kw)


def _stream(text: str, cuts: list[int], **kw) -> tuple[list[dict], str]:
    fmt = _fmt(**kw)
    pieces = [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]
    chunks = []
    for p in pieces:
        chunks += fmt.delta_chunks(Delta(p, [1]), False)
    chunks += fmt.final_chunks("stop")
    return [c["choices"][0]["delta"] for c in chunks], chunks[-1]["choices"][0]["finish_reason"]


@pytest.mark.parametrize("cuts", [[], [3], [1, 2, 3, 4, 5], list(range(1, len(TRANSCRIPT))), [10, 40, 41, 60]])
def test_reasoning_and_tool_call_stream_equals_whole(cuts):
    whole = _fmt(reasoning=True, parse_tools=True).result(TRANSCRIPT, None, "stop", {})
    msg = whole["choices"][0]["message"]
    assert msg["reasoning_content"] == msg["reasoning"] == "\nThe user wants weather.\n"
    assert msg["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    assert whole["choices"][0]["finish_reason"] == "tool_calls"
    deltas, reason = _stream(TRANSCRIPT, cuts, reasoning=True, parse_tools=True)
    assert reason == "tool_calls"
    assert "".join(d.get("reasoning_content", "") for d in deltas) == msg["reasoning_content"]
    assert "".join(d.get("reasoning", "") for d in deltas) == msg["reasoning"]
    assert "".join(d.get("content") or "" for d in deltas).strip() == (msg["content"] or "").strip()
    calls = [tc for d in deltas for tc in d.get("tool_calls", [])]
    assert calls[0]["function"]["name"] == "get_weather" and calls[0]["id"].startswith("call_")
    assert calls[0]["type"] == "function" and calls[0]["index"] == 0
    assert "".join(tc["function"].get("arguments", "") for tc in calls) == '{"city": "Paris"}'


def test_reasoning_off_thinking_off_and_include_reasoning_false():
    raw = _fmt(reasoning=False).result(TRANSCRIPT, None, "stop", {})["choices"][0]
    assert raw["message"]["content"] == TRANSCRIPT and "reasoning_content" not in raw["message"]
    assert raw["finish_reason"] == "stop"
    off = _fmt(reasoning=True, thinking=False).result("plain answer", None, "stop", {})["choices"][0]["message"]
    assert off["content"] == "plain answer" and off["reasoning_content"] is None and off["reasoning"] is None
    hidden = _fmt(reasoning=True, include_reasoning=False).result("<think>x</think>y", None, "stop", {})
    assert hidden["choices"][0]["message"] == {"role": "assistant", "content": "y", "refusal": None}
    cut = _fmt(reasoning=True).result("<think>still thinking", None, "length", {})["choices"][0]
    assert cut["message"]["reasoning_content"] == "still thinking" and cut["message"]["content"] is None
    assert cut["finish_reason"] == "length"


def test_every_field_outside_the_schema_is_refused_by_name():
    for parse, known in ((parse_chat, ChatCompletionRequest.model_fields),
                         (parse_completion, CompletionRequest.model_fields)):
        base = {"model": "m", "messages": MSGS} if parse is parse_chat else {"model": "m", "prompt": "x"}
        for name in ("functions", "function_call", "audio", "prediction", "web_search_options", "reasoning_effort",
                     "verbosity", "documents", "chat_template", "mm_processor_kwargs", "kv_transfer_params"):
            assert name not in known
            with pytest.raises(APIError) as err:
                parse({**base, name: {"x": 1}})
            assert err.value.status == 400 and name in err.value.message
    with pytest.raises(APIError, match="modalities"):
        parse_chat({"model": "m", "messages": MSGS, "modalities": ["text", "audio"]})
    assert parse_chat({"model": "m", "messages": MSGS, "modalities": ["text"], "store": False, "user": "u",
                       "parallel_tool_calls": True, "service_tier": "auto"}).messages == MSGS


def test_response_format_and_structured_outputs_become_one_constraint():
    gen = parse_chat({"model": "m", "messages": MSGS, "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}, "strict": True}},
        "structured_outputs": {"disable_any_whitespace": True}})
    assert gen.sampling["structured_outputs"] == {"json": {"type": "object"}, "disable_any_whitespace": True}
    assert parse_completion({"model": "m", "prompt": "x", "response_format": {"type": "json_object"}}
                            ).sampling["structured_outputs"] == {"json_object": True}
    assert "structured_outputs" not in parse_chat({"model": "m", "messages": MSGS,
                                                   "response_format": {"type": "text"}}).sampling
    assert parse_chat({"model": "m", "messages": MSGS, "guided_regex": "a+"}).sampling["guided_regex"] == "a+"
    with pytest.raises(APIError, match="response_format"):
        parse_chat({"model": "m", "messages": MSGS, "response_format": {"type": "json_object"},
                    "tools": TOOLS, "tool_choice": "required"})
    with pytest.raises(APIError, match="structured_outputs"):
        parse_chat({"model": "m", "messages": MSGS, "response_format": {"type": "json_object"},
                    "structured_outputs": {"regex": "a"}})


def test_forced_tool_grammars_compile_and_accept_only_listed_calls(a8w8_engine):
    tok = a8w8_engine.tokenizer
    two = TOOLS + [{"type": "function", "function": {"name": "noop"}}]
    required = parse_chat({"model": "m", "messages": MSGS, "tools": two, "tool_choice": "required"})
    named = parse_chat({"model": "m", "messages": MSGS, "tools": two,
                        "tool_choice": {"type": "function", "function": {"name": "get_weather"}}})
    auto = parse_chat({"model": "m", "messages": MSGS, "tools": two})
    assert "structured_outputs" not in auto.sampling and auto.tools.parse_calls
    assert not parse_chat({"model": "m", "messages": MSGS, "tools": two, "tool_choice": "none"}).tools.parse_calls

    def accepts(gen, text):
        spec = StructuredSpec.parse(gen.sampling["structured_outputs"])
        state = a8w8_engine.grammar.matcher(spec, False)
        return state.matcher.try_consume_tokens(tok.encode(text)) == len(tok.encode(text)) and \
            state.matcher.is_accepting()

    noop = '<tool_call>\n{"name": "noop", "arguments": {}}\n</tool_call>'
    assert accepts(required, CALL) and accepts(required, noop) and accepts(required, CALL + "\n" + noop)
    assert accepts(named, CALL) and not accepts(named, noop) and not accepts(named, CALL + "\n" + CALL)
    assert not accepts(required, CALL.replace('"city"', '"town"'))
    assert not accepts(required, "plain text")
    single = parse_chat({"model": "m", "messages": MSGS, "tools": two, "tool_choice": "required",
                         "parallel_tool_calls": False})
    assert accepts(single, CALL) and not accepts(single, CALL + "\n" + noop)
    assert json.loads(CALL.split("\n")[1])["name"] == "get_weather"


from hypothesis import given, settings, strategies as st  # noqa: E402

_values = st.recursive(st.none() | st.booleans() | st.integers(-3, 3) | st.text(max_size=6),
                       lambda c: st.lists(c, max_size=3) | st.dictionaries(
                           st.sampled_from(["type", "function", "name", "parameters", "json_schema", "schema",
                                            "strict", "description", "x"]), c, max_size=3), max_leaves=10)
_fields = st.dictionaries(st.sampled_from(["tools", "tool_choice", "parallel_tool_calls", "response_format",
                                           "structured_outputs", "guided_json", "include_reasoning",
                                           "chat_template_kwargs"]), _values, max_size=4)


@settings(max_examples=300, deadline=None)
@given(_fields)
def test_fuzzed_application_fields_are_a_generation_or_a_400(fields):
    try:
        gen = parse_chat({"model": "m", "messages": MSGS, **fields})
    except APIError as exc:
        assert exc.status == 400
        return
    if gen.tools is not None:
        json.dumps(gen.tools.tools)
        if gen.tools.constraint() is not None:   # the front's own constraint: one the engine parses
            assert StructuredSpec.parse(gen.sampling["structured_outputs"]).kind == "tool_calls"


def _without_tool_call_tokens(src, dst):
    """A copy of the checkpoint at `src` whose vocabulary has no `<tool_call>` / `</tool_call>` token: their two
    added tokens renamed (every id stays), so the text is ordinary BPE tokens, as on a tokenizer without them."""
    dst.mkdir()
    for f in src.iterdir():
        if f.name not in ("tokenizer.json", "tokenizer_config.json"):
            (dst / f.name).symlink_to(f)
    names = {"<tool_call>": "<|unused_0|>", "</tool_call>": "<|unused_1|>"}
    tj = json.loads((src / "tokenizer.json").read_text())
    for t in tj["added_tokens"]:
        t["content"] = names.get(t["content"], t["content"])
    (dst / "tokenizer.json").write_text(json.dumps(tj, ensure_ascii=False))
    cfg = json.loads((src / "tokenizer_config.json").read_text())
    for t in cfg.get("added_tokens_decoder", {}).values():
        t["content"] = names.get(t["content"], t["content"])
    (dst / "tokenizer_config.json").write_text(json.dumps(cfg, ensure_ascii=False))
    return dst


def _first_allowed(engine, gen) -> list[int]:
    import numpy as np
    import torch

    state = engine.grammar.matcher(StructuredSpec.parse(gen.sampling["structured_outputs"]), False)
    mask = torch.zeros((engine.vocab_size + 31) // 32, dtype=torch.int32)
    state.fill_mask(mask)
    return np.flatnonzero(np.unpackbits(mask.numpy().view(np.uint8), bitorder="little")).tolist()


def test_forced_tool_calls_are_built_from_the_vocabulary_with_or_without_tool_call_tokens(a8w8_engine, bf16_ckpt,
                                                                                           tmp_path):
    """Qwen3's vocabulary: a forced call starts with its `<tool_call>` token and nothing else. A vocabulary without
    that token: the same request compiles (no 400 about a token the client never named) and the model writes the
    delimiters as text, which the front's parser reads as the same calls."""
    from helpers import make_engine
    from openai_frontend import tool_calls

    required = parse_chat({"model": "m", "messages": MSGS, "tools": TOOLS, "tool_choice": "required"})
    assert required.sampling["structured_outputs"] == {"tool_calls": {"functions": [
        {"name": "get_weather", "parameters": TOOLS[0]["function"]["parameters"]}], "parallel": True}}
    qwen_open = a8w8_engine.tokenizer.hf.token_to_id("<tool_call>")
    assert _first_allowed(a8w8_engine, required) == [qwen_open]

    plain = make_engine(_without_tool_call_tokens(bf16_ckpt, tmp_path / "plain"))
    tok = plain.tokenizer
    assert tok.hf.token_to_id("<tool_call>") is None and len(tok.encode("<tool_call>")) > 1
    first = _first_allowed(plain, required)
    assert qwen_open not in first and tok.encode("<")[0] in first
    spec = StructuredSpec.parse(required.sampling["structured_outputs"])
    state = plain.grammar.matcher(spec, False)
    ids = tok.encode(CALL + "\n" + CALL)
    assert state.matcher.try_consume_tokens(ids) == len(ids) and state.matcher.is_accepting()
    bounded = [{"type": "function", "function": {"name": "get_weather", "parameters": {   # a random model's call ends
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 12}}, "required": ["city"],
        "additionalProperties": False}}}]
    forced = parse_chat({"model": "m", "messages": MSGS, "tools": bounded, "tool_choice": "required",
                         "parallel_tool_calls": False})
    prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": "Weather in Paris?"}], tools=bounded,
                                                enable_thinking=False))
    datas = [{**forced.sampling, "temperature": 1.0, "seed": s, "max_tokens": 120} for s in (1, 2)]
    for r in plain.generate([prompt] * 2, [plain.make_params(d) for d in datas]):
        assert r["finish_reason"] == "stop", r
        content, calls = tool_calls.parse(r["text"])
        assert content is None and [c.name for c in calls] == ["get_weather"], r["text"]
        assert set(json.loads(calls[0].arguments)) == {"city"}


def _openapi() -> dict:
    from fastapi.testclient import TestClient

    from openai_frontend.app import create_app

    with TestClient(create_app("127.0.0.1:1")) as client:   # the schema needs no Triton
        assert client.get("/docs").status_code == 200
        return client.get("/openapi.json").json()


def test_openapi_lists_every_field_of_every_body_with_its_type_and_range():
    from openai_frontend.protocol import BODIES

    doc = _openapi()
    schemas = doc["components"]["schemas"]
    bodies = {path: op["requestBody"]["content"]["application/json"]["schema"]["$ref"].rsplit("/", 1)[1]
              for path, ops in doc["paths"].items() for method, op in ops.items() if method == "post"}
    assert bodies == {"/v1/chat/completions": "ChatCompletionRequest", "/v1/completions": "CompletionRequest",
                      "/v1/responses": "CreateResponseRequest", "/tokenize": "TokenizeRequest",
                      "/detokenize": "DetokenizeRequest", "/v1/load_lora_adapter": "LoadLoRAAdapterRequest",
                      "/v1/unload_lora_adapter": "UnloadLoRAAdapterRequest",
                      "/v1/embeddings": "EmbeddingRequest", "/v1/rerank": "RerankRequest",
                      "/v2/rerank": "RerankRequest", "/rerank": "RerankRequest", "/v1/score": "ScoreRequest",
                      "/score": "ScoreRequest"}
    from openai_frontend.embeddings_protocol import EMBEDDING_BODIES

    for model in BODIES + EMBEDDING_BODIES:
        schema = schemas[model.__name__]
        assert schema["additionalProperties"] is False
        names = {f.alias or n for n, f in model.model_fields.items()}
        assert set(schema["properties"]) == names, model
        for name, prop in schema["properties"].items():   # what it does, or that it is refused
            assert prop.get("description"), (model, name)

    chat = schemas["ChatCompletionRequest"]["properties"]

    def variant(prop):   # the non-null member of an optional field
        return next((v for v in prop.get("anyOf", [prop]) if v.get("type") != "null"), prop)

    assert variant(chat["n"]) == {"type": "integer", "minimum": 1, "maximum": 16}
    assert variant(chat["temperature"]) == {"type": "number", "minimum": 0.0, "maximum": 1e4}
    assert variant(chat["top_p"])["exclusiveMinimum"] == 0.0 and variant(chat["top_p"])["maximum"] == 1.0
    assert variant(chat["seed"])["maximum"] == 2**64 - 1
    assert variant(chat["max_tokens"]) == {"type": "integer", "minimum": 1, "maximum": 2**31 - 1}
    assert variant(chat["top_logprobs"])["maximum"] == 20 and variant(chat["prompt_logprobs"])["maximum"] == 20
    assert variant(chat["priority"]) == {"type": "integer", "minimum": -2**31, "maximum": 2**31 - 1}
    bias = variant(chat["logit_bias"])
    assert bias["maxProperties"] == 1024 and bias["additionalProperties"] == {
        "type": "number", "minimum": -100.0, "maximum": 100.0}
    assert variant(chat["stream_options"])["$ref"].endswith("/StreamOptions")
    assert set(schemas["StreamOptions"]["properties"]) == {"include_usage", "continuous_usage_stats"}
    assert variant(chat["structured_outputs"])["$ref"].endswith("/StructuredOutputs")
    assert {"json", "regex", "choice", "grammar", "json_object"} <= set(schemas["StructuredOutputs"]["properties"])
    assert schemas["ResponseFormat"]["properties"]["type"]["enum"] == ["text", "json_object", "json_schema"]
    assert chat["best_of"]["enum"] == [1, None] and chat["use_beam_search"]["enum"] == [False, None]
    assert chat["modalities"]["enum"] == [["text"], None] and "Only" in chat["modalities"]["description"]
    assert schemas["ChatMessage"]["properties"]["role"]["enum"] == ["system", "developer", "user", "assistant", "tool"]
    assert set(schemas["ChatCompletionRequest"]["required"]) == {"model", "messages"}
    completion = schemas["CompletionRequest"]["properties"]
    assert variant(completion["logprobs"]) == {"type": "integer", "minimum": 0, "maximum": 20}
    assert completion["suffix"]["enum"] == ["", None]
    responses = schemas["CreateResponseRequest"]["properties"]
    assert responses["background"]["enum"] == [False, None] and responses["conversation"]["type"] == "null"
    assert variant(schemas["DetokenizeRequest"]["properties"]["tokens"]["items"]) == {
        "type": "integer", "minimum": 0, "maximum": 2**31 - 1}


def test_a_body_is_read_as_strict_json_whatever_its_content_type():
    from fastapi.testclient import TestClient

    from openai_frontend.app import create_app

    with TestClient(create_app("127.0.0.1:1")) as client:
        # curl -d sends application/x-www-form-urlencoded: still JSON to the front, validated before Triton
        r = client.post("/v1/completions", content=b'{"model": "m", "prompt": "x", "stream": 7}',
                        headers={"Content-Type": "application/x-www-form-urlencoded"})
        assert r.status_code == 400 and r.json() == {"error": {
            "message": "stream: must be a boolean, got 7", "type": "invalid_request_error", "param": "stream",
            "code": None}}
        r = client.post("/v1/chat/completions", content=b'{"model": "m", "messages": [{"role": "user", "content": '
                                                         b'"x"}, {"role": "user", "content": 3}]}')
        assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
        assert r.json()["error"]["message"].startswith("messages[1].content: ")
        r = client.post("/tokenize", content=b'{"model": "m", "prompt": "x", "prompt": "y"}')
        assert r.status_code == 400 and "duplicate key 'prompt'" in r.json()["error"]["message"]
        r = client.post("/v1/load_lora_adapter", content=b'[]')
        assert r.status_code == 400 and r.json()["error"]["message"] == "the request body must be a JSON object"


def test_metrics_count_requests_and_survive_a_triton_that_does_not_answer():
    import socket
    import time

    from fastapi.testclient import TestClient
    from prometheus_client.parser import text_string_to_metric_families

    from openai_frontend.app import create_app
    from openai_frontend.metrics import default_triton_metrics_url

    assert default_triton_metrics_url("localhost:8001") == "http://localhost:8002/metrics"
    assert default_triton_metrics_url("10.0.0.5:9001") == "http://10.0.0.5:8002/metrics"
    silent = socket.socket()   # accepts connections (the backlog) and never answers
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)
    try:
        app = create_app("127.0.0.1:1", triton_metrics_url=f"http://127.0.0.1:{silent.getsockname()[1]}/metrics")
        with TestClient(app) as client:
            for _ in range(3):
                assert client.post("/v1/completions", content=b'{"model": "m", "bogus": 1}').status_code == 400
            assert client.get("/playground/playground.js").status_code == 200
            start = time.monotonic()
            r = client.get("/metrics")
            assert r.status_code == 200 and time.monotonic() - start < 2.0
    finally:
        silent.close()
    assert r.headers["content-type"].startswith("text/plain; version=0.0.4")
    assert "# Triton metrics unavailable from http://127.0.0.1:" in r.text
    families = {f.name: f for f in text_string_to_metric_families(r.text)}
    counts = {(s.labels["endpoint"], s.labels["status"]): s.value for s in families["openai_frontend_requests"].samples}
    assert counts == {("/v1/completions", "400"): 3, ("/playground", "200"): 1}
    durations = {s.labels["endpoint"]: s.value for s in families["openai_frontend_request_duration_seconds"].samples
                 if s.name.endswith("_count")}
    assert durations == {"/v1/completions": 3, "/playground": 1}
    assert "openai_frontend_time_to_first_token_seconds" in families   # no stream yet: no samples


def test_the_fronts_tokenizer_is_the_folder_the_model_loaded(tmp_path, monkeypatch):
    """The model's environment override first (as the model reads it: $<MODEL>_CHECKPOINT, which serve.sh exports),
    then config.pbtxt's value, a relative one against the model's folder in the repository (as the model resolves it)."""
    import asyncio

    from openai_frontend.tokenize_api import ModelTokenizers

    class Gateway:
        async def model_parameters(self, name):
            return {"checkpoint": "../../demo_checkpoints/qwen3-0.6b-bf16"}

    repo = tmp_path / "model_repository"
    (repo / "qwen3_tq").mkdir(parents=True)
    tokenizers = ModelTokenizers(Gateway(), None, str(repo))
    monkeypatch.delenv("QWEN3_TQ_CHECKPOINT", raising=False)
    monkeypatch.delenv("QWEN3_TQ_TOKENIZER", raising=False)
    assert asyncio.run(tokenizers.location("qwen3_tq")) == str(tmp_path / "demo_checkpoints" / "qwen3-0.6b-bf16")
    monkeypatch.setenv("QWEN3_TQ_CHECKPOINT", "/ckpt/bf16")
    assert asyncio.run(tokenizers.location("qwen3_tq")) == "/ckpt/bf16"
    monkeypatch.setenv("QWEN3_TQ_TOKENIZER", "/ckpt/tok")
    assert asyncio.run(tokenizers.location("qwen3_tq")) == "/ckpt/tok"
