"""Never falls over: bad input, overload, cancellation, disconnects, engine faults, load failures, soak.

Everything goes through the real tritonserver. One server holds the models these tests need:
  qwen3_a8w8      the normal model (64 sequences at once, for the soak)
  qwen3_small     a pool of 6 KV pages: concurrent requests must preempt and still finish correctly
  qwen3_busy      one sequence at a time and a waiting queue of 2: overload is refused at once
  qwen3_faulty    an exception is injected inside every 7th engine step
  broken_*        checkpoints that cannot load: missing folder, corrupt safetensors, unsupported config
Figures are printed (pytest -s) and go into the README.
"""
from __future__ import annotations

import http.client
import json
import queue
import random
import shutil
import statistics
import threading
import time

import numpy as np
import pytest
import tritonclient.grpc as grpcclient

from client.stream import stream_generate
from client.triton_inputs import build_inputs, is_final, response_text
from conftest import SERVER_ENGINE, make_engine
from test_triton_server import collect

pytestmark = [pytest.mark.slow, pytest.mark.server, pytest.mark.reliability]
PROMPT = "The quick brown fox jumps over the lazy dog"
GREEDY = {"sampling_parameters": {"temperature": 0, "ignore_eos": True}}
SMALL_POOL = {**SERVER_ENGINE, "kv_cache_memory": str(6 * 16 * 512), "max_model_len": "64", "max_num_seqs": "4"}
FIGURES: dict = {}


@pytest.fixture(scope="module")
def server(tmp_path_factory, a8w8_ckpt, bf16_ckpt):
    from backend_lib.serving.server_process import TritonServer, make_repository

    root = tmp_path_factory.mktemp("reliability")
    corrupt = root / "corrupt-ckpt"
    shutil.copytree(a8w8_ckpt, corrupt)
    (corrupt / "model.safetensors").write_bytes(b"\0not a safetensors file" * 64)
    unsupported = root / "unsupported-ckpt"
    shutil.copytree(a8w8_ckpt, unsupported)
    cfg = json.loads((unsupported / "config.json").read_text())
    cfg["quantization_config"]["config_groups"]["group_0"]["weights"]["num_bits"] = 4
    (unsupported / "config.json").write_text(json.dumps(cfg))
    a8 = str(a8w8_ckpt)
    repo = make_repository(root / "models", {
        "qwen3_a8w8": {**SERVER_ENGINE, "checkpoint": a8, "max_num_seqs": "64", "kv_cache_memory": "256MiB",
                       "max_num_batched_tokens": "256"},
        "qwen3_small": {"_source": "qwen3_a8w8", **SMALL_POOL, "checkpoint": a8},
        "qwen3_busy": {"_source": "qwen3_a8w8", **SERVER_ENGINE, "checkpoint": a8, "max_num_seqs": "1",
                       "max_waiting_requests": "2"},
        "qwen3_faulty": {"_source": "qwen3_a8w8", **SERVER_ENGINE, "checkpoint": a8, "fault_injection": "every:7"},
        "broken_missing": {"_source": "qwen3_a8w8", "checkpoint": str(root / "no-such-folder")},
        "broken_corrupt": {"_source": "qwen3_a8w8", **SERVER_ENGINE, "checkpoint": str(corrupt)},
        "broken_config": {"_source": "qwen3_a8w8", **SERVER_ENGINE, "checkpoint": str(unsupported)},
    })
    srv = TritonServer(repo, root / "tritonserver.log", extra_args=["--exit-on-error=false"]).start(
        ready_models=["qwen3_a8w8", "qwen3_small", "qwen3_busy", "qwen3_faulty"])
    yield srv
    srv.stop()
    print("\nreliability figures: " + json.dumps(FIGURES))


def tensor(name, arr, dtype):
    t = grpcclient.InferInput(name, list(arr.shape), dtype)
    t.set_data_from_numpy(arr)
    return t


