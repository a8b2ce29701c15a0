"""The OpenAI-compatible front (client.openai_server) over the real tritonserver, driven by the openai SDK."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import openai
import pytest
import requests
from openai import OpenAI

from backend_lib.tokenizer import Tokenizer
from client.stream import stream_generate
from conftest import ROOT
from test_ensembles import tokenizer_model
from backend_lib.serving.server_process import free_port

pytestmark = [pytest.mark.slow, pytest.mark.server]
PROMPT = "The quick brown fox jumps over the lazy dog"
MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "介绍一下北京故宫"}]
GREEDY = {"temperature": 0, "extra_body": {"ignore_eos": True}}
API_KEY = "s3cret-key"


class Front:
    """`python -m client.openai_server` as a subprocess on a free port."""

    def __init__(self, triton_url: str, log_path, *args, env: dict | None = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "client.openai_server", "--triton-url", triton_url, "--port", str(self.port),
               *args]
        self._log = open(log_path, "w")
        self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=self._log, stderr=subprocess.STDOUT,
                                     env={**os.environ, **(env or {})})
        self._wait_listening()

    def _wait_listening(self, timeout: float = 60.0) -> None:
        deadline = time.time() + timeout
        while time.time() < deadline:
            assert self.proc.poll() is None, f"the front exited ({self.proc.returncode})"
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                return
            except OSError:
                time.sleep(0.2)
        raise TimeoutError("the OpenAI front did not start")

    def client(self, api_key: str = "unused") -> OpenAI:
        return OpenAI(base_url=f"{self.url}/v1", api_key=api_key, max_retries=0, timeout=120)

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._log.close()


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
def test_health_and_models_list_only_the_llm_models(front, client):
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
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(stream=True, **kw)
                       if c.choices)
    assert whole.choices[0].message.content == streamed == expected["text"]
    assert whole.usage.prompt_tokens == len(ids)


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
    ("completion", {"n": 2}, "n"),
    ("completion", {"top_p": 1.5}, "top_p"),
    ("completion", {"max_tokens": 0}, "max_tokens"),
    ("completion", {"max_tokens": 100000}, "max_tokens"),   # the LLM model's own limit (INVALID_ARG)
    ("completion", {"prompt": ["one", "two"]}, "prompt"),
    ("completion", {"prompt": None}, "prompt"),
    ("completion", {"extra_body": {"temperature": "hot"}}, "temperature"),
    ("chat", {"n": 3}, "n"),
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
    cancelled = triton.finished_total(model, "cancelled")
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
    assert triton.finished_total(model, "cancelled") == cancelled + 1
    assert client.completions.create(model=model, prompt=PROMPT, max_tokens=3, **GREEDY).usage.completion_tokens == 3


def test_a_client_that_gives_up_on_a_whole_response_cancels_it(triton, front):
    model = "qwen3_tq"
    cancelled = triton.finished_total(model, "cancelled")
    body = {"model": model, "prompt": PROMPT, "max_tokens": 900, "temperature": 0, "ignore_eos": True}
    with pytest.raises(requests.Timeout):
        requests.post(f"{front.url}/v1/completions", json=body, timeout=1.0)
    assert wait_until(lambda: _pages(triton, model) == 0, 2.0)
    assert triton.finished_total(model, "cancelled") == cancelled + 1
