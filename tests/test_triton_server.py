"""Through the real tritonserver: streaming, both dialects, concurrency, cancellation, HTTP, metrics."""
from __future__ import annotations

import json
import queue
import re
import threading
import time
import urllib.request

import numpy as np
import pytest
import tritonclient.grpc as grpcclient

from client.http_stream import generate_stream
from client.stream import stream_generate
from client.triton_inputs import build_inputs
from helpers import GREEDY, HUB_ID, HUB_REVISION, PROMPT, SERVER_ENGINE, collect, offline_generate

pytestmark = [pytest.mark.slow, pytest.mark.server]


def test_models_are_ready(triton):
    assert triton.model_ready("qwen3_a8w8") and triton.model_ready("qwen3_tq")


@pytest.mark.parametrize("model, ckpt_fixture, kv_cache", [("qwen3_a8w8", "a8w8_ckpt", "bf16"),
                                                           ("qwen3_tq", "bf16_ckpt", "tq")])   # tq: by hub id
def test_streaming_gives_one_response_per_token_equal_to_offline_cli(triton, request, model, ckpt_fixture, kv_cache):
    ckpt = request.getfixturevalue(ckpt_fixture)
    expected = offline_generate(ckpt, PROMPT, 16, kv_cache=kv_cache)
    responses = collect(triton.grpc_url, model, prompt=PROMPT, max_tokens=16, **GREEDY)
    token_responses = [r for r in responses if r[1]]
    assert all(len(ids) == 1 for _, ids, _ in token_responses)
    assert len(token_responses) == 16
    assert [i for _, ids, _ in token_responses for i in ids] == expected["output_ids"]
    assert "".join(t for t, _, _ in responses) == expected["text"]
    assert responses[-1][2]


def test_non_streaming_gives_exactly_one_response_with_the_prompt(triton):
    responses = collect(triton.grpc_url, "qwen3_a8w8", prompt=PROMPT, max_tokens=8, stream=False, **GREEDY)
    assert len(responses) == 1 and responses[0][2]
    text, ids, _ = responses[0]
    assert len(ids) == 8 and text.startswith(PROMPT)
    streamed = collect(triton.grpc_url, "qwen3_a8w8", prompt=PROMPT, max_tokens=8, **GREEDY)
    assert text == PROMPT + "".join(t for t, _, _ in streamed)
    excl = collect(triton.grpc_url, "qwen3_a8w8", prompt=PROMPT, max_tokens=8, stream=False,
                   exclude_input_in_output=True, **GREEDY)
    assert excl[0][0] == "".join(t for t, _, _ in streamed)


def test_both_dialects_agree(triton):
    vllm = stream_generate(triton.grpc_url, "qwen3_a8w8", PROMPT, sampling_parameters={
        "max_tokens": 12, "temperature": 0.8, "top_k": 40, "seed": 7, "ignore_eos": True})
    trt = stream_generate(triton.grpc_url, "qwen3_a8w8", PROMPT, max_tokens=12, temperature=0.8, top_k=40, seed=7,
                          sampling_parameters={"ignore_eos": True})
    assert vllm["output_ids"] == trt["output_ids"] and len(trt["output_ids"]) == 12
    # vLLM-backend clients send values as strings; a field given as a tensor and in the JSON must agree
    strings = stream_generate(triton.grpc_url, "qwen3_a8w8", PROMPT, max_tokens=12, sampling_parameters={
        "max_tokens": "12", "temperature": "0.8", "top_k": "40", "seed": "7", "ignore_eos": "true"})
    assert strings["output_ids"] == vllm["output_ids"]
    with pytest.raises(RuntimeError, match=r"max_tokens: given in sampling_parameters \(3\) and in an input tensor"):
        stream_generate(triton.grpc_url, "qwen3_a8w8", PROMPT, max_tokens=12, sampling_parameters={"max_tokens": 3})


