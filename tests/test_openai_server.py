"""The OpenAI-compatible front (openai_frontend) over the real tritonserver, driven by the openai SDK."""
from __future__ import annotations

import json
import re
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest
import requests
from openai import OpenAI

from backend_lib.sampling.params import bad_words_token_ids
from backend_lib.tokenizer import Tokenizer
from client.stream import stream_generate
from helpers import ROOT, tokenizer_model
from harness.openai_front import Front
from harness.triton_server import free_port

pytestmark = [pytest.mark.slow, pytest.mark.server]
PROMPT = "The quick brown fox jumps over the lazy dog"
MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "介绍一下北京故宫"}]
GREEDY = {"temperature": 0, "extra_body": {"ignore_eos": True}}
API_KEY = "s3cret-key"


@pytest.fixture(scope="module")
def front(triton, bf16_ckpt, tmp_path_factory):
    server = Front(triton.grpc_url, tmp_path_factory.mktemp("openai") / "front.log", "--tokenizer", str(bf16_ckpt))
    yield server
    server.stop()


@pytest.fixture(scope="module")
def keyed_front(triton, tmp_path_factory):
    server = Front(triton.grpc_url, tmp_path_factory.mktemp("openai") / "keyed.log", env={"QWEN3_API_KEY": API_KEY})
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(front) -> OpenAI:
    return front.client()


@pytest.fixture(scope="module")
def tok(a8w8_ckpt):
    return Tokenizer(a8w8_ckpt)


def template_ids(triton, messages, thinking: bool) -> list[int]:
    return tokenizer_model(triton.grpc_url, messages=json.dumps(messages, ensure_ascii=False), enable_thinking=thinking)


def wait_until(predicate, timeout: float, period: float = 0.05) -> bool:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if predicate():
            return True
        time.sleep(period)
    return predicate()


# ----- health and models ----------------------------------------------------------------------------
def test_health_and_models_list_the_llm_models_not_the_tokenizer_or_ensembles(front, client):
    assert requests.get(f"{front.url}/health", timeout=10).status_code == 200
    assert [m.id for m in client.models.list()] == ["qwen3_a8w8", "qwen3_tq"]
    assert client.models.retrieve("qwen3_tq").id == "qwen3_tq"


def test_without_triton_health_and_requests_get_503(tmp_path):
    dead = Front(f"localhost:{free_port()}", tmp_path / "dead.log")
    try:
        assert requests.get(f"{dead.url}/health", timeout=30).status_code == 503
        with pytest.raises(openai.InternalServerError) as err:
            dead.client().completions.create(model="qwen3_a8w8", prompt=PROMPT, max_tokens=4)
        assert err.value.status_code == 503
    finally:
        dead.stop()


# ----- completions ----------------------------------------------------------------------------------
def test_completion_stream_equals_whole_equals_triton_with_exact_usage(triton, client, tok):
    expected = stream_generate(triton.grpc_url, "qwen3_a8w8", PROMPT, max_tokens=16,
                               sampling_parameters={"temperature": 0, "ignore_eos": True})
    whole = client.completions.create(model="qwen3_a8w8", prompt=PROMPT, max_tokens=16, **GREEDY)
    chunks = list(client.completions.create(model="qwen3_a8w8", prompt=PROMPT, max_tokens=16, stream=True,
                                            stream_options={"include_usage": True}, **GREEDY))
    streamed = "".join(c.choices[0].text for c in chunks if c.choices)
    assert whole.choices[0].text == streamed == expected["text"]
    assert whole.choices[0].finish_reason == "length"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert all(c.object == "text_completion" for c in chunks)
    n_prompt = len(tok.encode(PROMPT))
    assert (whole.usage.prompt_tokens, whole.usage.completion_tokens, whole.usage.total_tokens) == (n_prompt, 16,
                                                                                                    n_prompt + 16)
    assert chunks[-1].choices == [] and chunks[-1].usage.model_dump() == whole.usage.model_dump()


def test_completion_sampled_with_a_seed_equals_triton(triton, client):
    expected = stream_generate(triton.grpc_url, "qwen3_tq", PROMPT, max_tokens=12, temperature=0.8, top_p=0.9, seed=7,
                               sampling_parameters={"ignore_eos": True})
    kw = dict(model="qwen3_tq", prompt=PROMPT, max_tokens=12, temperature=0.8, top_p=0.9, seed=7,
              extra_body={"ignore_eos": True})
    whole = client.completions.create(**kw)
    streamed = "".join(c.choices[0].text for c in client.completions.create(stream=True, **kw))
    assert whole.choices[0].text == streamed == expected["text"]
    assert whole.usage.completion_tokens == len(expected["output_ids"]) == 12


def test_completion_from_token_ids_and_stop_strings(triton, client):
    ids = [9707, 11, 1879, 0, 2585, 525, 498]
    expected = stream_generate(triton.grpc_url, "qwen3_a8w8", input_ids=ids, max_tokens=16,
                               sampling_parameters={"temperature": 0, "ignore_eos": True})
    whole = client.completions.create(model="qwen3_a8w8", prompt=ids, max_tokens=16, **GREEDY)
    assert whole.choices[0].text == expected["text"] and whole.usage.prompt_tokens == len(ids)
    text = expected["text"]
    stop = text[len(text) // 2:len(text) // 2 + 2]
    stopped = client.completions.create(model="qwen3_a8w8", prompt=[ids], max_tokens=16, stop=[stop], **GREEDY)
    assert stopped.choices[0].text == text[:text.index(stop)]
    assert stopped.choices[0].finish_reason == "stop"


def test_completion_logprobs(client):
    res = client.completions.create(model="qwen3_a8w8", prompt=PROMPT, max_tokens=6, logprobs=2, **GREEDY)
    lp = res.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 6
    assert all(len(top) == 2 for top in lp.top_logprobs)
    # greedy: the chosen token is the most likely one
    for chosen, top in zip(lp.token_logprobs, lp.top_logprobs, strict=True):
        assert chosen == pytest.approx(max(top.values()))
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)


