"""Requests belong to their sender, and hostile input fails alone, through the real tritonserver.

An abort needs the abort token the model returned to the sender alone (return_abort_token): another gRPC
connection, an HTTP client or a client that sends the same request id cannot end a stream it did not start,
and two clients with one request id are both served in full. Hostile inputs (conflicting inputs, unknown
request parameters, huge numbers, deep nesting, lone surrogates, a grammar too large to run) each get one
INVALID_ARG naming the field, never an internal error, while greedy reference streams keep their exact ids.
"""
from __future__ import annotations

import http.client
import json
import queue
import threading
import time

import numpy as np
import pytest
import tritonclient.grpc as grpcclient

from client.triton_inputs import build_inputs, is_final, response_text
from helpers import GREEDY, PROMPT, collect

pytestmark = [pytest.mark.slow, pytest.mark.server]
MODEL = "qwen3_a8w8"


class Stream:
    """One gRPC streaming request on a connection of its own, read by a thread: its abort token (first
    response), ids, finish reason, or its error."""

    def __init__(self, url: str, model: str, inputs: list, request_id: str = "", parameters: dict | None = None):
        self.token: str | None = None
        self.ids: list[int] = []
        self.finish: str | None = None
        self.error: str | None = None
        self.responses = 0
        self.got_token = threading.Event()
        self.done = threading.Event()
        self._results: queue.Queue = queue.Queue()
        self.client = grpcclient.InferenceServerClient(url)
        self.client.start_stream(callback=lambda result, error: self._results.put((result, error)))
        self.client.async_stream_infer(model, inputs, request_id=request_id, parameters=parameters,
                                       enable_empty_final_response=True)
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        try:
            while True:
                r, e = self._results.get(timeout=300)
                if e is not None:
                    self.error = str(e)
                    return
                self.responses += 1
                tok = r.as_numpy("abort_token")
                if tok is not None and tok.size:
                    self.token = tok.reshape(-1)[0].decode()
                    self.got_token.set()
                _, ids = response_text(r)
                self.ids.extend(ids)
                fr = r.as_numpy("finish_reason")
                if fr is not None and fr.size:
                    self.finish = fr.reshape(-1)[0].decode()
                if is_final(r):
                    return
        finally:
            self.got_token.set()
            self.done.set()

    def wait(self, timeout: float = 300) -> "Stream":
        assert self.done.wait(timeout), "the stream did not end"
        self.client.stop_stream()
        self.client.close()
        return self


def _tensor(name: str, value) -> grpcclient.InferInput:
    if isinstance(value, bool):
        arr, dtype = np.array([value]), "BOOL"
    elif isinstance(value, int):
        arr, dtype = np.array([value], dtype=np.int32), "INT32"
    else:
        arr, dtype = np.array([value.encode() if isinstance(value, str) else value], dtype=np.object_), "BYTES"
    t = grpcclient.InferInput(name, [1], dtype)
    t.set_data_from_numpy(arr)
    return t


def _abort(url: str, request_id: str, token: str | None, model: str = MODEL) -> list:
    inputs = [_tensor("abort_request_id", request_id)] + ([_tensor("abort_token", token)] if token else [])
    return collect(url, model, raw_inputs=inputs, timeout=30)


def _long(prompt: str, n: int = 400) -> list:
    return build_inputs(prompt, max_tokens=n, return_finish_reason=True, return_abort_token=True, **GREEDY)