def text_tensor(value: bytes):
    return tensor("text_input", np.array([value], dtype=np.object_), "BYTES")


def test_bad_inputs_get_one_error_naming_the_field_and_the_model_keeps_serving(server):
    url, m = server.grpc_url, "qwen3_a8w8"
    stream = tensor("stream", np.array([True]), "BOOL")
    cases = [
        ({"prompt": None, "max_tokens": 4}, "text_input or input_ids"),
        ({"prompt": "", "max_tokens": 4}, "text_input"),
        ({"prompt": "word " * 3000, "max_tokens": 4}, "max_model_len"),
        ({"prompt": PROMPT, "max_tokens": 0}, "max_tokens"),
        ({"prompt": PROMPT, "max_tokens": 100_000}, "max_tokens"),
        ({"prompt": PROMPT, "temperature": -0.5}, "temperature"),
        ({"prompt": PROMPT, "temperature": float("nan")}, "temperature"),
        ({"prompt": PROMPT, "top_p": 0.0}, "top_p"),
        ({"prompt": PROMPT, "top_p": 1.5}, "top_p"),
        ({"prompt": PROMPT, "top_k": -3}, "top_k"),
        ({"prompt": PROMPT, "beam_width": 4}, "beam_width"),
        ({"prompt": PROMPT, "sampling_parameters": {"temperature": 0, "best_of": 3}}, "best_of"),
        ({"input_ids": [1, 2, 10_000_000]}, "input_ids"),
        ({"prompt": PROMPT, "stop_words": ["s"] * 100}, "stop"),
        ({"prompt": PROMPT, "stop_words": ["x" * 5000]}, "stop"),
    ]
    raw_cases = [
        ([text_tensor(b"caf\xc3(\xa9 bad utf-8"), stream], "text_input: not valid UTF-8"),
        ([text_tensor(PROMPT.encode()), stream,
          tensor("sampling_parameters", np.array([b"{not json"], dtype=np.object_), "BYTES")], "sampling_parameters"),
        ([text_tensor(PROMPT.encode()), stream, tensor("max_tokens", np.array([5.0], dtype=np.float32), "FP32")],
         "max_tokens"),                                              # wrong dtype: Triton's own check names it
        ([text_tensor(PROMPT.encode()), stream, tensor("max_tokens", np.array([5, 6], dtype=np.int32), "INT32")],
         "max_tokens"),                                              # wrong shape
        ([text_tensor(b"x" * (2 << 20)), stream], "max_prompt_bytes"),
    ]
    n_errors = 0
    for request, field in cases:
        res = collect(url, m, **request)
        assert len(res) == 1 and res[0][0] == "ERROR", (request, res)
        assert field in res[0][1], (field, res[0][1])
        n_errors += 1
    for inputs, field in raw_cases:
        res = collect(url, m, raw_inputs=inputs)
        assert len(res) == 1 and res[0][0] == "ERROR" and field in res[0][1], (field, res)
        n_errors += 1
    good = stream_generate(url, m, PROMPT, max_tokens=5, **GREEDY)
    assert len(good["output_ids"]) == 5
    assert _wait_pages_free(server, m, 2)
    FIGURES["bad_requests_rejected"] = n_errors