# ----- chat -----------------------------------------------------------------------------------------
def test_chat_stream_equals_whole_equals_the_llm_on_the_template_ids(triton, client):
    ids = template_ids(triton, MESSAGES, thinking=False)
    expected = stream_generate(triton.grpc_url, "qwen3_a8w8", input_ids=ids, max_tokens=12,
                               sampling_parameters={"temperature": 0, "ignore_eos": True})
    kw = dict(model="qwen3_a8w8", messages=MESSAGES, max_completion_tokens=12, temperature=0,
              extra_body={"ignore_eos": True, "chat_template_kwargs": {"enable_thinking": False}})
    whole = client.chat.completions.create(**kw)
    chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    assert whole.object == "chat.completion" and whole.choices[0].message.role == "assistant"
    assert chunks[0].choices[0].delta.role == "assistant"
    choice_chunks = [c for c in chunks if c.choices]
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    streamed = "".join(c.choices[0].delta.content or "" for c in choice_chunks)
    assert whole.choices[0].message.content == streamed == expected["text"]
    assert choice_chunks[-1].choices[0].finish_reason == "length"
    assert all(c.choices[0].finish_reason is None for c in choice_chunks[:-1])
    assert whole.usage.prompt_tokens == len(ids) and whole.usage.completion_tokens == 12
    assert chunks[-1].choices == [] and chunks[-1].usage.model_dump() == whole.usage.model_dump()


def test_chat_sampled_with_a_seed_and_enable_thinking_reaches_the_template(triton, client):
    ids = template_ids(triton, MESSAGES, thinking=True)
    assert ids != template_ids(triton, MESSAGES, thinking=False)
    expected = stream_generate(triton.grpc_url, "qwen3_a8w8", input_ids=ids, max_tokens=10, temperature=0.8, seed=7,
                               sampling_parameters={"ignore_eos": True})
    kw = dict(model="qwen3_a8w8", messages=MESSAGES, max_tokens=10, temperature=0.8, seed=7,
              extra_body={"ignore_eos": True, "chat_template_kwargs": {"enable_thinking": True}})
    whole = client.chat.completions.create(**kw)
    chunks = [c for c in client.chat.completions.create(stream=True, **kw) if c.choices]
    # thinking on and no </think> in 10 random tokens: all of it is reasoning (vLLM's qwen3 parser)
    assert whole.choices[0].message.content is None and whole.choices[0].message.reasoning_content == expected["text"]
    assert "".join(_delta_text(c) for c in chunks) == expected["text"]
    assert all(not c.choices[0].delta.content for c in chunks)
    assert whole.usage.prompt_tokens == len(ids)


def _delta_text(chunk) -> str:
    """A chat chunk's reasoning and content text together."""
    d = chunk.choices[0].delta
    return (getattr(d, "reasoning_content", None) or "") + (d.content or "")


def test_chat_logprobs(client):
    res = client.chat.completions.create(model="qwen3_tq", messages=MESSAGES, max_tokens=5, logprobs=True,
                                         top_logprobs=3, **GREEDY)
    content = res.choices[0].logprobs.content
    assert len(content) == 5
    for entry in content:
        assert len(entry.top_logprobs) == 3
        assert entry.logprob == pytest.approx(max(t.logprob for t in entry.top_logprobs))
        assert bytes(entry.bytes).decode("utf-8", errors="replace") == entry.token


def test_raw_server_sent_events_format(front):
    body = {"model": "qwen3_a8w8", "messages": MESSAGES, "max_tokens": 4, "stream": True, "temperature": 0,
            "ignore_eos": True}
    with requests.post(f"{front.url}/v1/chat/completions", json=body, stream=True, timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        raw = r.content.decode()
    events = raw.split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    payloads = [json.loads(e[len("data: "):]) for e in events[:-2]]
    assert all(e.startswith("data: ") for e in events[:-1])
    assert payloads[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert payloads[-1]["choices"][0]["finish_reason"] == "length" and payloads[-1]["choices"][0]["delta"] == {}
    assert len({p["id"] for p in payloads}) == 1


# ----- errors ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind, fields, param", [
    ("completion", {"temperature": -1}, "temperature"),
    ("completion", {"n": 20}, "n"),
    ("completion", {"top_p": 1.5}, "top_p"),
    ("completion", {"max_tokens": 0}, "max_tokens"),
    ("completion", {"max_tokens": 100000}, "max_tokens"),   # the LLM model's own limit (INVALID_ARG)
    ("completion", {"prompt": None}, "prompt"),
    ("completion", {"extra_body": {"temperature": "hot"}}, "temperature"),
    ("chat", {"n": 30}, "n"),
    ("chat", {"messages": None}, "messages"),
    ("chat", {"messages": [{"role": "wizard", "content": "hi"}]}, "messages"),
    ("chat", {"top_logprobs": 2}, "top_logprobs"),
    ("chat", {"stream": True, "extra_body": {"top_k": "x"}}, "top_k"),
    ("chat", {"stream": True, "logprobs": True, "top_logprobs": 50}, "top_logprobs"),
])
def test_bad_request_gets_400_naming_the_field(client, kind, fields, param):
    fields = dict(fields)
    extra = fields.pop("extra_body", {})
    with pytest.raises(openai.BadRequestError) as err:
        if kind == "completion":
            client.completions.create(**{"model": "qwen3_a8w8", "prompt": PROMPT, "max_tokens": 4, **fields},
                                      extra_body=extra)
        else:
            client.chat.completions.create(**{"model": "qwen3_a8w8", "messages": MESSAGES, "max_tokens": 4, **fields},
                                           extra_body=extra)
    assert err.value.status_code == 400
    assert err.value.param == param and param in err.value.message
    assert err.value.body["type"] == "invalid_request_error"


def _post(front, kind: str, fields: dict, stream: bool = False, **kw) -> requests.Response:
    """A raw POST (any number, NaN included): completions or chat, 4 tokens by default."""
    base = {"prompt": PROMPT} if kind == "completion" else {"messages": MESSAGES}
    body = {"model": "qwen3_a8w8", "max_tokens": 4, **base, **fields}
    path = "completions" if kind == "completion" else "chat/completions"
    return requests.post(f"{front.url}/v1/{path}", data=json.dumps(body), stream=stream, timeout=60,   # NaN too
                         headers={"Content-Type": "application/json"}, **kw)


