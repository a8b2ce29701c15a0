"""Issue 32 through the real server and the OpenAI front: no client can flood the front's state or sockets, nothing
is claimed that is not done, and the front as scripts/serve.sh starts it answers /tokenize and /detokenize. Each
hostile client runs beside well-behaved ones whose greedy output must stay exactly their solo output."""
from __future__ import annotations

import json
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

from backend_lib.tokenizer import Tokenizer
from harness.openai_front import Front
from openai_frontend.metrics import METHODS

pytestmark = [pytest.mark.slow, pytest.mark.server]
PROMPT = "The quick brown fox jumps over the lazy dog"
GREEDY = {"model": "qwen3_a8w8", "prompt": PROMPT, "max_tokens": 24, "temperature": 0, "ignore_eos": True}


def _greedy(front) -> str:
    r = requests.post(f"{front.url}/v1/completions", json=GREEDY, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


@pytest.fixture(scope="module")
def front(triton, tmp_path_factory):
    f = Front(triton.grpc_url, tmp_path_factory.mktemp("hostile") / "front.log", "--triton-metrics-url", "",
              "--request-read-timeout", "1.5", "--max-connections", "48", "--responses-store-mib", "0.003",
              "--send-buffer-kib", "8")
    yield f
    f.stop()


@pytest.fixture(scope="module")
def solo(front) -> str:
    return _greedy(front)


def _raw(front, data: bytes, timeout: float = 10) -> bytes:
    with socket.create_connection(("127.0.0.1", front.port), timeout=timeout) as s:
        s.sendall(data)
        out = b""
        while chunk := s.recv(65536):
            out += chunk
        return out


def test_client_method_tokens_never_become_metric_series(front, solo):
    for i in range(20):
        _raw(front, f"FLOOD{i} /v1/models HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n".encode())
    assert _greedy(front) == solo
    text = requests.get(f"{front.url}/metrics", timeout=10).text
    methods = set()
    for line in text.splitlines():
        if line.startswith("openai_frontend_requests_total{"):
            methods.add(line.split('method="', 1)[1].split('"', 1)[0])
    assert "other" in methods and methods <= METHODS | {"other"}, methods


def _closed_within(sock: socket.socket, seconds: float) -> tuple[bool, bytes]:
    sock.settimeout(seconds)
    try:
        data = sock.recv(4096)
        return True, data
    except OSError:   # timeout: still open
        return False, b""


def test_slowloris_and_silent_sockets_are_cut_and_a_flood_beyond_the_limit_refused(front, solo):
    """30 silent sockets and 8 that trickle a request's headers a byte every 0.2 s, beside greedy clients: every
    hostile socket is closed within the read timeout (1.5 s) plus slack, the greedy outputs stay exact; then 80 more
    sockets at once, beyond --max-connections 48: those over the limit get a 503 at once, the others are cut at
    the timeout, and the server serves again."""
    t0 = time.time()
    silent = [socket.create_connection(("127.0.0.1", front.port)) for _ in range(30)]
    trickle = [socket.create_connection(("127.0.0.1", front.port)) for _ in range(8)]
    header = b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\nx-pad: " + b"a" * 200
    with ThreadPoolExecutor(3) as pool:
        beside = [pool.submit(_greedy, front) for _ in range(3)]
        for i in range(40):   # 3 s of trickling at most (bounded), twice the read timeout
            if time.time() - t0 > 3:
                break
            for s in trickle:
                try:
                    s.sendall(header[i:i + 1])
                except OSError:
                    pass
            time.sleep(0.2)
        outputs = [f.result(timeout=120) for f in beside]
    assert outputs == [solo] * 3
    for s in silent + trickle:
        closed, data = _closed_within(s, max(0.1, 4.0 - (time.time() - t0)))
        assert closed and data == b"", "a silent or trickling connection outlived the read timeout"
        s.close()
    cut_s = time.time() - t0

    flood = [socket.create_connection(("127.0.0.1", front.port)) for _ in range(80)]
    answers = [_closed_within(s, 4.0) for s in flood]
    for s in flood:
        s.close()
    refused = sum(data.startswith(b"HTTP/1.1 503") for _, data in answers)
    assert all(closed for closed, _ in answers)
    assert 80 - 48 <= refused < 80, refused
    assert _greedy(front) == solo
    print(f"\nslowloris: 38 hostile sockets all closed when checked {cut_s:.1f} s after they opened (read timeout "
              f"1.5 s); of 80 more at "
          f"once, {refused} refused with 503 at once, the rest cut at the timeout; greedy outputs exact")


def test_a_response_too_large_for_the_store_says_store_false_and_metadata_is_bounded(front):
    body = {"model": "qwen3_a8w8", "input": "x" * 4000, "max_output_tokens": 8, "temperature": 0}
    whole = requests.post(f"{front.url}/v1/responses", json=body, timeout=120).json()
    assert whole["status"] in ("completed", "incomplete") and whole["store"] is False
    assert requests.get(f"{front.url}/v1/responses/{whole['id']}", timeout=10).status_code == 404
    with requests.post(f"{front.url}/v1/responses", json={**body, "stream": True}, stream=True, timeout=120) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith(b"data: ")]
    assert events[-1]["type"] in ("response.completed", "response.incomplete")
    assert events[-1]["response"]["store"] is False
    small = requests.post(f"{front.url}/v1/responses", json={**body, "input": "Hi"}, timeout=120).json()
    assert small["store"] is True and requests.get(f"{front.url}/v1/responses/{small['id']}", timeout=10).ok
    for metadata, words in (({"k": "v" * 513}, "at most 512 characters"), ({"k" * 65: "v"}, "at most 64 characters"),
                            ({str(i): "v" for i in range(17)}, "at most 16 items")):
        r = requests.post(f"{front.url}/v1/responses", json={**body, "metadata": metadata}, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == "metadata" and words in r.text, r.text


def test_logit_bias_naming_one_id_twice_is_refused(front, solo):
    r = requests.post(f"{front.url}/v1/completions", json={**GREEDY, "logit_bias": {"9707": 5, "09707": -5}},
                      timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "logit_bias", r.text
    assert "name the same token id 9707" in r.json()["error"]["message"]
    assert _greedy(front) == solo


def test_the_front_as_serve_sh_starts_it_answers_tokenize_and_detokenize(triton, bf16_ckpt, tmp_path):
    """scripts/serve.sh exports $QWEN3_TQ_CHECKPOINT for the server and starts the front with these arguments from
    the repository's root: the front reads the checkpoint the model loaded (the environment's, not config.pbtxt's;
    here the model's configured one is a Hub id the front could not resolve)."""
    f = Front(triton.grpc_url, tmp_path / "front.log", "--host", "127.0.0.1", "--triton-metrics-url",
              f"http://127.0.0.1:{triton.metrics_port}/metrics", "--log-level", "warning",
              env={"QWEN3_TQ_CHECKPOINT": str(bf16_ckpt), "QWEN3_TOKENIZER_CHECKPOINT": str(bf16_ckpt)})
    try:
        tok = Tokenizer(bf16_ckpt)
        r = requests.post(f"{f.url}/tokenize", json={"model": "qwen3_tq", "prompt": PROMPT,
                                                      "return_token_strs": True}, timeout=60)
        assert r.status_code == 200, r.text
        ids = r.json()["tokens"]
        assert ids == tok.encode(PROMPT)
        assert r.json()["token_strs"] == [tok.token_bytes[i].decode("utf-8", errors="replace") for i in ids]
        d = requests.post(f"{f.url}/detokenize", json={"model": "qwen3_tq", "tokens": ids}, timeout=60)
        assert d.status_code == 200 and d.json()["prompt"] == PROMPT, d.text
    finally:
        f.stop()


def test_prompt_scoring_over_the_per_request_budget_is_refused_before_any_work(front, solo):
    """prompt tokens x (top N + 1), summed over prompts and n, at most MAX_PROMPT_SCORING (65536) per request: a
    scoring request over it is a 400 naming its field (text prompts counted by the tokenizer model), one under it
    is served, and the greedy client beside is exact."""
    from openai_frontend.protocol import MAX_PROMPT_SCORING

    assert MAX_PROMPT_SCORING == 65536
    ids = [9707] * 400
    cases = [({"prompt": [ids] * 8, "prompt_logprobs": 20}, "prompt_logprobs"),          # 8 x 400 x 21 = 67,200
             ({"prompt": [ids] * 6, "n": 2, "echo": True, "logprobs": 5}, "logprobs"),    # 12 x 400 x 6 = 28,800: ok
             ({"prompt": ["fox " * 390] * 4, "n": 2, "prompt_logprobs": 20}, "prompt_logprobs")]   # text, counted
    answers = []
    for fields, param in cases:
        r = requests.post(f"{front.url}/v1/completions", json={**GREEDY, "max_tokens": 1, **fields}, timeout=300)
        answers.append(r.status_code)
        if r.status_code == 400:
            err = r.json()["error"]
            assert err["param"] == param and "over the budget of 65536 per request" in err["message"], err
    assert answers == [400, 200, 400], answers
    assert _greedy(front) == solo


def test_a_stream_whose_client_never_reads_is_ended_and_frees_the_model(triton, front, solo):
    """Two clients that send a 900-token stream of 4 choices and never read a byte: the front's response pauses at
    the socket's bound (--send-buffer-kib), and each choice's Triton stream aborts its request at MAX_UNREAD
    responses unread (unless the model finished it first: the tiny model may outrun the front's reader); the KV
    pages come back while the sockets are still open, and a greedy client beside is exact."""
    body = json.dumps({**GREEDY, "max_tokens": 900, "stream": True, "n": 4}).encode()
    request = (b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: "
               + str(len(body)).encode() + b"\r\n\r\n" + body)
    aborted = triton.finished_total("qwen3_a8w8", "abort")
    unread = lambda: open(front.log_path).read().count("responses unread (the client stopped reading)")  # noqa: E731
    before = unread()
    sleepers = []
    for _ in range(2):
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        s.connect(("127.0.0.1", front.port))
        s.sendall(request)
        sleepers.append(s)
    try:
        t0 = time.time()
        assert _greedy(front) == solo
        assert triton.wait_until(lambda: unread() >= before + 8, 120), "the front never ended a stream nobody reads"
        ended_s = time.time() - t0
        used = lambda: triton.metric("vllm:kv_cache_pages_used", "qwen3_a8w8")  # noqa: E731
        assert triton.wait_until(lambda: used() == 0, 60), "a stream nobody reads held its pages"
        freed_s = time.time() - t0
        by_abort = triton.finished_total("qwen3_a8w8", "abort") - aborted
    finally:
        for s in sleepers:
            s.close()
    print(f"\nunread streams: 2 clients x 4 choices of 900 tokens never read: the front ended all 8 {ended_s:.1f} s "
          f"after they were sent ({by_abort:.0f} aborted in the model, the rest had finished first), KV pages "
          f"back to 0 after {freed_s:.1f} s with the sockets still open")


# ----- forced tool calls cut by max_tokens ----------------------------------------------------------------
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                                                           "unit": {"enum": ["c", "f"]}},
                                          "required": ["city", "unit"], "additionalProperties": False}}}