def test_overload_is_refused_at_once_with_unavailable(server):
    """The model answers with TritonError UNAVAILABLE; Triton 2.51 hands decoupled-model errors to clients as a
    message only (gRPC stream) or as HTTP 400 (generate), so the message names the condition and the code."""
    import urllib.error
    import urllib.request

    m = "qwen3_busy"
    body = json.dumps({"text_input": PROMPT, "max_tokens": 150, "temperature": 0,
                       "sampling_parameters": json.dumps({"ignore_eos": True})}).encode()
    results: list = [None] * 8

    def run(i):
        t0 = time.perf_counter()
        req = urllib.request.Request(f"http://{server.http_url}/v2/models/{m}/generate", data=body)
        try:
            with urllib.request.urlopen(req, timeout=120) as r:
                results[i] = (r.status, json.loads(r.read()), time.perf_counter() - t0)
        except urllib.error.HTTPError as e:
            results[i] = (e.code, json.loads(e.read()), time.perf_counter() - t0)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
        time.sleep(0.05)
    for t in threads:
        t.join(120)
    refused = [r for r in results if r[0] != 200]
    served = [r for r in results if r[0] == 200]
    assert refused and served, "the queue limit must refuse some requests and serve the others"
    for code, body_, dt in refused:
        assert code >= 400 and "server overloaded (UNAVAILABLE)" in body_["error"], (code, body_)
        assert dt < 2.0, f"a refusal took {dt:.2f}s: it must come at once"
    assert all(len(b["output_ids"]) == 150 for _, b, _ in served)
    FIGURES["overload"] = {"sent": 8, "refused_unavailable": len(refused), "served": len(served),
                           "slowest_refusal_s": round(max(dt for _, _, dt in refused), 3)}


def test_kv_exhaustion_preempts_and_every_request_completes_correctly(server, a8w8_ckpt):
    url, m = server.grpc_url, "qwen3_small"
    eng = make_engine(a8w8_ckpt, dtype="bfloat16", kv_cache_memory="64MiB", max_model_len=64)
    prompts = [eng.tokenizer.encode(f"{PROMPT} number {i} " * 2)[:20] for i in range(4)]
    expected = [eng.generate([p], eng.make_params({"temperature": 0, "max_tokens": 40, "ignore_eos": True}))[0]
                ["output_ids"] for p in prompts]
    got: list = [None] * 4

    def run(i):
        got[i] = stream_generate(url, m, input_ids=prompts[i], max_tokens=40, **GREEDY)["output_ids"]

    threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert got == expected
    assert server.metric("vllm:kv_cache_pages_total", m) == 6
    time.sleep(0.3)
    assert server.metric("vllm:kv_cache_pages_used", m) == 0


def _wait_pages_free(server, model, seconds):
    return server.wait_until(lambda: server.metric("vllm:kv_cache_pages_used", model) == 0 and
                             server.metric("vllm:num_requests_running", model) == 0, seconds)


# Triton 2.51's gRPC frontend (the server in the nvidia-pytriton wheel) has a race between a stream's
# cancellation and a response arriving at the same moment that can crash the server process with
# SIGSEGV; upstream fixed it in triton-inference-server/server#7840 and #8078 (Triton 24.12 / 25.03).
# It is rare (in one run of this test out of three to ten here) and outside this repository: when it is exactly
# that crash, the test is reported as an expected failure; any other failure fails it.
UPSTREAM_CANCEL_RACE = ("tritonserver 2.51 segfaulted in its gRPC cancellation path (upstream race, fixed in "
                        "triton-inference-server/server#7840 and #8078)")


@pytest.fixture
def cancel_server(tmp_path_factory, a8w8_ckpt):
    """A server of its own, so that the upstream crash above cannot take the other tests down with it."""
    from backend_lib.serving.server_process import TritonServer, make_repository

    root = tmp_path_factory.mktemp("cancel-cycles")
    repo = make_repository(root / "models", {"qwen3_a8w8": {**SERVER_ENGINE, "checkpoint": str(a8w8_ckpt)}})
    srv = TritonServer(repo, root / "tritonserver.log").start()
    yield srv
    srv.stop()


def test_200_grpc_cancel_cycles_leave_no_pages_and_flat_memory(cancel_server):
    try:
        _cancel_cycles(cancel_server)
    except Exception:
        try:   # a crashing server prints its stack first and exits a moment later
            cancel_server.proc.wait(timeout=15)
        except Exception:
            pass
        if cancel_server.proc.poll() is not None and "Signal (11) received" in cancel_server.log_tail(200):
            pytest.xfail(UPSTREAM_CANCEL_RACE)
        raise