# each number past its wire type (int32, uint64) or its table range (backend_lib.contract.fields.RANGES)
@pytest.mark.parametrize("kind, fields, param", [
    ("completion", {"prompt": [9707, 2**31]}, "prompt"),
    ("completion", {"prompt": [[9707, 2**32 + 9707]]}, "prompt"),   # would wrap to 9707 as int32
    ("completion", {"prompt": [-1, 11]}, "prompt"),
    ("completion", {"max_tokens": 2**32 + 5}, "max_tokens"),          # would wrap to 5
    ("chat", {"max_tokens": None, "max_completion_tokens": 2**32 + 5}, "max_completion_tokens"),
    ("completion", {"min_tokens": 2**31}, "min_tokens"),
    ("completion", {"seed": 2**64}, "seed"),                         # would wrap to 0 as uint64
    ("chat", {"seed": -1}, "seed"),
    ("chat", {"top_k": 2**40}, "top_k"),
    ("completion", {"top_k": -2}, "top_k"),
    ("completion", {"logprobs": 2**32 + 1}, "logprobs"),
    ("chat", {"logprobs": True, "top_logprobs": 2**32 + 2}, "top_logprobs"),
    ("completion", {"stop_token_ids": [151645, 2**32]}, "stop_token_ids"),
    ("chat", {"temperature": 1e300}, "temperature"),                 # inf as fp32
    ("completion", {"temperature": float("nan")}, "temperature"),
    ("completion", {"top_p": 0}, "top_p"),
    ("completion", {"min_p": 1.5}, "min_p"),
    ("chat", {"presence_penalty": 2.5}, "presence_penalty"),
    ("completion", {"frequency_penalty": -3}, "frequency_penalty"),
    ("chat", {"repetition_penalty": 0}, "repetition_penalty"),
    ("completion", {"max_tokens": 2.5}, "max_tokens"),
    # vLLM/OpenAI fields accepted only with their neutral value
    ("completion", {"n": 2**31}, "n"),
    ("chat", {"n": True}, "n"),
    ("completion", {"best_of": 3}, "best_of"),
    ("chat", {"logit_bias": {"15": 100.5}}, "logit_bias"),
    ("completion", {"logit_bias": {str(i): 1 for i in range(10**4)}}, "logit_bias"),
    ("completion", {"logit_bias": {"x": 1}}, "logit_bias"),
    ("chat", {"allowed_token_ids": [2**31]}, "allowed_token_ids"),
    ("completion", {"bad_words": ["x"] * 1000}, "bad_words"),
    ("completion", {"echo": "yes"}, "echo"),
    ("chat", {"use_beam_search": True}, "use_beam_search"),
    ("completion", {"stream": True, "prompt_logprobs": 1}, "prompt_logprobs"),
])
def test_out_of_range_numbers_get_400_naming_the_field_never_a_wrapped_value(triton, front, kind, fields, param):
    before = triton.metric("vllm:prompt_tokens_total", "qwen3_a8w8")
    r = _post(front, kind, fields)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and param in err["message"] and err["type"] == "invalid_request_error"
    assert triton.metric("vllm:prompt_tokens_total", "qwen3_a8w8") == before   # refused before Triton


@pytest.mark.parametrize("body, words", [
    ("[" * 1000 + "]" * 1000, "nested deeper than 64"),
    ('{"model": "qwen3_a8w8", "prompt": ' + "[" * 1000 + "1" + "]" * 1000 + "}", "nested deeper than 64"),
    ('{"model": "qwen3_a8w8", "prompt": "x", "a": ' + '{"b": ' * 100000 + "1" + "}" * 100000 + "}",
     "nested deeper than 64"),
    ("{not json", "the request body: malformed JSON"),
    (b"\xff\xfe{}", "the request body: not valid UTF-8"),
    ('{"model": "qwen3_a8w8", "prompt": "x", "max_tokens": ' + "9" * 5000 + "}", "max_tokens: 999"),
    ('{"model": "qwen3_a8w8", "prompt": "x", "temperature": ' + "1" + "0" * 400 + "}", "temperature: 100"),
    ('{"model": "qwen3_a8w8", "prompt": "\\ud800"}', "prompt: contains a lone UTF-16 surrogate"),
    ('{"model": "qwen3_a8w8", "prompt": "x", "top_p": NaN}', "top_p: NaN is not a JSON number"),
    ('{"model": "qwen3_a8w8", "prompt": "x", "prompt": "y"}', "duplicate key 'prompt'"),
])
def test_deep_or_malformed_json_bodies_get_400_not_500(front, body, words):
    for path in ("completions", "chat/completions"):
        r = requests.post(f"{front.url}/v1/{path}", data=body, timeout=30,
                          headers={"Content-Type": "application/json"})
        assert r.status_code == 400, r.text[:300]
        assert words in r.json()["error"]["message"]


def test_neutral_vllm_and_openai_values_are_accepted(triton, front):
    neutral = {"n": 1, "best_of": 1, "logit_bias": {}, "echo": False, "suffix": None, "top_k": -1,
               "use_beam_search": False, "length_penalty": 1.0, "prompt_logprobs": None, "min_p": 0.0}
    plain = _post(front, "completion", {"max_tokens": 6, "temperature": 0, "ignore_eos": True})
    with_neutral = _post(front, "completion", {"max_tokens": 6, "temperature": 0, "ignore_eos": True, **neutral})
    assert plain.status_code == with_neutral.status_code == 200, with_neutral.text
    assert with_neutral.json()["choices"][0]["text"] == plain.json()["choices"][0]["text"]
    assert with_neutral.json()["usage"]["completion_tokens"] == 6
    chat = _post(front, "chat", {"n": 1, "logit_bias": None, "best_of": 1, "min_p": 0.05, "max_tokens": 3,
                                 "temperature": 0, "ignore_eos": True})
    assert chat.status_code == 200 and chat.json()["usage"]["completion_tokens"] == 3, chat.text


@pytest.mark.parametrize("kind", ["completion", "chat"])
def test_logit_bias_allowed_token_ids_and_bad_words_reach_the_sampler(triton, front, tok, kind):
    base = {"max_tokens": 5, "temperature": 0, "ignore_eos": True}

    def tokens(fields):
        r = _post(front, kind, {**base, **fields, "logprobs": 1 if kind == "completion" else True})
        assert r.status_code == 200, r.text
        lp = r.json()["choices"][0]["logprobs"]
        return lp["tokens"] if kind == "completion" else [e["token"] for e in lp["content"]]

    plain = tokens({})
    forced = tok.decode([1234], skip_special_tokens=False)
    assert plain != [forced] * 5
    assert tokens({"logit_bias": {"1234": 100}}) == [forced] * 5
    assert tokens({"allowed_token_ids": [1234, 4321], "logit_bias": {"4321": -100}}) == [forced] * 5
    if kind == "completion":   # a bad word: the first reference token that round-trips through the tokenizer
        ref = stream_generate(triton.grpc_url, "qwen3_a8w8", PROMPT, sampling_parameters=base)["output_ids"]
        i = next(i for i, t in enumerate(ref) if [t] in bad_words_token_ids([tok.decode([t])], tok.encode))
        banned = tokens({"bad_words": [tok.decode([ref[i]])]})
        assert banned[:i] == plain[:i] and banned[i] != plain[i]
    r = _post(front, kind, {**base, "logit_bias": {"9999999": 5}})   # outside the vocabulary: the model's check
    assert r.status_code == 400 and r.json()["error"]["param"] == "logit_bias", r.text
    assert tokens({}) == plain   # nothing left behind