def _calls(message: dict) -> list[tuple[str, str]]:
    return [(c["function"]["name"], c["function"]["arguments"]) for c in message.get("tool_calls") or []]


def test_forced_tool_calls_cut_by_max_tokens_return_the_complete_calls(front, solo):
    """tool_choice required, sampled (seeded) until an answer has two calls or more; the same request with
    max_tokens cutting its last call: the complete calls before it come back as tool_calls (the same as in the
    whole answer), finish_reason length, nothing of the cut call as content, streamed alike; a greedy client beside
    is exact."""
    body = {"model": "qwen3_a8w8", "messages": [{"role": "user", "content": "Weather in Paris and Rome?"}],
            "tools": [WEATHER], "tool_choice": "required", "temperature": 1.0, "max_tokens": 160,
            "chat_template_kwargs": {"enable_thinking": False}}
    post = lambda **kw: requests.post(f"{front.url}/v1/chat/completions", json={**body, **kw}, timeout=120)  # noqa: E731
    whole = None
    for seed in range(40):
        r = post(seed=seed).json()
        if r["choices"][0]["finish_reason"] == "tool_calls" and len(_calls(r["choices"][0]["message"])) >= 2:
            whole = r
            break
    assert whole is not None, "no seed gave two calls"
    calls = _calls(whole["choices"][0]["message"])
    cut_at = whole["usage"]["completion_tokens"] - 4   # inside the last call's JSON
    with ThreadPoolExecutor(2) as pool:
        beside = pool.submit(_greedy, front)
        cut = post(seed=seed, max_tokens=cut_at).json()
        assert beside.result(timeout=120) == solo
    choice = cut["choices"][0]
    assert choice["finish_reason"] == "length" and cut["usage"]["completion_tokens"] == cut_at, cut
    assert _calls(choice["message"]) == calls[:-1] and not choice["message"].get("content"), cut
    streamed, finish = {}, None
    with requests.post(f"{front.url}/v1/chat/completions", json={**body, "seed": seed, "max_tokens": cut_at,
                                                                 "stream": True}, stream=True, timeout=120) as r:
        for line in r.iter_lines():
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            for c in json.loads(line[6:]).get("choices", []):
                assert not c["delta"].get("content"), c
                for tc in c["delta"].get("tool_calls") or []:
                    entry = streamed.setdefault(tc["index"], ["", ""])
                    entry[0] += tc.get("function", {}).get("name") or ""
                    entry[1] += tc.get("function", {}).get("arguments") or ""
                finish = c.get("finish_reason") or finish
    assert [tuple(e) for _, e in sorted(streamed.items())] == calls[:-1] and finish == "length"