def _http_post(server, path: str, body: bytes) -> tuple[int, str]:
    host, port = server.http_url.split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    try:
        conn.request("POST", path, body=body, headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        return resp.status, resp.read().decode(errors="replace")
    finally:
        conn.close()


def test_no_client_can_abort_a_stream_it_did_not_start(triton):
    url = triton.grpc_url
    expected = collect(url, MODEL, prompt=f"{PROMPT} victim", max_tokens=120, **GREEDY)
    expected_ids = [i for _, ids, _ in expected for i in ids]
    victim = Stream(url, MODEL, _long(f"{PROMPT} victim", 120), request_id="shared-id")
    assert victim.got_token.wait(30) and victim.token
    # another connection with the id and no token, or a guessed one: refused, saying nothing about the id
    no_token = _abort(url, "shared-id", None)
    guessed = _abort(url, "shared-id", "A" * 32)
    absent = _abort(url, "no-such-id", "A" * 32)
    assert no_token[0][0] == "ERROR" and "abort_token" in no_token[0][1]
    assert guessed[0][0] == "ERROR" and "abort_request_id: no running request matches" in guessed[0][1]
    assert absent[0][1] == guessed[0][1], "a refused abort must not reveal whether the id exists"
    # the victim's token with another id: refused too
    assert _abort(url, "other-id", victim.token)[0][0] == "ERROR"
    # an HTTP client
    status, body = _http_post(triton, f"/v2/models/{MODEL}/generate",
                              json.dumps({"abort_request_id": "shared-id", "abort_token": "x"}).encode())
    assert status == 400 and "abort_request_id" in body, (status, body)
    # a second client with the same request id: it aborts its own request (with its own token), not the victim
    twin = Stream(url, MODEL, _long(f"{PROMPT} twin", 400), request_id="shared-id")
    assert twin.got_token.wait(30) and twin.token and twin.token != victim.token
    done = _abort(url, "shared-id", twin.token)
    assert done[-1][0] != "ERROR" and done[-1][2], done
    twin.wait(30)
    assert twin.finish == "abort" and len(twin.ids) < 400
    victim.wait()
    assert victim.error is None and victim.finish == "length" and victim.ids == expected_ids
    # a late abort with the right token (the request finished) is answered as valid, and ends nothing
    assert _abort(url, "shared-id", victim.token)[-1][0] != "ERROR"


def test_two_clients_with_the_same_request_id_are_both_served_in_full(triton):
    url = triton.grpc_url
    prompts = [f"{PROMPT} twin {i}" for i in range(2)]
    expected = [[i for _, ids, _ in collect(url, MODEL, prompt=p, max_tokens=60, **GREEDY) for i in ids]
                for p in prompts]
    streams = [Stream(url, MODEL, build_inputs(p, max_tokens=60, return_finish_reason=True, **GREEDY),
                      request_id="same") for p in prompts]
    assert [s.wait().ids for s in streams] == expected and all(s.finish == "length" for s in streams)


def test_an_ensemble_stream_is_aborted_only_with_its_token(triton):
    url = triton.grpc_url
    inputs = lambda: build_inputs(f"{PROMPT} ensemble", max_tokens=600, return_finish_reason=True,  # noqa: E731
                                  return_abort_token=True, **GREEDY)
    stream = Stream(url, "qwen3_a8w8_ensemble", inputs(), request_id="ens-1")
    assert stream.got_token.wait(30) and stream.token
    assert _abort(url, "ens-1", "wrong-token")[0][0] == "ERROR"
    stream.wait(60)   # a wrong token ends nothing: the stream runs to its length
    assert stream.finish == "length" and len(stream.ids) == 600, (stream.finish, len(stream.ids))
    # the right token, sent as soon as the first response carries it, ends the ensemble's stream
    stream = Stream(url, "qwen3_a8w8_ensemble", inputs(), request_id="ens-2")
    assert stream.got_token.wait(30) and stream.token
    t0 = time.time()
    assert _abort(url, "ens-2", stream.token)[-1][0] != "ERROR"
    stream.wait(30)
    assert stream.finish == "abort" and len(stream.ids) < 600 and time.time() - t0 < 10


GRAMMAR_TOO_LARGE = 'start: a\na: b{40}\nb: c{40}\nc: "x"{40}\n'


def _hostile_cases():
    """(inputs, request parameters, text the one error must contain)."""
    base = lambda **kw: build_inputs(PROMPT, max_tokens=3, **kw)   # noqa: E731
    raw = lambda text: [_tensor("text_input", PROMPT), _tensor("stream", True),  # noqa: E731
                        _tensor("sampling_parameters", text)]
    return [
        (base() + [_tensor("input_ids", 5)], None, "text_input and input_ids"),
        ([_tensor("abort_request_id", "x"), _tensor("abort_token", "y"), _tensor("text_input", PROMPT)], None,
         "abort_request_id"),
        (base(), {"bogus_key": 1}, "bogus_key"),
        (base(), {"max_tokenz": 5}, "max_tokenz"),
        (base(), {"temperatur": "0.5"}, "temperatur"),
        (base(), {"stream": 7}, "parameters.stream"),
        (raw('{"max_tokens": %s}' % ("9" * 5000)), None, "sampling_parameters.max_tokens"),
        (raw('{"temperature": %s}' % ("1" + "0" * 400)), None, "sampling_parameters.temperature"),
        (raw('{"top_p": 1e400}'), None, "sampling_parameters.top_p"),
        (raw('{"min_p": NaN}'), None, "sampling_parameters.min_p"),
        (raw('{"presence_penalty": 1, "presence_penalty": 2}'), None, "duplicate key"),
        (raw("[" * 100_000 + "]" * 100_000), None, "sampling_parameters: nested deeper"),
        (raw('{"stop": ["\\ud800"]}'), None, "sampling_parameters.stop[0]"),
        (raw('{"cache_salt": "\\udfff"}'), None, "sampling_parameters.cache_salt"),
        (raw(json.dumps({"structured_outputs": {"grammar": GRAMMAR_TOO_LARGE}})), None,
         "structured_outputs.grammar: the grammar exceeds"),
        (base(sampling_parameters={"max_tokens": 9}), None, "max_tokens: given in sampling_parameters"),
        ([_tensor("text_input", PROMPT), _tensor("stream", False), _tensor("return_abort_token", True)], None,
         "return_abort_token"),
    ]


def test_hostile_requests_fail_alone_beside_reference_streams(triton):
    url = triton.grpc_url
    refs = [f"{PROMPT} reference {i}" for i in range(2)]
    expected = [collect(url, MODEL, prompt=p, max_tokens=100, **GREEDY) for p in refs]
    results: dict = {}
    runners = [threading.Thread(target=lambda i=i, p=p: results.__setitem__(
        i, collect(url, MODEL, prompt=p, max_tokens=100, **GREEDY))) for i, p in enumerate(refs)]
    for t in runners:
        t.start()
    for inputs, parameters, words in _hostile_cases():
        s = Stream(url, MODEL, inputs, parameters=parameters).wait(60)
        assert s.error is not None and words in s.error, (words, s.error, s.ids)
        assert "internal error" not in s.error.lower() and s.ids == [], s.error
    # HTTP generate: JSON keys that are not inputs are request parameters; surrogates in JSON strings
    for body, words in [({"text_input": PROMPT, "max_tokens": 3, "bogus": 1}, "bogus"),
                        ({"text_input": PROMPT, "max_tokens": 3, "n": 17}, "n must be an integer in [1, 16]"),
                        ({"text_input": PROMPT, "input_ids": [1, 2], "max_tokens": 3}, "input_ids"),
                        ({"text_input": PROMPT, "sampling_parameters": '{"seed": %s}' % ("7" * 999)},
                         "sampling_parameters.seed")]:
        status, text = _http_post(triton, f"/v2/models/{MODEL}/generate", json.dumps(body).encode())
        assert status == 400 and words in text and "internal" not in text.lower(), (body, status, text)
    # A lone surrogate in the body never reaches the model: Triton 2.51's own JSON parser refuses the body, with
    # a 500 (upstream; documented beside the other 2.51 limits)
    status, text = _http_post(triton, f"/v2/models/{MODEL}/generate", b'{"text_input": "\\ud800", "max_tokens": 3}')
    assert status == 500 and "failed to parse the request JSON" in text, (status, text)
    for t in runners:
        t.join(300)
    assert [results[i] for i in range(len(refs))] == expected, "a reference stream changed its tokens"
    assert triton.proc.poll() is None


@pytest.mark.parametrize("messages, tools, words", [
    ('[{"role": "user", "content": "\\ud800"}]', None, "messages[0].content"),
    ('[{"role": "user", "content": "x", "content": "y"}]', None, "duplicate key"),
    ("[" * 100_000 + "]" * 100_000, None, "messages: nested deeper"),
    ('[{"role": "user", "content": "x"}]', '[{"type": "function", "function": {"name": "f", "parameters": '
                                           '{"maximum": 1e999}}}]', "tools[0].function.parameters.maximum"),
    ('[{"role": "user", "content": "x"}]', '[{"type": "function", "function": {"name": "\\udc00"}}]', "tools[0]"),
])
def test_the_tokenizer_model_names_the_field_of_hostile_messages_and_tools(triton, messages, tools, words):
    client = grpcclient.InferenceServerClient(triton.grpc_url)
    tensors = []
    for name, value in (("messages", messages), ("tools", tools)):
        if value is not None:
            t = grpcclient.InferInput(name, [1, 1], "BYTES")
            t.set_data_from_numpy(np.array([[value.encode()]], dtype=np.object_))
            tensors.append(t)
    try:
        with pytest.raises(Exception) as exc:
            client.infer("qwen3_tokenizer", tensors)
    finally:
        client.close()
    assert words in str(exc.value) and "internal" not in str(exc.value).lower(), str(exc.value)


def test_one_abort_token_ends_every_choice_of_an_n_request(triton):
    inputs = build_inputs(f"{PROMPT} choices", max_tokens=600, return_finish_reason=True, return_abort_token=True,
                          sampling_parameters={"temperature": 1.0, "seed": 3, "ignore_eos": True, "n": 3})
    s = Stream(triton.grpc_url, MODEL, inputs, request_id="n-choices")
    assert s.got_token.wait(60) and s.token
    assert triton.wait_until(lambda: triton.metric("vllm:num_requests_running", MODEL) >= 3, 30)
    _abort(triton.grpc_url, "n-choices", s.token)
    s.wait(60)
    assert s.error is None and s.finish == "abort" and len(s.ids) < 3 * 600
    assert triton.wait_until(lambda: triton.metric("vllm:num_requests_running", MODEL) == 0, 10)
    assert triton.wait_until(lambda: triton.metric("vllm:kv_cache_pages_used", MODEL) == 0, 10)