def test_the_largest_seed_reaches_triton_unwrapped(triton, front):
    seed = 2**64 - 1   # the largest uint64: sent as is
    expected = stream_generate(triton.grpc_url, "qwen3_tq", PROMPT, max_tokens=8, temperature=1.0, seed=seed,
                               sampling_parameters={"ignore_eos": True})
    r = _post(front, "completion", {"model": "qwen3_tq", "max_tokens": 8, "temperature": 1.0, "seed": seed,
                                    "ignore_eos": True})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == expected["text"]


def test_a_stream_that_triton_rejects_gets_400_not_an_event_stream(front):
    body = {"model": "qwen3_tq", "prompt": PROMPT, "max_tokens": 100000, "stream": True}
    r = requests.post(f"{front.url}/v1/completions", json=body, timeout=60)
    assert r.status_code == 400 and "max_tokens" in r.json()["error"]["message"]


def test_unknown_model_gets_404(front, client):
    for model in ("no_such_model", "qwen3_a8w8_ensemble", "qwen3_tokenizer"):
        with pytest.raises(openai.NotFoundError) as err:
            client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=4)
        assert err.value.body["code"] == "model_not_found"
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="no_such_model", prompt=PROMPT, max_tokens=4)
    assert requests.get(f"{front.url}/v1/models/no_such_model", timeout=10).status_code == 404
    r = requests.post(f"{front.url}/v1/completions", data=b"{not json", timeout=10)
    assert r.status_code == 400 and "error" in r.json()


# ----- API key --------------------------------------------------------------------------------------
def test_api_key_is_required_and_a_rejected_request_never_reaches_triton(triton, keyed_front):
    before = triton.metric("vllm:prompt_tokens_total", "qwen3_a8w8")
    with pytest.raises(openai.AuthenticationError):
        keyed_front.client("wrong-key").completions.create(model="qwen3_a8w8", prompt=PROMPT, max_tokens=4)
    with pytest.raises(openai.AuthenticationError):
        keyed_front.client("wrong-key").models.list()
    r = requests.post(f"{keyed_front.url}/v1/chat/completions", timeout=10,
                      json={"model": "qwen3_a8w8", "messages": MESSAGES, "max_tokens": 4})
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    time.sleep(0.3)
    assert triton.metric("vllm:prompt_tokens_total", "qwen3_a8w8") == before
    assert requests.get(f"{keyed_front.url}/health", timeout=10).status_code == 200
    ok = keyed_front.client(API_KEY).completions.create(model="qwen3_a8w8", prompt=PROMPT, max_tokens=3, **GREEDY)
    assert ok.usage.completion_tokens == 3


# ----- cancellation ---------------------------------------------------------------------------------
def _pages(triton, model):
    return triton.metric("vllm:kv_cache_pages_used", model)


@pytest.mark.parametrize("kind", ["chat", "completion"])
def test_closing_a_stream_early_frees_the_requests_pages(triton, client, kind):
    model = "qwen3_tq"
    cancelled, aborted = triton.finished_total(model, "cancelled"), triton.finished_total(model, "abort")
    if kind == "chat":
        stream = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=900, stream=True, **GREEDY)
    else:
        stream = client.completions.create(model=model, prompt=PROMPT, max_tokens=900, stream=True, **GREEDY)
    for i, _ in enumerate(stream):
        if i == 5:
            break
    assert wait_until(lambda: _pages(triton, model) > 0, 5)
    stream.close()
    t0 = time.time()
    assert wait_until(lambda: _pages(triton, model) == 0, 2.0), "the Triton request kept its KV pages"
    assert time.time() - t0 < 2.0   # far less than 900 tokens take
    assert triton.metric("vllm:num_requests_running", model) == 0
    # aborted by an abort request on the same gRPC stream, not by a gRPC cancellation
    assert (triton.finished_total(model, "abort"), triton.finished_total(model, "cancelled")) == (aborted + 1, cancelled)
    assert client.completions.create(model=model, prompt=PROMPT, max_tokens=3, **GREEDY).usage.completion_tokens == 3


def test_sigterm_aborts_the_fronts_streams_and_exits_within_seconds_with_a_slow_reader(triton, tmp_path):
    """A stop signal ends every open response at once (its final chunk, finish_reason abort, then [DONE]), and
    the front exits within seconds although one client stopped reading; Triton's requests end too."""
    model = "qwen3_tq"
    own = Front(triton.grpc_url, tmp_path / "front.log")
    body = json.dumps({"model": model, "prompt": PROMPT, "max_tokens": 1000, "temperature": 0, "ignore_eos": True,
                       "stream": True}).encode()
    slow = socket.create_connection(("127.0.0.1", own.port))   # sends its request, then never reads
    slow.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    slow.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    reader = requests.post(f"{own.url}/v1/completions", data=body, stream=True, timeout=60,
                           headers={"Content-Type": "application/json"})
    lines = reader.iter_lines()
    for _ in range(6):
        next(lines)
    assert wait_until(lambda: triton.metric("vllm:num_requests_running", model) >= 2, 10)
    t0 = time.time()
    own.proc.send_signal(signal.SIGTERM)
    events = [line.decode() for line in lines if line]
    got_end = time.time() - t0
    assert events[-1] == "data: [DONE]", events[-3:]
    final = json.loads(events[-2][len("data: "):])
    assert final["choices"][0]["finish_reason"] == "abort", final
    assert got_end < 3.0, f"the final chunk came {got_end:.1f} s after the signal"
    own.proc.wait(timeout=10)
    exited = time.time() - t0
    slow.close()
    own._log.close()
    assert exited < 6.0, f"the front exited {exited:.1f} s after the signal"
    assert wait_until(lambda: triton.metric("vllm:num_requests_running", model) == 0, 5)


def test_a_client_that_gives_up_on_a_whole_response_cancels_it(triton, front):
    model = "qwen3_tq"
    cancelled, aborted = triton.finished_total(model, "cancelled"), triton.finished_total(model, "abort")
    body = {"model": model, "prompt": PROMPT, "max_tokens": 900, "temperature": 0, "ignore_eos": True}
    with pytest.raises(requests.Timeout):   # the tiny model writes 900 tokens in ~1 s: give up well before
        requests.post(f"{front.url}/v1/completions", json=body, timeout=0.3)
    assert wait_until(lambda: _pages(triton, model) == 0, 2.0)
    assert (triton.finished_total(model, "abort"), triton.finished_total(model, "cancelled")) == (aborted + 1, cancelled)