def test_eight_concurrent_streams_equal_their_solo_runs(triton):
    prompts = [f"{PROMPT} #{i}" + " more" * i for i in range(8)]
    solo = [stream_generate(triton.grpc_url, "qwen3_a8w8", p, max_tokens=20, **GREEDY)["output_ids"] for p in prompts]
    results = [None] * 8

    def run(i):
        results[i] = stream_generate(triton.grpc_url, "qwen3_a8w8", prompts[i], max_tokens=20, **GREEDY)["output_ids"]

    threads = [threading.Thread(target=run, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert results == solo


def test_cancelling_a_stream_frees_its_pages(triton):
    client = grpcclient.InferenceServerClient(triton.grpc_url)
    got: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: got.put((result, error)))
    client.async_stream_infer("qwen3_tq", build_inputs(PROMPT, max_tokens=1000, **GREEDY))
    for _ in range(5):
        r, e = got.get(timeout=60)
        assert e is None
    def pages():
        return triton.metric("vllm:kv_cache_pages_used", "qwen3_tq")

    triton.wait_until(lambda: pages() > 0, 5)
    assert pages() > 0
    client.stop_stream(cancel_requests=True)
    client.close()
    triton.wait_until(lambda: pages() == 0, 2, poll=0.1)   # far less than the 1000 tokens would take
    assert pages() == 0
    assert triton.metric("vllm:num_requests_running", "qwen3_tq") == 0
    assert triton.finished_total("qwen3_tq", "cancelled") >= 1
    # and the model keeps serving
    assert len(stream_generate(triton.grpc_url, "qwen3_tq", PROMPT, max_tokens=4, **GREEDY)["output_ids"]) == 4


def test_http_generate_and_generate_stream(triton):
    body = {"text_input": PROMPT, "max_tokens": 10, "temperature": 0, "exclude_input_in_output": True,
            "sampling_parameters": json.dumps({"ignore_eos": True})}
    req = urllib.request.Request(f"http://{triton.http_url}/v2/models/qwen3_a8w8/generate",
                                 data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        whole = json.loads(r.read())
    events = list(generate_stream(triton.http_url, "qwen3_a8w8", {**body, "stream": True}))
    assert len(events) == 10
    assert "".join(e["text_output"] for e in events) == whole["text_output"]
    assert [e["output_ids"] for e in events] == whole["output_ids"]


def test_bad_request_gets_an_error_naming_the_field_and_the_model_keeps_serving(triton):
    bad = collect(triton.grpc_url, "qwen3_a8w8", prompt=PROMPT, max_tokens=8, temperature=-1.0)
    assert bad[0][0] == "ERROR" and "temperature" in bad[0][1]
    bad = collect(triton.grpc_url, "qwen3_a8w8", prompt=PROMPT, sampling_parameters={"top_p": 7})
    assert bad[0][0] == "ERROR" and "top_p" in bad[0][1]
    assert len(stream_generate(triton.grpc_url, "qwen3_a8w8", PROMPT, max_tokens=3, **GREEDY)["output_ids"]) == 3


VLLM_BACKEND_SET = {   # triton-inference-server/vllm_backend src/utils/metrics.py, as prometheus-client names families
    "vllm:prompt_tokens": "counter", "vllm:generation_tokens": "counter",
    "vllm:time_to_first_token_seconds": "histogram", "vllm:time_per_output_token_seconds": "histogram",
    "vllm:e2e_request_latency_seconds": "histogram", "vllm:request_prompt_tokens": "histogram",
    "vllm:request_generation_tokens": "histogram", "vllm:request_params_n": "histogram",
}


def test_metrics_page_has_the_vllm_backend_set_with_exact_counts_for_a_known_request(triton):
    ids = [9707, 11, 1879, 0, 2585, 525, 498]   # 7 prompt tokens
    m = "qwen3_a8w8"
    names = ("vllm:prompt_tokens_total", "vllm:generation_tokens_total", "vllm:time_to_first_token_seconds_count",
             "vllm:inter_token_latency_seconds_count", "vllm:time_per_output_token_seconds_count",
             "vllm:e2e_request_latency_seconds_count", "vllm:request_prompt_tokens_sum",
             "vllm:request_generation_tokens_sum", "vllm:request_params_n_count")
    before = {k: triton.metric(k, m) for k in names}
    length_before = triton.finished_total(m, "length")
    res = stream_generate(triton.grpc_url, m, input_ids=ids, max_tokens=9, **GREEDY)
    assert len(res["output_ids"]) == 9 and res["finish_reason"] == "length"
    time.sleep(0.3)
    delta = {k: triton.metric(k, m) - before[k] for k in names}
    assert delta == {"vllm:prompt_tokens_total": 7, "vllm:generation_tokens_total": 9,
                     "vllm:time_to_first_token_seconds_count": 1, "vllm:inter_token_latency_seconds_count": 8,
                     "vllm:time_per_output_token_seconds_count": 8, "vllm:e2e_request_latency_seconds_count": 1,
                     "vllm:request_prompt_tokens_sum": 7, "vllm:request_generation_tokens_sum": 9,
                     "vllm:request_params_n_count": 1}
    assert triton.finished_total(m, "length") - length_before == 1
    assert triton.metric("vllm:kv_cache_pages_total", m) > 0
    families = triton.metric_families()          # the whole page parses (prometheus-client's parser)
    for name, kind in VLLM_BACKEND_SET.items():
        assert families[name].type == kind, name
        assert {s.labels.get("model") for s in families[name].samples} >= {"qwen3_a8w8", "qwen3_tq"}, name
    e2e = [s for s in families["vllm:e2e_request_latency_seconds"].samples
           if s.name.endswith("_bucket") and s.labels["model"] == m]
    assert e2e[-1].labels["le"] == "+Inf" and [float(s.labels["le"]) for s in e2e[:3]] == [0.3, 0.5, 0.8]
    reasons = {s.labels["finished_reason"] for s in families["vllm:request_success"].samples
               if s.labels["model"] == "qwen3_tq"}
    assert {"stop", "length", "abort", "cancelled", "error"} <= reasons     # listed before any such request


def test_hub_ids_load_from_the_hub_cache(triton):
    log = triton.log_path.read_text(errors="replace")
    snapshot = f"models--{HUB_ID.replace('/', '--')}/snapshots/{HUB_REVISION}"
    assert re.search(rf"qwen3_tq: loading \S*{re.escape(snapshot)} on cpu", log)
    assert re.search(rf"qwen3_tokenizer: tokenizer from \S*{re.escape(snapshot)}", log)
    # the id serves the same ids as the folder: test_streaming_gives_one_response_per_token_equal_to_offline_cli


def test_the_models_log_through_triton_at_its_verbosity(triton):
    """Model log lines are Triton's (its line format, its --log-verbose: 0 here, so no verbose line)."""
    log = triton.log_path.read_text(errors="replace")
    assert re.search(r'^I\d{4} \d\d:\d\d:\d\d\.\d{6} +\d+ \S+\.py:\d+\] "?qwen3_a8w8: ready', log, re.M), log[-3000:]
    assert "qwen3_a8w8: loading" in log and "engine configuration" not in log


def test_prefix_cache_through_the_server_reuses_pages_and_keeps_the_ids(triton):
    m = "qwen3_a8w8"
    prompt = ("You are a careful assistant. " * 12) + "Question: what is 2 + 2?"
    hits = lambda: triton.metric("vllm:prefix_cache_hits_total", m)  # noqa: E731
    queries = lambda: triton.metric("vllm:prefix_cache_queries_total", m)  # noqa: E731
    salted = {"sampling_parameters": {**GREEDY["sampling_parameters"], "cache_salt": "tenant-x"}}
    first = collect(triton.grpc_url, m, prompt=prompt, max_tokens=8, **salted)
    h0, q0 = hits(), queries()
    again = collect(triton.grpc_url, m, prompt=prompt, max_tokens=8, **salted)
    assert again == first
    assert queries() > q0 and hits() - h0 >= 16 * 4          # the prompt's full pages came from the cache
    h1 = hits()
    other = collect(triton.grpc_url, m, prompt=prompt, max_tokens=8, **GREEDY)   # no salt: another tenant
    assert other == first and hits() == h1
    assert triton.metric("vllm:kv_cache_pages_cached", m) > 0


def _responses(url, model, raw_inputs=None, **request):
    """Every result object of one gRPC stream request (errors raised as they came). raw_inputs: InferInput tensors
    to send as they are instead of build_inputs(**request)."""
    results: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(url)
    client.start_stream(callback=lambda result, error: results.put((result, error)))
    client.async_stream_infer(model, raw_inputs if raw_inputs is not None else build_inputs(**request),
                              enable_empty_final_response=True)
    out = []
    try:
        while True:
            r, e = results.get(timeout=120)
            if e is not None:
                raise e
            out.append(r)
            if r.get_response().parameters["triton_final_response"].bool_param:
                return out
    finally:
        client.stop_stream()
        client.close()


@pytest.mark.parametrize("stream", [True, False])
def test_prompt_logprobs_output_equals_score_and_masks_apply(triton, a8w8_ckpt, stream):
    import subprocess
    import sys

    from helpers import ROOT
    ids = [785, 3974, 13876, 38835, 34208, 916, 279, 15678, 5562, 13]
    proc = subprocess.run([sys.executable, "-m", "backend_lib.score", "--checkpoint", str(a8w8_ckpt), "--ids",
                           ",".join(map(str, ids)), "--dtype", "bfloat16", "--page-size", "16", "--json"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    scored = json.loads(proc.stdout.strip().splitlines()[-1])["logprobs"]
    plain = collect(triton.grpc_url, "qwen3_a8w8", input_ids=ids, max_tokens=6, **GREEDY)
    sp = {**GREEDY["sampling_parameters"], "prompt_logprobs": 2, "max_tokens": 6}
    rs = _responses(triton.grpc_url, "qwen3_a8w8", input_ids=ids, stream=stream, sampling_parameters=sp)
    carrying = [r for r in rs if r.as_numpy("prompt_logprobs") is not None]
    assert len(carrying) == 1 and carrying[0].as_numpy("output_ids").size > 0   # once, with the first token
    plp = [json.loads(x) for x in carrying[0].as_numpy("prompt_logprobs")]
    assert {k: plp[0][k] for k in ("id", "logprob", "rank", "top")} == {"id": ids[0], "logprob": None, "rank": None,
                                                                         "top": []}
    assert [e["id"] for e in plp[1:]] == ids[1:] and all(len(e["top"]) == 2 for e in plp[1:])
    assert [e["logprob"] for e in plp[1:]] == scored[1:]
    got = [int(i) for r in rs for i in r.as_numpy("output_ids")]
    assert got == [i for _, ids_, _ in plain for i in ids_]   # the tokens are those of the request without it
    biased = collect(triton.grpc_url, "qwen3_a8w8", input_ids=ids, stream=stream,
                     sampling_parameters={**sp, "max_tokens": 4, "logit_bias": {"1234": 100}, "bad_words": ["x"]})
    assert [i for _, ids_, _ in biased for i in ids_] == [1234] * 4
    bad = collect(triton.grpc_url, "qwen3_a8w8", input_ids=ids, max_tokens=4,
                  sampling_parameters={"logit_bias": {"99999999": 1}})
    assert bad[-1][0] == "ERROR" and "logit_bias" in bad[-1][1]


def test_vllm_backend_outputs_mean_what_vllm_backend_documents(triton):
    """num_output_tokens: this response's count; logprobs: one JSON list per response of {id: {logprob, rank,
    decoded_token}}; return_cumulative_logprob; top_k -1; min_length (TRT-LLM); exclude_input_in_output
    false with stream refused; max_tokens beyond the context refused."""
    rs = _responses(triton.grpc_url, "qwen3_a8w8", prompt=PROMPT, return_num_output_tokens=True,
                    return_logprobs=True, sampling_parameters={"max_tokens": 5, "temperature": 0, "ignore_eos": True,
                                                               "logprobs": 2, "top_k": -1})
    tokens = [r for r in rs if r.as_numpy("output_ids").size]
    assert [int(r.as_numpy("num_output_tokens")[0]) for r in tokens] == [1] * 5
    total = 0.0
    for r in tokens:
        (lp,) = [json.loads(x) for x in r.as_numpy("logprobs")]
        (entry,) = lp
        tid = int(r.as_numpy("output_ids")[0])
        first = next(iter(entry))
        assert first == str(tid) and entry[first]["rank"] == 1   # greedy: the sampled token is the most likely
        assert entry[first]["decoded_token"] and not entry[first]["decoded_token"].startswith("token_id:")
        assert len(entry) == 2 and sorted(v["rank"] for v in entry.values()) == [1, 2]
        total += entry[first]["logprob"]
        cum = float(r.as_numpy("cumulative_logprob")[0])
    assert abs(cum - total) < 1e-3
    only_cum = _responses(triton.grpc_url, "qwen3_a8w8", prompt=PROMPT, return_cumulative_logprob=True,
                          sampling_parameters={"max_tokens": 3, "temperature": 0})
    assert only_cum[-1].as_numpy("cumulative_logprob").size == 1 and only_cum[-1].as_numpy("logprobs") is None
    base = collect(triton.grpc_url, "qwen3_a8w8", prompt=PROMPT, max_tokens=4, **GREEDY)
    assert collect(triton.grpc_url, "qwen3_a8w8", prompt=PROMPT, max_tokens=4, min_length=4, **GREEDY) == base
    refused = collect(triton.grpc_url, "qwen3_a8w8", prompt=PROMPT, max_tokens=4, exclude_input_in_output=False,
                      **GREEDY)
    assert refused[-1][0] == "ERROR" and "exclude_input_in_output" in refused[-1][1]
    long = collect(triton.grpc_url, "qwen3_a8w8", prompt=PROMPT, max_tokens=1020, **GREEDY)
    assert long[-1][0] == "ERROR" and "max_tokens" in long[-1][1] and "exceeds" in long[-1][1]


def test_n_choices_on_the_triton_path_stream_with_their_sequence_index(triton):
    """sampling_parameters n: one Triton stream, each response tagged with its choice's sequence_index, choice j
    of a seeded request equal to the request with seed + j alone; one final response; an abort ends them all."""
    sp = {"max_tokens": 6, "temperature": 1.0, "seed": 21, "ignore_eos": True}
    rs = _responses(triton.grpc_url, "qwen3_a8w8", prompt=PROMPT, sampling_parameters={**sp, "n": 3})
    finals = [r for r in rs if r.get_response().parameters["triton_final_response"].bool_param]
    assert len(finals) == 1 and finals[0] is rs[-1]
    by_choice: dict = {}
    for r in rs:
        ids = [int(i) for i in r.as_numpy("output_ids")]
        if ids:
            by_choice.setdefault(int(r.as_numpy("sequence_index")[0]), []).extend(ids)
    for j in range(3):
        alone = collect(triton.grpc_url, "qwen3_a8w8", prompt=PROMPT, sampling_parameters={**sp, "seed": 21 + j})
        assert by_choice[j] == [i for _, ids, _ in alone for i in ids]
    assert len({tuple(v) for v in by_choice.values()}) > 1
    bad = collect(triton.grpc_url, "qwen3_a8w8", prompt=PROMPT, sampling_parameters={**sp, "n": 3, "logit_bias": {
        "99999999": 1}})
    assert bad[-1][0] == "ERROR" and "logit_bias" in bad[-1][1]   # every choice is validated before any runs
    assert triton.metric("vllm:num_requests_running", "qwen3_a8w8") == 0


def test_n_choices_without_stream_send_each_choice_whole_with_its_sequence_index(triton):
    """n without stream: one response per choice, the whole text (prompt first, as any non-streaming response) and
    ids, tagged with its sequence_index; the last is the stream's final one. Choice j equals choice j of the
    streaming request, and the request with seed + j alone."""
    sp = {"max_tokens": 6, "temperature": 1.0, "seed": 33, "ignore_eos": True}
    whole = _responses(triton.grpc_url, "qwen3_a8w8", prompt=PROMPT, stream=False, return_finish_reason=True,
                       sampling_parameters={**sp, "n": 3})
    assert len(whole) == 3 and [r.get_response().parameters["triton_final_response"].bool_param for r in whole] == \
        [False, False, True]
    by_choice = {int(r.as_numpy("sequence_index")[0]): r for r in whole}
    assert sorted(by_choice) == [0, 1, 2]
    streamed: dict = {}
    for r in _responses(triton.grpc_url, "qwen3_a8w8", prompt=PROMPT, sampling_parameters={**sp, "n": 3}):
        ids = [int(i) for i in r.as_numpy("output_ids")]
        if ids:
            entry = streamed.setdefault(int(r.as_numpy("sequence_index")[0]), ["", []])
            entry[0] += r.as_numpy("text_output")[0].decode()
            entry[1] += ids
    for j in range(3):
        r = by_choice[j]
        ids = [int(i) for i in r.as_numpy("output_ids")]
        alone = collect(triton.grpc_url, "qwen3_a8w8", prompt=PROMPT, stream=False,
                        sampling_parameters={**sp, "seed": 33 + j})
        assert ids == streamed[j][1] == alone[0][1] and len(ids) == 6
        assert r.as_numpy("text_output")[0].decode() == PROMPT + streamed[j][0] == alone[0][0]
        assert r.as_numpy("finish_reason")[0].decode() == "length"
    assert len({tuple(v[1]) for v in streamed.values()}) > 1
    # HTTP: generate_stream carries the n responses; generate takes exactly one response (Triton's rule), so
    # Triton answers n > 1 there with its own error
    body = {"text_input": PROMPT, "stream": False, "sampling_parameters": json.dumps({**sp, "n": 3})}
    events = list(generate_stream(triton.http_url, "qwen3_a8w8", body))
    assert sorted((e["sequence_index"], e["output_ids"]) for e in events) == \
        [(j, [int(i) for i in by_choice[j].as_numpy("output_ids")]) for j in range(3)]
    req = urllib.request.Request(f"http://{triton.http_url}/v2/models/qwen3_a8w8/generate",
                                 data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        assert "generate expects model to produce exactly 1 response" in json.loads(r.read())["error"]



@pytest.fixture(scope="module")
def trt_shaped(tmp_path_factory, a8w8_ckpt):
    """A tritonserver whose LLM model (qwen3_a8w8's config, the same checkpoint and engine) says max_batch_size 1:
    TensorRT-LLM's tensor shapes, a batch dimension first."""
    from harness.triton_server import TritonServer, make_repository

    root = tmp_path_factory.mktemp("triton-trt-shapes")
    repo = make_repository(root / "models", {"qwen3_trt": {**SERVER_ENGINE, "checkpoint": str(a8w8_ckpt),
                                                           "_source": "qwen3_a8w8"}})
    cfg = repo / "qwen3_trt" / "config.pbtxt"
    cfg.write_text(cfg.read_text() + "max_batch_size: 1\n")
    server = TritonServer(repo, root / "tritonserver.log").start()
    yield server
    server.stop()


def _shaped(shape, **values) -> list:
    """Input tensors of the given shape ([1] or [1, 1]) from scalar values, by their schema types."""
    from backend_lib.serving.schema import LLM_INPUT

    out = []
    for name, value in values.items():
        f = LLM_INPUT[name]
        arr = np.array(value.encode() if isinstance(value, str) else value, dtype=f.np_dtype).reshape(shape)
        t = grpcclient.InferInput(name, list(arr.shape), f.wire_type)
        t.set_data_from_numpy(arr)
        out.append(t)
    return out


TRT_GREEDY = dict(text_input=PROMPT, max_tokens=8, temperature=0.0, sampling_parameters='{"ignore_eos": true}')


def test_tensorrt_llm_shaped_inputs_get_the_ids_of_the_vllm_shaped_request(triton, trt_shaped):
    """max_batch_size 1: every scalar input shaped [1, 1] (as Triton's OpenAI frontend and genai-perf's TensorRT-LLM
    converter send them), streamed or whole, gets the greedy ids the default model gives the [1]-shaped request;
    every output has the batch dimension first."""
    expected = [i for _, ids, _ in collect(triton.grpc_url, "qwen3_a8w8", prompt=PROMPT, max_tokens=8, **GREEDY)
                for i in ids]
    assert len(expected) == 8
    for stream in (True, False):
        stop = np.array([[b"never in this text"]], dtype=np.object_)   # TensorRT-LLM's stop_words: [1, n]
        stop_words = grpcclient.InferInput("stop_words", list(stop.shape), "BYTES")
        stop_words.set_data_from_numpy(stop)
        rs = _responses(trt_shaped.grpc_url, "qwen3_trt", raw_inputs=_shaped(
            (1, 1), **TRT_GREEDY, stream=stream, return_finish_reason=True) + [stop_words])
        assert [i for r in rs for i in r.as_numpy("output_ids").reshape(-1).tolist()] == expected
        assert all(r.as_numpy("output_ids").shape[0] == 1 and r.as_numpy("text_output").shape == (1, 1) for r in rs
                   if r.as_numpy("output_ids") is not None)
        assert rs[-1].as_numpy("finish_reason").reshape(-1)[0].decode() == "length"
    same = _responses(triton.grpc_url, "qwen3_a8w8", raw_inputs=_shaped((1,), **TRT_GREEDY, stream=True))
    assert [i for r in same for i in r.as_numpy("output_ids").tolist()] == expected


@pytest.mark.parametrize("server, model, shape", [("triton", "qwen3_a8w8", (2,)), ("trt_shaped", "qwen3_trt", (1, 2)),
                                                  ("triton", "qwen3_a8w8", (1, 1))])
def test_a_max_tokens_of_another_shape_is_invalid_arg_naming_it(request, server, model, shape):
    """A [2] max_tokens on the [1]-shaped model, a [1, 2] one on the [1, 1]-shaped model, and a TensorRT-LLM-shaped
    [1, 1] one on the default model (Triton checks every input's rank against the config): INVALID_ARG naming
    max_tokens, and the model keeps serving."""
    url = request.getfixturevalue(server).grpc_url
    base = (1, 1) if model == "qwen3_trt" else (1,)
    inputs = [t for t in _shaped(base, **TRT_GREEDY) if t.name() != "max_tokens"]
    bad = np.arange(1, 1 + int(np.prod(shape)), dtype=np.int32).reshape(shape)
    max_tokens = grpcclient.InferInput("max_tokens", list(bad.shape), "INT32")
    max_tokens.set_data_from_numpy(bad)
    with pytest.raises(grpcclient.InferenceServerException) as err:
        _responses(url, model, raw_inputs=inputs + [max_tokens])
    assert re.search(rf"unexpected shape for input 'max_tokens' .* got \[{','.join(map(str, shape))}\]",
                     err.value.message()), err.value.message()   # Triton's INVALID_ARG (no status on a stream)
    if shape == (2,):   # the status, where the transport carries one: HTTP generate, 400
        body = {**TRT_GREEDY, "max_tokens": [3, 4]}
        req = urllib.request.Request(f"http://{request.getfixturevalue(server).http_url}/v2/models/{model}/generate",
                                     data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
        with pytest.raises(urllib.error.HTTPError) as http_err:
            urllib.request.urlopen(req, timeout=60)
        assert http_err.value.code == 400 and "'max_tokens'" in http_err.value.read().decode()
    assert len(_responses(url, model, raw_inputs=_shaped(base, **TRT_GREEDY))) >= 1