def _cancel_cycles(server) -> None:
    url, m = server.grpc_url, "qwen3_a8w8"
    rss_before = server.rss_mib(m)
    t0 = time.time()
    for i in range(200):
        client = grpcclient.InferenceServerClient(url)
        got: queue.Queue = queue.Queue()
        client.start_stream(callback=lambda result, error: got.put((result, error)))
        client.async_stream_infer(m, build_inputs(f"{PROMPT} {i}", max_tokens=900, **GREEDY))
        r, e = got.get(timeout=60)
        assert e is None
        client.stop_stream(cancel_requests=True)
        client.close()
    assert _wait_pages_free(server, m, 5), "pages still in use after the cancel cycles"
    rss_after = server.rss_mib(m)
    cancelled = server.finished_total(m, "cancelled")
    FIGURES["cancel_cycles"] = {"cycles": 200, "seconds": round(time.time() - t0, 1), "cancelled_total": cancelled,
                                "stub_rss_mib_before": round(rss_before, 1), "stub_rss_mib_after": round(rss_after, 1)}
    assert cancelled >= 200
    assert rss_after - rss_before < 64, f"memory grew from {rss_before:.0f} to {rss_after:.0f} MiB"


def test_closed_http_generate_stream_aborts_the_request(server):
    m = "qwen3_a8w8"
    host, port = server.http_url.split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    conn.request("POST", f"/v2/models/{m}/generate_stream", body=json.dumps(
        {"text_input": PROMPT, "max_tokens": 900, "stream": True, "temperature": 0,
         "sampling_parameters": json.dumps({"ignore_eos": True})}))
    resp = conn.getresponse()
    for _ in range(3):
        assert resp.fp.readline()
    server.wait_until(lambda: server.metric("vllm:kv_cache_pages_used", m) > 0, 5)
    assert server.metric("vllm:kv_cache_pages_used", m) > 0
    before = server.finished_total(m, "cancelled")
    conn.sock.shutdown(2)
    conn.close()
    t0 = time.time()
    assert _wait_pages_free(server, m, 3), "a closed HTTP stream kept generating (900 tokens take far longer)"
    FIGURES["http_disconnect_freed_s"] = round(time.time() - t0, 2)
    assert server.finished_total(m, "cancelled") == before + 1


def test_engine_faults_give_error_responses_and_the_engine_recovers(server):
    url, m = server.grpc_url, "qwen3_faulty"
    results: list = [None] * 12

    def run(i):
        results[i] = collect(url, m, timeout=60, prompt=f"{PROMPT} {i}", max_tokens=12, **GREEDY)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(12)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert all(r is not None for r in results), "a client hung"
    errors = [r for r in results if r[-1][0] == "ERROR"]
    ok = [r for r in results if r[-1][0] != "ERROR"]
    assert errors, "with a fault every 7 steps some requests must have failed"
    assert all("injected fault" in r[-1][1] for r in errors)
    assert all(sum(len(ids) for _, ids, _ in r) == 12 for r in ok)
    assert _wait_pages_free(server, m, 5)
    later = [collect(url, m, timeout=60, prompt=PROMPT, max_tokens=2, **GREEDY) for _ in range(4)]
    assert any(r[-1][0] != "ERROR" for r in later), "the engine did not recover after faults"
    assert server.model_ready(m)
    FIGURES["faults"] = {"requests": 16, "failed_by_injected_faults": len(errors) + sum(
        r[-1][0] == "ERROR" for r in later), "completed": len(ok) + sum(r[-1][0] != "ERROR" for r in later)}


def test_load_failures_leave_the_model_unavailable_and_the_others_serving(server):
    for name in ("broken_missing", "broken_corrupt", "broken_config"):
        assert not server.model_ready(name), name
    for name in ("qwen3_a8w8", "qwen3_small", "qwen3_busy", "qwen3_faulty"):
        assert server.model_ready(name), name
    log = server.log_path.read_text(errors="replace")
    assert "no-such-folder does not exist" in log
    assert "model.safetensors: not a readable safetensors file" in log
    assert "weights.num_bits: 4 is not supported" in log
    assert len(stream_generate(server.grpc_url, "qwen3_a8w8", PROMPT, max_tokens=3, **GREEDY)["output_ids"]) == 3