# ----- a disconnect storm ---------------------------------------------------------------------------
STORM_WAVES, STORM_WAVE_SIZE = 3, 20
STORM_MODELS = ("qwen3_tq", "qwen3_a8w8")


def _storm_request(front, i: int) -> str:
    """One impatient client: a long greedy stream (chat or completion, either model), dropped after its first
    chunk. Returns how it went."""
    kind = "chat" if i % 2 else "completion"
    fields = {"model": STORM_MODELS[(i // 2) % 2], "max_tokens": 900, "stream": True, "temperature": 0,
              "ignore_eos": True}
    with requests.Session() as session:
        path = "completions" if kind == "completion" else "chat/completions"
        body = {**({"prompt": f"{PROMPT} {i}"} if kind == "completion" else {"messages": MESSAGES}), **fields}
        r = session.post(f"{front.url}/v1/{path}", json=body, stream=True, timeout=120)
        if r.status_code != 200:
            return f"status {r.status_code}: {r.text[:200]}"
        for line in r.iter_lines():
            if line.startswith(b"data: "):
                break
        r.close()   # the connection goes with it: the client disconnects mid-stream
    return "dropped"


def _greedy_stream(client, kind: str, model: str) -> tuple[str, int]:
    """A well-behaved client: one greedy stream read to its end; its text and completion tokens."""
    if kind == "chat":
        chunks = list(client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=48, stream=True,
                                                     stream_options={"include_usage": True}, **GREEDY))
        text = "".join(_delta_text(c) for c in chunks if c.choices)
    else:
        chunks = list(client.completions.create(model=model, prompt=PROMPT, max_tokens=48, stream=True,
                                                stream_options={"include_usage": True}, **GREEDY))
        text = "".join(c.choices[0].text for c in chunks if c.choices)
    return text, chunks[-1].usage.completion_tokens


def _outcome(future):
    try:
        return future.result(timeout=300)
    except Exception as exc:   # reported after the server's liveness, the first thing to know
        return f"failed: {exc!r}"


def test_a_disconnect_storm_never_takes_the_server_down(triton, front, client):
    """60 streams dropped by their clients after the first chunk, in waves, while 3 greedy streams run beside
    them: the server lives, the greedy streams get exactly their solo tokens, every dropped request is
    aborted (an abort request on its gRPC stream, never a gRPC cancellation) and every KV page comes back."""
    good = [("completion", "qwen3_tq"), ("chat", "qwen3_a8w8"), ("completion", "qwen3_a8w8")]
    solo = [_greedy_stream(client, kind, model) for kind, model in good]
    assert all(n == 48 for _, n in solo)
    aborted = {m: triton.finished_total(m, "abort") for m in STORM_MODELS}
    cancelled = {m: triton.finished_total(m, "cancelled") for m in STORM_MODELS}
    lengths = {m: triton.finished_total(m, "length") for m in STORM_MODELS}
    t0 = time.time()
    with ThreadPoolExecutor(len(good) + STORM_WAVE_SIZE) as pool:
        beside = [pool.submit(_greedy_stream, client, kind, model) for kind, model in good]
        outcomes = []
        for wave in range(STORM_WAVES):
            outcomes += [_outcome(f) for f in [pool.submit(_storm_request, front, i) for i in
                                               range(wave * STORM_WAVE_SIZE, (wave + 1) * STORM_WAVE_SIZE)]]
        beside = [_outcome(f) for f in beside]
    storm_s = time.time() - t0
    assert triton.proc.poll() is None, f"tritonserver died ({triton.proc.returncode}):\n{triton.log_tail(80)}"
    assert outcomes == ["dropped"] * STORM_WAVES * STORM_WAVE_SIZE
    assert beside == solo
    t1 = time.time()
    for m in STORM_MODELS:
        assert triton.wait_until(lambda m=m: _pages(triton, m) == 0, 20), f"{m} kept KV pages after the storm"
    freed_s = time.time() - t1
    storms = STORM_WAVES * STORM_WAVE_SIZE
    # A dropped stream ends 'abort', or 'length' when its 900 tokens were all generated before the front saw the
    # client go (the front and the clients share 2 cores with the server); the greedy streams beside end 'length'.
    delta = lambda r: sum(triton.finished_total(m, r) - (aborted if r == "abort" else lengths)[m]  # noqa: E731
                          for m in STORM_MODELS)
    assert triton.wait_until(lambda: delta("abort") + delta("length") - len(good) >= storms, 30), {
        (m, r): triton.finished_total(m, r) for m in STORM_MODELS for r in ("stop", "length", "abort", "cancelled",
                                                                             "error")}
    assert delta("abort") + delta("length") - len(good) == storms
    assert delta("abort") >= storms // 2, f"only {delta('abort'):.0f} of {storms} dropped streams were aborted"
    aborts = {m: triton.finished_total(m, "abort") - aborted[m] for m in STORM_MODELS}
    assert {m: triton.finished_total(m, "cancelled") - cancelled[m] for m in STORM_MODELS} == {m: 0 for m in STORM_MODELS}
    assert triton.proc.poll() is None and front.proc.poll() is None
    assert "cancelling the stream" not in Path(front.log_path).read_text()   # no abort fell back to a cancel
    # and both keep serving
    assert client.completions.create(model="qwen3_tq", prompt=PROMPT, max_tokens=3, **GREEDY).usage.completion_tokens == 3
    print(f"\ndisconnect storm: {storms} streams dropped after their first chunk in {STORM_WAVES} waves of "
          f"{STORM_WAVE_SIZE}, {len(good)} greedy streams beside them (tokens equal to their solo runs), "
          f"{storm_s:.1f} s; aborted {sum(aborts.values()):.0f} {aborts}, finished before their abort arrived "
          f"{storms - sum(aborts.values()):.0f}, cancelled 0, server deaths 0, "
          f"KV pages back to 0 {freed_s:.2f} s after the storm")


def test_cache_salt_reaches_the_prefix_cache(triton, client):
    m = "qwen3_tq"
    prompt = "Shared context for every tenant. " * 10
    hits = lambda: triton.metric("vllm:prefix_cache_hits_total", m)  # noqa: E731
    kw = dict(model=m, prompt=prompt, max_tokens=4, temperature=0)
    first = client.completions.create(**kw, extra_body={"cache_salt": "a"})
    a = first.choices[0].text
    h0 = hits()
    other = client.completions.create(**kw, extra_body={"cache_salt": "b"})
    assert other.choices[0].text == a and other.usage.prompt_tokens_details.cached_tokens == 0
    assert hits() == h0                                       # another salt shares nothing
    again = client.completions.create(**kw, extra_body={"cache_salt": "a"})
    assert again.choices[0].text == a
    assert hits() - h0 == again.usage.prompt_tokens_details.cached_tokens > 0   # usage reports the cache hit
    # the same whole prompt: its full pages shared, its partial last page copied, the last token computed
    assert again.usage.prompt_tokens_details.cached_tokens == again.usage.prompt_tokens - 1
    with pytest.raises(openai.BadRequestError, match="cache_salt"):
        client.completions.create(**kw, extra_body={"cache_salt": 5})


# ----- applications: structured output, tool calls, reasoning (issue 14) ---------------------------------
NO_THINK = {"chat_template_kwargs": {"enable_thinking": False}}
COMPACT = {"structured_outputs": {"disable_any_whitespace": True}}   # random weights: no endless indentation
SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 10},
                                      "age": {"type": "integer", "minimum": 0, "maximum": 120}},
     "required": ["name", "age"], "additionalProperties": False},
    {"type": "object", "properties": {"items": {"type": "array", "minItems": 1, "maxItems": 3,
                                                "items": {"type": "object", "additionalProperties": False,
                                                          "properties": {"sku": {"enum": ["a1", "b2"]},
                                                                         "qty": {"type": "integer", "minimum": 1,
                                                                                 "maximum": 9}},
                                                          "required": ["sku", "qty"]}},
                                      "note": {"type": "string", "maxLength": 6}},
     "required": ["items", "note"], "additionalProperties": False},
    {"type": "object", "properties": {"ratio": {"type": "number", "minimum": 0, "maximum": 1},
                                      "flag": {"type": "boolean"}, "level": {"enum": ["low", "high"]}},
     "required": ["ratio", "flag", "level"], "additionalProperties": False},
]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                                    "unit": {"enum": ["c", "f"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 8}},
                                       "required": ["zone"], "additionalProperties": False}}}