# ----- priority aging through the server ------------------------------------------------------------------
@pytest.fixture(scope="module")
def priority_front(tmp_path_factory, a8w8_ckpt):
    """A server whose qwen3_a8w8 schedules by priority one sequence at a time, qwen3_share whose prompt scoring
    takes 16 tokens of a 64-token step, and the front as serve.sh starts it."""
    from harness.triton_server import TritonServer, make_repository
    from helpers import SERVER_ENGINE

    root = tmp_path_factory.mktemp("priority")
    repo = make_repository(root / "models", {
        "qwen3_a8w8": {**SERVER_ENGINE, "checkpoint": str(a8w8_ckpt), "scheduling_policy": "priority",
                       "max_num_seqs": "1"},
        # prompt scoring's share of a step: 16 of its 64 tokens (test_prompt_scoring_..._its_share_of_a_step)
        "qwen3_share": {**SERVER_ENGINE, "_source": "qwen3_a8w8", "checkpoint": str(a8w8_ckpt),
                        "max_scoring_tokens_per_step": "16"},
        "qwen3_tokenizer": {"checkpoint": str(a8w8_ckpt), "max_model_len": SERVER_ENGINE["max_model_len"]}})
    server = TritonServer(repo, root / "tritonserver.log").start()
    f = Front(server.grpc_url, root / "front.log", "--host", "127.0.0.1", "--triton-metrics-url",
              f"http://127.0.0.1:{server.metrics_port}/metrics", "--log-level", "warning")
    yield f
    f.stop()
    server.stop()


