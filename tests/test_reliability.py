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
import os
import queue
import random
import re
import shutil
import signal
import statistics
import threading
import time

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from client.stream import stream_generate
from client.triton_inputs import build_inputs, is_final, response_text
from helpers import GREEDY, PROMPT, SERVER_ENGINE, collect, make_engine

pytestmark = [pytest.mark.slow, pytest.mark.server, pytest.mark.reliability]
SMALL_POOL = {**SERVER_ENGINE, "kv_cache_memory": str(6 * 16 * 512), "max_model_len": "64", "max_num_seqs": "4"}
FIGURES: dict = {}


@pytest.fixture(scope="module")
def server(tmp_path_factory, a8w8_ckpt, bf16_ckpt):
    from harness.triton_server import TritonServer, make_repository

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
    # all 8 sent together: one runs, 2 wait, the rest must be refused. Sent 50 ms apart (as before), a fast host
    # finished each 150-token request before the next few arrived and refused none (a clean-clone CI run)
    start = threading.Barrier(8)

    def run(i):
        req = urllib.request.Request(f"http://{server.http_url}/v2/models/{m}/generate", data=body)
        start.wait(30)
        t0 = time.perf_counter()
        try:
            with urllib.request.urlopen(req, timeout=120) as r:
                results[i] = (r.status, json.loads(r.read()), time.perf_counter() - t0)
        except urllib.error.HTTPError as e:
            results[i] = (e.code, json.loads(e.read()), time.perf_counter() - t0)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
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
    from harness.triton_server import TritonServer, make_repository

    root = tmp_path_factory.mktemp("cancel-cycles")
    repo = make_repository(root / "models", {"qwen3_a8w8": {**SERVER_ENGINE, "checkpoint": str(a8w8_ckpt)}})
    srv = TritonServer(repo, root / "tritonserver.log").start()
    yield srv
    srv.stop()


def test_250_grpc_cancel_cycles_leave_no_pages_and_flat_memory(cancel_server):
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


CANCEL_WARMUP, CANCEL_MEASURED, CANCEL_SAMPLE_EVERY = 100, 150, 10