@pytest.mark.parametrize("schema", SCHEMAS)
def test_json_schema_response_format_validates(client, schema):
    import jsonschema

    fmt = {"type": "json_schema", "json_schema": {"name": "out", "schema": schema, "strict": True}}
    for seed in (1, 2):
        res = client.chat.completions.create(model="qwen3_a8w8", messages=MESSAGES, max_tokens=120, temperature=1.0,
                                             seed=seed, response_format=fmt, extra_body={**NO_THINK, **COMPACT})
        assert res.choices[0].finish_reason == "stop", res
        jsonschema.validate(json.loads(res.choices[0].message.content), schema)
    stream = client.chat.completions.create(model="qwen3_tq", messages=MESSAGES, max_tokens=120, temperature=0,
                                            response_format=fmt, stream=True, extra_body={**NO_THINK, **COMPACT})
    jsonschema.validate(json.loads("".join(c.choices[0].delta.content or "" for c in stream if c.choices)), schema)


def test_completions_regex_choice_and_json_object(client):
    r = client.completions.create(model="qwen3_a8w8", prompt=PROMPT, max_tokens=30, temperature=1.0, seed=3,
                                  extra_body={"structured_outputs": {"regex": r"[A-Z][a-z]{2,5} [0-9]{2}"}})
    assert re.fullmatch(r"[A-Z][a-z]{2,5} [0-9]{2}", r.choices[0].text) and r.choices[0].finish_reason == "stop"
    r = client.completions.create(model="qwen3_tq", prompt=PROMPT, max_tokens=30, temperature=1.0, seed=4,
                                  extra_body={"guided_choice": ["red", "green", "blue"]})
    assert r.choices[0].text in ("red", "green", "blue")
    r = client.completions.create(model="qwen3_a8w8", prompt=PROMPT, max_tokens=30, temperature=0,
                                  extra_body={"response_format": {"type": "json_object"}, **COMPACT})
    assert r.choices[0].text.startswith("{")


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_time"}}])
def test_forced_tool_choice_yields_a_valid_call(client, choice):
    import jsonschema

    kw = dict(model="qwen3_a8w8", messages=[{"role": "user", "content": "Weather in Paris?"}], max_tokens=80,
              temperature=1.0, seed=5, tools=[WEATHER, TIME], tool_choice=choice, extra_body=NO_THINK)
    res = client.chat.completions.create(**kw)
    msg = res.choices[0].message
    assert res.choices[0].finish_reason == "tool_calls" and msg.tool_calls, res
    by_name = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
    for call in msg.tool_calls:
        assert call.type == "function" and call.id
        if isinstance(choice, dict):
            assert call.function.name == "get_time"
        jsonschema.validate(json.loads(call.function.arguments), by_name[call.function.name])
    chunks = [c for c in client.chat.completions.create(stream=True, **kw) if c.choices]
    streamed = {}
    for c in chunks:
        for tc in c.choices[0].delta.tool_calls or []:
            entry = streamed.setdefault(tc.index, {"name": "", "arguments": ""})
            entry["name"] += (tc.function.name or "") if tc.function else ""
            entry["arguments"] += (tc.function.arguments or "") if tc.function else ""
    assert [(e["name"], e["arguments"]) for _, e in sorted(streamed.items())] == \
        [(c.function.name, c.function.arguments) for c in msg.tool_calls]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_tool_round_trip_renders_calls_and_results_through_the_template(client):
    history = [{"role": "user", "content": "Weather in Paris?"},
               {"role": "assistant", "content": None, "tool_calls": [
                   {"id": "call_1", "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "c"}'}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21}'}]
    res = client.chat.completions.create(model="qwen3_a8w8", messages=history, tools=[WEATHER], max_tokens=4,
                                         temperature=0, extra_body=NO_THINK)
    assert res.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert res.usage.prompt_tokens > 60   # the tools block, the call and its result were rendered


@pytest.mark.parametrize("fields, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strin"}}}},
     "structured_outputs.json"),
    ({"extra_body": {"structured_outputs": {"regex": "a(b"}}}, "structured_outputs.regex"),
    ({"extra_body": {"guided_grammar": "start: nowhere"}}, "guided_grammar"),
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"tools": [{"type": "function", "function": {"name": 3}}]}, "tools"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"extra_body": {"functions": [{"name": "f"}]}}, "functions"),
    ({"extra_body": {"reasoning_effort": "high"}}, "reasoning_effort"),
    ({"extra_body": {"no_such_field": 1}}, "no_such_field"),
    ({"extra_body": {"chat_template_kwargs": {"custom": 1}}}, "chat_template_kwargs"),
])
def test_application_fields_that_cannot_be_served_get_400_naming_them(client, fields, param):
    fields = dict(fields)
    extra = fields.pop("extra_body", {})
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="qwen3_a8w8", messages=MESSAGES, max_tokens=4, extra_body=extra, **fields)
    assert err.value.status_code == 400 and param in err.value.message, err.value.message