def test_a_low_priority_request_beside_a_flood_of_high_priority_ones_finishes_within_the_aging_bound(priority_front):
    """8 clients keep high-priority requests (priority -1) queued without a pause, one slot; a priority-0 request
    sent into the flood is overtaken by at most PRIORITY_AGING (64) later arrivals (plus those of the 8 clients that
    were ahead of it by arrival), finishes while the flood goes on (without aging it would wait for all 600), and
    gets its solo tokens."""
    from backend_lib.engine.scheduler import PRIORITY_AGING

    front, flooders = priority_front, 8
    low = {**GREEDY, "max_tokens": 12, "priority": 0}
    high = {**GREEDY, "prompt": "Flood", "max_tokens": 3, "priority": -1}
    post = lambda b: requests.post(f"{front.url}/v1/completions", json=b, timeout=300)  # noqa: E731
    alone = post(low)
    assert alone.status_code == 200, alone.text
    solo_text = alone.json()["choices"][0]["text"]
    done: list[str] = []
    stop = threading.Event()
    lock = threading.Lock()

    def flood():
        while not stop.is_set():
            r = post(high)
            assert r.status_code == 200, r.text
            with lock:
                done.append("high")
                if len(done) > 600:   # the bound is long past: give up (the assertion below then fails)
                    stop.set()

    with ThreadPoolExecutor(flooders) as pool:
        floods = [pool.submit(flood) for _ in range(flooders)]
        while len(done) < 2 * flooders:   # the queue is full of high-priority requests
            time.sleep(0.05)
        with lock:
            sent_at = len(done)
        r = post(low)
        with lock:
            finished_at = len(done)
        time.sleep(0.5)
        stop.set()
        for f in floods:
            f.result(timeout=300)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == solo_text
    overtaken = finished_at - sent_at
    # counted at the clients: besides the 64 later arrivals the aging lets pass, the flooders' requests queued when
    # it was sent and those sent again while it went through the front (ahead of it by arrival), one each at most
    assert overtaken <= PRIORITY_AGING + 2 * flooders + 1, overtaken
    assert len(done) > finished_at, "the flood had ended before the low-priority request finished"
    print(f"\npriority aging: a priority-0 request sent into a flood of priority -1 requests (8 clients, one slot) "
          f"finished after {overtaken} of them (bound {PRIORITY_AGING} later arrivals + up to {2 * flooders + 1} "
          f"ahead of it), its tokens exact")