def test_soak_64_concurrent_streams(server, a8w8_ckpt):
    """64 streams at once, round after round for a bounded time (QWEN3_SOAK_SECONDS, default 180): every stream
    equals its solo greedy run, and the stub's memory stays flat once the first rounds have warmed it up."""
    import os

    budget = float(os.environ.get("QWEN3_SOAK_SECONDS", "180"))
    url, m = server.grpc_url, "qwen3_a8w8"
    eng = make_engine(a8w8_ckpt, dtype="bfloat16")
    rng = random.Random(7)
    prompts = [[rng.randrange(1000, 100_000) for _ in range(rng.randrange(8, 60))] for _ in range(64)]
    lengths = [rng.randrange(16, 64) for _ in range(64)]
    expected = [r["output_ids"] for r in eng.generate(
        prompts, [eng.make_params({"temperature": 0, "max_tokens": n, "ignore_eos": True}) for n in lengths])]
    rss: list[float] = []
    gaps: list[float] = []
    mismatches = errors = tokens = requests = rounds = 0
    t_start = time.time()
    while rounds < 3 or time.time() - t_start < budget:
        got: list = [None] * 64
        times: list = [None] * 64

        def run(i):
            stamps = []
            results: queue.Queue = queue.Queue()
            client = grpcclient.InferenceServerClient(url)
            client.start_stream(callback=lambda result, error: results.put((result, error, time.perf_counter())))
            client.async_stream_infer(m, build_inputs(input_ids=prompts[i], max_tokens=lengths[i], **GREEDY),
                                      enable_empty_final_response=True)
            ids = []
            try:
                while True:
                    r, e, ts = results.get(timeout=120)
                    if e is not None:
                        ids = None
                        break
                    _, new = response_text(r)
                    if new:
                        stamps.append(ts)
                        ids.extend(new)
                    if is_final(r):
                        break
            finally:
                client.stop_stream()
                client.close()
            got[i], times[i] = ids, stamps

        threads = [threading.Thread(target=run, args=(i,)) for i in range(64)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(180)
        for i in range(64):
            requests += 1
            if got[i] is None:
                errors += 1
                continue
            tokens += len(got[i])
            mismatches += got[i] != expected[i]
            gaps += [b - a for a, b in zip(times[i], times[i][1:])]
        rounds += 1
        rss.append(server.rss_mib(m))
    assert _wait_pages_free(server, m, 5)
    # The first third warms the allocator up; after that memory must stay flat. Single samples swing by
    # tens of MiB as the allocator takes and returns arenas, so compare the medians of the last two thirds.
    third = max(1, len(rss) // 3)
    mid_rss, end_rss = statistics.median(rss[third:2 * third]), statistics.median(rss[2 * third:])
    q = statistics.quantiles(gaps, n=100)
    FIGURES["soak"] = {"rounds": rounds, "concurrent_streams": 64, "requests": requests, "tokens_checked": tokens,
                       "errors": errors, "mismatched_streams": mismatches,
                       "itl_p50_ms": round(q[49] * 1000, 2), "itl_p99_ms": round(q[98] * 1000, 2),
                       "seconds": round(time.time() - t_start, 1), "stub_rss_mib_first_round": round(rss[0], 1),
                       "stub_rss_mib_middle_third_median": round(mid_rss, 1),
                       "stub_rss_mib_last_third_median": round(end_rss, 1)}
    print("\nsoak: " + json.dumps(FIGURES["soak"]))
    assert errors == 0 and mismatches == 0 and rounds >= 4
    assert end_rss - mid_rss < 16, f"memory kept growing during the soak: {rss}"