def test_a_schema_that_does_not_compile_never_touches_the_requests_beside_it(triton, client):
    """Hostile clients (schemas that do not compile, huge or deep ones) beside well-behaved greedy streams."""
    expected = _greedy_stream(client, "completion", "qwen3_a8w8")
    deep = {"type": "object", "properties": {"a": {}}}
    for _ in range(200):
        deep = {"type": "object", "properties": {"a": deep}}
    hostile = [{"type": "strin"}, deep, {"type": "object", "properties": {f"k{i}": {"type": "string"}
                                                                          for i in range(3000)}},
               {"anyOf": [{"pattern": "(a+)+$" * 50, "type": "string"}]}]

    def bad(schema):
        fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
        try:
            client.chat.completions.create(model="qwen3_a8w8", messages=MESSAGES, max_tokens=8, response_format=fmt,
                                           extra_body=NO_THINK)
            return "ok"
        except openai.BadRequestError as exc:
            return exc.status_code

    with ThreadPoolExecutor(6) as pool:
        goods = [pool.submit(_greedy_stream, client, "completion", "qwen3_a8w8") for _ in range(2)]
        bads = [pool.submit(bad, s) for s in hostile]
        assert [g.result() for g in goods] == [expected, expected]
        assert all(b.result() in ("ok", 400) for b in bads)
    assert bads[0].result() == 400
    assert triton.model_ready("qwen3_a8w8")


# ----- scoring, several prompts, n -------------------------------------------------------------------
SCORE_IDS = [785, 3974, 13876, 38835, 34208, 916, 279, 15678, 5562, 13]


@pytest.fixture(scope="module")
def scored(a8w8_ckpt):
    proc = subprocess.run([sys.executable, "-m", "backend_lib.score", "--checkpoint", str(a8w8_ckpt), "--ids",
                           ",".join(map(str, SCORE_IDS)), "--dtype", "bfloat16", "--page-size", "16", "--json"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])["logprobs"]


def test_echo_with_logprobs_scores_the_prompt_as_backend_lib_score(client, tok, scored):
    # what lm-eval's local-completions sends for loglikelihood: echo, logprobs 1, max_tokens 1, a batch of ids
    r = client.completions.create(model="qwen3_a8w8", prompt=[SCORE_IDS, SCORE_IDS[:6]], echo=True, logprobs=1,
                                  max_tokens=1, temperature=0)
    assert [c.index for c in r.choices] == [0, 1]
    for c, ids in zip(r.choices, [SCORE_IDS, SCORE_IDS[:6]]):
        lp = c.logprobs
        assert len(lp.tokens) == len(ids) + 1 and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        assert lp.token_logprobs[1:len(ids)] == scored[1:len(ids)]   # exactly
        assert lp.tokens[:len(ids)] == [tok.decode([i], skip_special_tokens=False) for i in ids]
        assert c.text.startswith(tok.decode(ids, skip_special_tokens=False))
        assert all(lp.tokens[k] in lp.top_logprobs[k] for k in range(1, len(ids)))
        assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
    assert r.usage.prompt_tokens == len(SCORE_IDS) + 6 and r.usage.completion_tokens == 2
    # streamed: the prompt comes first, then the tokens
    chunks = list(client.completions.create(model="qwen3_a8w8", prompt=SCORE_IDS, echo=True, logprobs=1,
                                            max_tokens=1, temperature=0, stream=True))
    streamed = [lp for ch in chunks for lp in (ch.choices[0].logprobs.token_logprobs
                                                if ch.choices and ch.choices[0].logprobs else [])]
    assert streamed == r.choices[0].logprobs.token_logprobs
    # vLLM's prompt_logprobs
    v = _post_raw(client, {"prompt": SCORE_IDS, "prompt_logprobs": 2, "max_tokens": 1, "temperature": 0})
    plp = v["choices"][0]["prompt_logprobs"]
    assert plp[0] is None and [plp[k][str(SCORE_IDS[k])]["logprob"] for k in range(1, 10)] == scored[1:]
    assert all(2 <= len(d) <= 3 for d in plp[1:])