def test_prompt_scoring_takes_its_share_of_a_step_and_a_short_request_behind_it_goes_first(priority_front):
    """A scoring request (8 prompts of 1,000 tokens, prompt_logprobs 1: 8,000 rows of full-vocabulary logits, 500
    steps at its share of 16 rows: long beside the short request's own ~0.35 s through the front) sent first, a
    3-token greedy request right behind it: the short one is scheduled in the step's other 48 tokens and finishes
    first, with its solo text; the scored logprobs are the bits of the same request scored alone."""
    front = priority_front
    post = lambda b: requests.post(f"{front.url}/v1/completions", json=b, timeout=600)  # noqa: E731
    short = {**GREEDY, "model": "qwen3_share", "max_tokens": 3}
    scoring = {"model": "qwen3_share", "prompt": [[9707 + i] * 1000 for i in range(8)], "max_tokens": 1,
               "temperature": 0, "prompt_logprobs": 1}
    solo_short = post(short).json()["choices"][0]["text"]
    solo_scores = [c["prompt_logprobs"] for c in post(scoring).json()["choices"]]
    finished: list[str] = []

    t0, at = time.time(), {}

    def run(name, body):
        r = post(body)
        finished.append(name)
        at[name] = time.time() - t0
        return r

    with ThreadPoolExecutor(2) as pool:
        big = pool.submit(run, "scoring", scoring)
        time.sleep(0.3)   # the scoring request is admitted first
        small = pool.submit(run, "short", short)
        r_small, r_big = small.result(timeout=600), big.result(timeout=600)
    assert r_small.status_code == 200 and r_big.status_code == 200, (r_small.text, r_big.text)
    # without the share (scoring taking whole steps) the short one finishes right after the scoring, or just before
    assert finished == ["short", "scoring"] and at["short"] < 0.5 * at["scoring"], at
    assert r_small.json()["choices"][0]["text"] == solo_short
    assert [c["prompt_logprobs"] for c in r_big.json()["choices"]] == solo_scores