def _cancel_cycles(server) -> None:
    """200+ streams each cancelled mid-generation: no KV page stays taken, and memory stays flat once warm.

    Why the warm-up: the stub's RSS rises by ~50-65 MiB over the first ~80 cycles (allocator arenas, oneDNN and
    gRPC buffers touched by the first requests; measured every 20 cycles over 400: 344, 391, 395, 400, 408,
    then 408.5-409.7 to cycle 380), which is what failed a CI run that took its baseline before the first
    request (407 -> 472 MiB). After the warm-up a leak grows the stub a little at every request: the median of the
    rises between successive samples (every 10 cycles) must stay under 16 MiB over the 15 intervals, which catches a
    leak of >= ~110 KiB per cancelled request; the median, because a one-time step is not a leak (a clean-clone CI
    run saw 457 -> 460 MiB, one 22 MiB step at cycle ~200, then 482.37-482.38 MiB to the end: an allocator arena or
    a thread's buffers touched once). A lump that large must still stay under 64 MiB in all."""
    url, m = server.grpc_url, "qwen3_a8w8"
    total = CANCEL_WARMUP + CANCEL_MEASURED
    rss: dict[int, float] = {}
    t0 = time.time()
    for i in range(total + 1):
        if i >= CANCEL_WARMUP and (i - CANCEL_WARMUP) % CANCEL_SAMPLE_EVERY == 0:
            rss[i] = server.rss_mib(m)
        if i == total:
            break
        client = grpcclient.InferenceServerClient(url)
        got: queue.Queue = queue.Queue()
        client.start_stream(callback=lambda result, error: got.put((result, error)))
        client.async_stream_infer(m, build_inputs(f"{PROMPT} {i}", max_tokens=900, **GREEDY))
        r, e = got.get(timeout=60)
        assert e is None
        client.stop_stream(cancel_requests=True)
        client.close()
    assert _wait_pages_free(server, m, 5), "pages still in use after the cancel cycles"
    cancelled = server.finished_total(m, "cancelled")
    base = rss[CANCEL_WARMUP]
    last_third = [v for i, v in rss.items() if i >= total - CANCEL_MEASURED // 3]
    FIGURES["cancel_cycles"] = {"cycles": total, "seconds": round(time.time() - t0, 1), "cancelled_total": cancelled,
                                "stub_rss_mib_after_warmup": round(base, 1),
                                "stub_rss_mib_samples": [round(v, 1) for v in rss.values()]}
    assert cancelled >= total
    samples = list(rss.values())
    rises = sorted(b - a for a, b in zip(samples, samples[1:]))
    per_interval = rises[len(rises) // 2]
    seen = f"{base:.0f} -> {[round(v) for v in samples]} MiB"
    assert per_interval * len(rises) < 16, (
        f"memory grows at every sample after the {CANCEL_WARMUP}-cycle warm-up: {seen}")
    assert min(last_third) - base < 64, f"memory grew after the {CANCEL_WARMUP}-cycle warm-up: {seen}"


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
    """64 streams at once, round after round for a bounded time (QWEN3_SOAK_SECONDS, default 60) and at least
    15 rounds: every stream equals its solo greedy run, and the stub's memory stays flat once the first rounds
    have warmed it up.

    Why 60 s: a round of 64 streams takes ~2.2-2.4 s on the 2-core CI host (~25 rounds, ~1,600 requests). The
    memory check compares the middle third's highest sample with the last third's lowest, so its power (a leak of
    >= ~16 MiB a round) does not grow with more rounds; what it needs is the warm-up over before the last third
    (the stub's RSS rose for 5 rounds in a 180 s run, for 7 in a 60 s one, then stayed within 1.3 MiB), which
    the 15 rounds' minimum keeps however slow the host (the last third starts at round 11). A longer soak only
    gives a rare race more requests to hit: QWEN3_SOAK_SECONDS=1800, or bench.soak."""
    import os

    budget = float(os.environ.get("QWEN3_SOAK_SECONDS", "60"))
    min_rounds = 15
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
    while rounds < min_rounds or time.time() - t_start < budget:
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
    # The first third warms the allocator up; after that memory must stay flat. Samples swing by up to ~60 MiB
    # between rounds (glibc arenas taken and returned by the gRPC and engine threads; a CI run saw 551..609 MiB
    # with no trend), so a median of three samples is noise. A leak lifts the floor: every sample of the last
    # third must not sit above the whole middle third. That catches a leak of >= ~15 MiB per round of 64
    # requests (~240 KiB per request) whatever the number of rounds; smaller ones are below this signal's noise.
    third = max(1, len(rss) // 3)
    mid_rss, end_rss = statistics.median(rss[third:2 * third]), statistics.median(rss[2 * third:])
    mid_ceiling, end_floor = max(rss[third:2 * third]), min(rss[2 * third:])
    q = statistics.quantiles(gaps, n=100)
    FIGURES["soak"] = {"rounds": rounds, "concurrent_streams": 64, "requests": requests, "tokens_checked": tokens,
                       "errors": errors, "mismatched_streams": mismatches,
                       "itl_p50_ms": round(q[49] * 1000, 2), "itl_p99_ms": round(q[98] * 1000, 2),
                       "seconds": round(time.time() - t_start, 1), "stub_rss_mib_first_round": round(rss[0], 1),
                       "stub_rss_mib_middle_third_median": round(mid_rss, 1),
                       "stub_rss_mib_last_third_median": round(end_rss, 1)}
    print("\nsoak: " + json.dumps(FIGURES["soak"]) + f"\nsoak rss per round: {[round(r, 1) for r in rss]}")
    assert errors == 0 and mismatches == 0 and rounds >= min_rounds
    assert end_floor - mid_ceiling < 16, f"memory kept growing during the soak: {rss}"


def test_sigterm_with_streams_in_flight_ends_every_stream_and_exits_promptly(tmp_path_factory, a8w8_ckpt, bf16_ckpt):
    """SIGTERM to the server alone (as `docker stop` / Kubernetes send it) with 16 streams generating: each
    stream gets its final response (finish_reason 'abort') at once, the server exits inside 10 s and leaves
    no stub process behind. Half the clients close their stream after the final response, as they should;
    the other half keep it open, which keeps Triton 2.51 from unloading until its exit timeout (5 s by the
    project's `tritonserver`, which kills a server still running 3 s later: 2.51 cannot finish exiting then).

    Run as in the container image: the launcher finds a real server binary on PATH and passes everything
    through (system_server), with the log flags a deployment uses (a log file, ISO8601, verbose), which
    the models' own log lines must follow."""
    from harness.triton_server import TritonServer, make_repository

    root = tmp_path_factory.mktemp("shutdown")
    repo = make_repository(root / "models", {
        # long streams (4,000 tokens), so that a fast host is still generating every one of them at the signal
        "qwen3_a8w8": {**SERVER_ENGINE, "checkpoint": str(a8w8_ckpt), "max_model_len": "4096"},
        "qwen3_tq": {**SERVER_ENGINE, "checkpoint": str(bf16_ckpt), "max_model_len": "4096"},
        "qwen3_tokenizer": {"checkpoint": str(bf16_ckpt)}})
    log_file = root / "triton-log-file.txt"
    srv = TritonServer(repo, root / "tritonserver.log", system_server=True,
                       extra_args=[f"--log-file={log_file}", "--log-format=ISO8601", "--log-verbose=1"]).start()
    try:
        ends: queue.Queue = queue.Queue()
        clients = []
        for i in range(16):
            client = grpcclient.InferenceServerClient(srv.grpc_url)
            first = threading.Event()

            def callback(result, error, i=i, first=first):
                if error is not None:
                    ends.put((i, f"error: {error}", time.time()))
                elif is_final(result):
                    reason = result.as_numpy("finish_reason")
                    ends.put((i, reason[0].decode() if reason is not None and reason.size else "", time.time()))
                    if i % 2 == 0:   # a well-behaved client closes its stream once it has the final response
                        threading.Thread(target=clients[i][0].stop_stream, daemon=True).start()
                else:
                    first.set()
            client.start_stream(callback=callback)
            client.async_stream_infer("qwen3_a8w8" if i % 2 else "qwen3_tq",
                                      build_inputs(f"{PROMPT} {i}", max_tokens=4000, return_finish_reason=True,
                                                   **GREEDY), enable_empty_final_response=True)
            clients.append((client, first))
        assert all(first.wait(60) for _, first in clients), "not every stream started"
        stubs = srv.stub_pids()
        assert len(stubs) == 4
        t0 = time.time()
        exit_s = srv.terminate(timeout=60)
        finals = [ends.get(timeout=10) for _ in range(16)]
        time.sleep(0.5)
        srv.wait_until(lambda: not any(os.path.exists(f"/proc/{p}") for p in stubs), 3)
        left = [p for p in stubs if os.path.exists(f"/proc/{p}")]
        FIGURES["sigterm_under_load"] = {"streams": 16, "exit_s": round(exit_s, 1), "stubs_left": len(left),
                                         "last_final_after_s": round(max(t for _, _, t in finals) - t0, 2)}
        # every stream still in flight at the SIGTERM ends as aborted; on a fast host a stream that started
        # first can finish its tokens while the last ones are still waiting for their first token
        # (or in the moment the signal takes to arrive): those end with their length, the rest aborted
        # (a host under load can take a while to act on the stop flag: a stream that ran to its length before the
        # first abort went out had finished before the drain)
        # (16 connections deliver in their own threads: allow a moment around the first abort)
        first_abort = min((t for _, r, t in finals if r == "abort"), default=t0)
        assert all(r == "abort" or (r == "length" and t <= first_abort + 0.25) for _, r, t in finals), finals
        assert sum(r == "abort" for _, r, _ in finals) >= 8, finals
        assert max(t for _, _, t in finals) - t0 < 5
        assert exit_s < 10, srv.log_tail(40)
        assert not left, f"stub processes left behind: {left}"
        for client, _ in clients:
            client.close()
        # the models' lines are in Triton's log file, in its ISO8601 format, verbose ones included
        lines = log_file.read_text(errors="replace").splitlines()
        iso = r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ [IWEV] +\d+ \S+:\d+\] "
        for text in ("qwen3_a8w8: ready", "qwen3_tq: engine configuration EngineConfig(",
                     "qwen3_a8w8: the server is stopping; aborting the requests in flight"):
            assert any(re.match(iso, line) and text in line for line in lines), (text, lines[-40:])
        assert "qwen3_a8w8: ready" not in srv.log_path.read_text(errors="replace")   # not on stdout
    finally:
        srv.stop()


def test_sigterm_to_a_model_process_ends_its_streams_and_the_process(tmp_path_factory, a8w8_ckpt):
    """A supervisor that signals the whole process group (systemd's default) reaches the model processes too.
    The Python backend's stub ignores SIGTERM; the model's watch thread sees it (wakeup fd), ends its streams
    with finish_reason 'abort' at once, and the process exits within a few seconds instead of staying
    behind with its memory."""
    from backend_lib.serving.lifecycle import SIGTERM_GRACE_S
    from harness.triton_server import TritonServer, make_repository

    root = tmp_path_factory.mktemp("stub-sigterm")
    repo = make_repository(root / "models", {"qwen3_a8w8": {**SERVER_ENGINE, "checkpoint": str(a8w8_ckpt),
                                                            "max_model_len": "4096"}})
    srv = TritonServer(repo, root / "tritonserver.log").start()
    try:
        result: dict = {}
        t = threading.Thread(target=lambda: result.update(stream_generate(
            srv.grpc_url, "qwen3_a8w8", PROMPT, max_tokens=4000, **GREEDY)))
        t.start()
        assert srv.wait_until(lambda: srv.metric("vllm:kv_cache_pages_used", "qwen3_a8w8") > 0, 30)
        pid = srv.stub_pid("qwen3_a8w8")
        t0 = time.time()
        os.kill(pid, signal.SIGTERM)
        t.join(30)
        assert result.get("finish_reason") == "abort" and len(result["output_ids"]) < 4000, result
        assert time.time() - t0 < SIGTERM_GRACE_S
        assert srv.wait_until(lambda: not os.path.exists(f"/proc/{pid}") or
                              open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] == "Z",
                              SIGTERM_GRACE_S + 3), "the model process did not exit after SIGTERM"
        FIGURES["stub_sigterm_exit_s"] = round(time.time() - t0, 2)
    finally:
        srv.stop()


_FUZZ_VALUE = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.floats(allow_nan=False),
                        st.floats(min_value=-1e-300, max_value=1e-300), st.text(max_size=4),
                        st.lists(st.integers(-5, 200000), max_size=3))