def _post_raw(client, fields, path="completions"):
    r = requests.post(f"{str(client.base_url).rstrip('/')}/{path}", json={"model": "qwen3_a8w8", **fields},
                      timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def test_several_prompts_and_n_choices_equal_their_single_requests(client):
    prompts = [PROMPT, "Once upon a time", [9707, 11, 1879]]
    single = [client.completions.create(model="qwen3_a8w8", prompt=p, max_tokens=5, temperature=0,
                                        extra_body={"ignore_eos": True}).choices[0].text for p in prompts]
    r = client.completions.create(model="qwen3_a8w8", prompt=prompts, max_tokens=5, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert [c.index for c in r.choices] == [0, 1, 2] and [c.text for c in r.choices] == single
    # n: seeded choices j = the request with seed + j (reproducible), streamed with their index
    seeded = dict(model="qwen3_a8w8", max_tokens=6, temperature=1.0, seed=11, extra_body={"ignore_eos": True})
    r = client.completions.create(prompt=PROMPT, n=3, **seeded)
    again = client.completions.create(prompt=PROMPT, n=3, **seeded)
    assert [c.text for c in r.choices] == [c.text for c in again.choices]
    for j, c in enumerate(r.choices):
        one = client.completions.create(prompt=PROMPT, **{**seeded, "seed": 11 + j})
        assert c.index == j and c.text == one.choices[0].text
    assert len({c.text for c in r.choices}) > 1
    assert r.usage.completion_tokens == 18 and r.usage.prompt_tokens == one.usage.prompt_tokens
    chunks = list(client.completions.create(prompt=PROMPT, n=3, stream=True, stream_options={"include_usage": True},
                                            **seeded))
    texts = {}
    for ch in chunks:
        for c in ch.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
    assert texts == {j: c.text for j, c in enumerate(r.choices)}
    assert chunks[-1].usage.completion_tokens == 18
    chat = client.chat.completions.create(model="qwen3_a8w8", messages=MESSAGES, n=2, max_tokens=4, temperature=1.0,
                                          seed=5, extra_body={"ignore_eos": True})
    assert [c.index for c in chat.choices] == [0, 1] and chat.usage.completion_tokens == 8


@pytest.mark.parametrize("fields, param", [
    ({"prompt": ["x"] * 10**4}, "prompt"), ({"n": 17}, "n"), ({"n": 0}, "n"), ({"n": True}, "n"),
    ({"prompt": ["x"] * 20, "n": 16}, "prompt"), ({"prompt": ["ok", ""]}, "prompt"), ({"prompt": ["ok", [-1]]}, "prompt"),
    ({"stream": True, "prompt_logprobs": 0}, "prompt_logprobs"), ({"echo": 1}, "echo"),
    ({"stream": True, "stream_options": {"bogus": 1}}, "stream_options"),
    ({"priority": 3}, "priority"),          # the served models schedule fcfs
    ({"priority": 2**40}, "priority"),
])
def test_hostile_batches_fail_alone_naming_the_field(triton, front, fields, param):
    before = triton.metric("vllm:prompt_tokens_total", "qwen3_a8w8")
    r = _post(front, "completion", fields)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    assert triton.metric("vllm:prompt_tokens_total", "qwen3_a8w8") == before


def test_continuous_usage_stats_on_every_chunk(client):
    chunks = list(client.completions.create(model="qwen3_a8w8", prompt=PROMPT, max_tokens=4, temperature=0,
                                            stream=True, extra_body={"ignore_eos": True},
                                            stream_options={"include_usage": True, "continuous_usage_stats": True}))
    counts = [ch.usage.completion_tokens for ch in chunks if ch.choices and ch.choices[0].text]
    assert counts == [1, 2, 3, 4]


# ----- tokenize, detokenize, token strings without --tokenizer ----------------------------------------
def test_tokenize_and_detokenize_in_vllms_shapes(triton, front, keyed_front, tok):
    def post(server, path, body, key=None):
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        return requests.post(f"{server.url}/{path}", json=body, headers=headers, timeout=60)

    r = post(front, "tokenize", {"model": "qwen3_a8w8", "prompt": PROMPT, "return_token_strs": True})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["tokens"] == tok.encode(PROMPT) and body["count"] == len(body["tokens"])
    assert body["max_model_len"] == 1024 and "".join(body["token_strs"]) == PROMPT
    chat = post(front, "tokenize", {"model": "qwen3_a8w8", "messages": MESSAGES,
                                    "chat_template_kwargs": {"enable_thinking": False}}).json()
    assert chat["tokens"] == template_ids(triton, MESSAGES, False)
    back = post(front, "detokenize", {"model": "qwen3_a8w8", "tokens": body["tokens"]})
    assert back.status_code == 200 and back.json() == {"prompt": PROMPT}
    # without --tokenizer: the model's own checkpoint's tokenizer
    keyed = post(keyed_front, "detokenize", {"model": "qwen3_a8w8", "tokens": body["tokens"]}, API_KEY)
    assert keyed.status_code == 200 and keyed.json() == {"prompt": PROMPT}
    assert post(keyed_front, "detokenize", {"model": "qwen3_a8w8", "tokens": [1]}).status_code == 401
    for path, fields, param in [("tokenize", {"prompt": PROMPT, "bogus": 1}, "bogus"),
                                ("tokenize", {}, "prompt"), ("tokenize", {"prompt": PROMPT, "messages": MESSAGES}, "prompt"),
                                ("detokenize", {"tokens": [-1]}, "tokens"), ("detokenize", {"tokens": [10**8]}, "tokens"),
                                ("detokenize", {"tokens": "1 2"}, "tokens")]:
        bad = post(front, path, {"model": "qwen3_a8w8", **fields})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == param, (path, fields, bad.text)


def test_logprob_token_strings_are_real_without_a_tokenizer(keyed_front, tok):
    client = keyed_front.client(API_KEY)
    r = client.completions.create(model="qwen3_a8w8", prompt=PROMPT, max_tokens=4, temperature=0, logprobs=2,
                                  echo=True)
    lp = r.choices[0].logprobs
    assert not any(t.startswith("token_id:") for t in lp.tokens)
    assert lp.tokens[:len(tok.encode(PROMPT))] == [tok.decode([i], skip_special_tokens=False)
                                                   for i in tok.encode(PROMPT)]
    assert all(len(top) >= 2 for top in lp.top_logprobs[1:])
    chat = client.chat.completions.create(model="qwen3_a8w8", messages=MESSAGES, max_tokens=3, temperature=0,
                                          logprobs=True, top_logprobs=2)
    assert all(not e.token.startswith("token_id:") and len(e.top_logprobs) == 2 for e in chat.choices[0].logprobs.content)


# ----- /metrics ----------------------------------------------------------------------------------------
def test_metrics_count_the_fronts_requests_and_carry_tritons(triton, tmp_path):
    from prometheus_client.parser import text_string_to_metric_families

    metered = Front(triton.grpc_url, tmp_path / "metered.log",
                    "--triton-metrics-url", f"http://127.0.0.1:{triton.metrics_port}/metrics")
    try:
        client = metered.client()
        for _ in range(2):
            client.completions.create(model="qwen3_a8w8", prompt=PROMPT, max_tokens=3, temperature=0)
        chunks = list(client.chat.completions.create(model="qwen3_a8w8", messages=MESSAGES, max_tokens=3,
                                                     temperature=0, stream=True))
        assert chunks
        with pytest.raises(openai.BadRequestError):
            client.completions.create(model="qwen3_a8w8", prompt=PROMPT, max_tokens=0)
        r = requests.get(f"{metered.url}/metrics", timeout=10)
    finally:
        metered.stop()
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    families = {f.name: f for f in text_string_to_metric_families(r.text)}
    counts = {(s.labels["endpoint"], s.labels["method"], s.labels["status"]): s.value
              for s in families["openai_frontend_requests"].samples if s.name.endswith("_total")}
    assert counts[("/v1/completions", "POST", "200")] == 2 and counts[("/v1/completions", "POST", "400")] == 1
    assert counts[("/v1/chat/completions", "POST", "200")] == 1
    durations = {s.labels["endpoint"]: s.value for s in families["openai_frontend_request_duration_seconds"].samples
                 if s.name.endswith("_count")}
    assert durations["/v1/completions"] == 3 and durations["/v1/chat/completions"] == 1
    ttft = {s.labels["endpoint"]: s.value for s in families["openai_frontend_time_to_first_token_seconds"].samples
            if s.name.endswith("_count")}
    assert ttft == {"/v1/chat/completions": 1}   # streams only
    success = [s for s in families["nv_inference_request_success"].samples if s.labels.get("model") == "qwen3_a8w8"]
    assert success and success[0].value >= 3   # Triton's own metrics, after the front's