_FUZZ_KEYS = ("max_tokens", "min_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty",
              "frequency_penalty", "repetition_penalty", "logprobs", "stop", "stop_token_ids", "ignore_eos", "n",
              "best_of", "logit_bias", "bogus_key")


def test_fuzzed_requests_beside_reference_streams_get_an_answer_or_an_error_naming_a_field(server):
    """Random sampling_parameters (extremes, wrong types, huge numbers) and scalar tensors, sent while two
    greedy reference streams run: the references keep their exact ids, each odd request gets a normal
    answer or one INVALID_ARG naming a field it sent, never an internal error, and the server stays up."""
    m = "qwen3_a8w8"
    refs = [(f"{PROMPT} reference {i}", 160) for i in range(2)]
    expected = [collect(server.grpc_url, m, prompt=p, max_tokens=n, **GREEDY) for p, n in refs]
    results: dict = {}
    runners = [threading.Thread(target=lambda i=i, p=p, n=n: results.__setitem__(
        i, collect(server.grpc_url, m, prompt=p, max_tokens=n, **GREEDY))) for i, (p, n) in enumerate(refs)]
    for t in runners:
        t.start()
    outcomes = {"answered": 0, "rejected": 0}

    @settings(max_examples=int(os.environ.get("QWEN3_FUZZ_EXAMPLES", "30")), deadline=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(sampling=st.dictionaries(st.sampled_from(_FUZZ_KEYS), _FUZZ_VALUE, max_size=4),
           temperature=st.one_of(st.none(), st.floats(width=32, allow_nan=True)),
           top_k=st.one_of(st.none(), st.integers(-2**31, 2**31 - 1)),
           stop=st.one_of(st.none(), st.lists(st.text(max_size=3), max_size=3)))
    def one(sampling, temperature, top_k, stop):
        sampling.setdefault("max_tokens", 3)
        try:
            body = json.dumps(sampling)
        except (TypeError, ValueError):
            return
        inputs = build_inputs(PROMPT, sampling_parameters=None, stop_words=stop or None, temperature=temperature,
                              top_k=top_k)
        inputs.append(tensor("sampling_parameters", np.array([body.encode()], dtype=np.object_), "BYTES"))
        res = collect(server.grpc_url, m, raw_inputs=inputs, timeout=60)
        if res[-1][0] == "ERROR":
            message = res[-1][1]
            sent = set(sampling) | {"sampling_parameters", "stop", "stop_words"} | \
                ({"temperature"} if temperature is not None else set()) | ({"top_k"} if top_k is not None else set())
            assert "INVALID_ARG" in message or any(k in message for k in sent), message
            assert not any(w in message for w in ("internal error", "engine step failed", "Traceback")), message
            assert any(k in message for k in sent), f"error names no field it was sent: {message}"
            outcomes["rejected"] += 1
        else:
            assert res[-1][2], "no final response"
            outcomes["answered"] += 1

    one()
    for t in runners:
        t.join(300)
    assert [results[i] for i in range(len(refs))] == expected, "a reference stream changed its tokens"
    assert server.proc.poll() is None
    FIGURES["fuzz_beside_references"] = outcomes
