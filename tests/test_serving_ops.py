"""Triton-native operations of the LLM model, in-process against a stand-in for triton_python_backend_utils:
logs through pb_utils.Logger by level, the vllm_backend metric set with exact per-request observations, and
what a model whose engine died does (fails every request at once with UNAVAILABLE, unloads itself, tells
the launcher)."""
from __future__ import annotations

import json
import logging
import sys
import threading
import time
import types

import numpy as np
import pytest

from backend_lib.serving import log as serving_log
from helpers import SERVER_ENGINE

FINAL = 1


class FakeMetric:
    def __init__(self, family, labels, buckets=None):
        self.family, self.labels, self.buckets = family, labels, buckets
        self.value, self.observed = 0.0, []
        family.metrics.append(self)

    def set(self, v):
        self.value = v

    def increment(self, v):
        self.value += v

    def observe(self, v):
        self.observed.append(v)


class FakeFamily:
    GAUGE, COUNTER, HISTOGRAM = "gauge", "counter", "histogram"

    def __init__(self, name, description, kind):
        self.name, self.kind, self.metrics = name, kind, []
        FakePb.families[name] = self

    def Metric(self, labels, buckets=None):  # noqa: N802 (pb_utils' name)
        return FakeMetric(self, labels, buckets)


class FakeError:
    INVALID_ARG, UNAVAILABLE, INTERNAL = "INVALID_ARG", "UNAVAILABLE", "INTERNAL"

    def __init__(self, message, code):
        self.message, self.code = message, code


class FakeLogger:
    lines: list = []

    @classmethod
    def log_verbose(cls, m):
        cls.lines.append(("verbose", m))

    @classmethod
    def log_info(cls, m):
        cls.lines.append(("info", m))

    @classmethod
    def log_warn(cls, m):
        cls.lines.append(("warn", m))

    @classmethod
    def log_error(cls, m):
        cls.lines.append(("error", m))


class FakePb(types.ModuleType):
    families: dict = {}

    def __init__(self):
        super().__init__("triton_python_backend_utils")
        self.MetricFamily, self.TritonError, self.Logger = FakeFamily, FakeError, FakeLogger
        self.TRITONSERVER_RESPONSE_COMPLETE_FINAL = FINAL
        self.TritonModelException = RuntimeError
        self.unloaded: list[str] = []
        FakePb.families = {}
        FakeLogger.lines = []

    def unload_model(self, name):
        self.unloaded.append(name)

    @staticmethod
    def using_decoupled_model_transaction_policy(cfg):
        return cfg["model_transaction_policy"]["decoupled"]

    @staticmethod
    def get_input_tensor_by_name(request, name):
        arr = request.arrays.get(name)
        return None if arr is None else types.SimpleNamespace(as_numpy=lambda: arr)

    @staticmethod
    def Tensor(name, arr):  # noqa: N802
        return (name, arr)

    @staticmethod
    def InferenceResponse(output_tensors, error=None):  # noqa: N802
        return {"outputs": dict(output_tensors), "error": error}


class Sender:
    def __init__(self):
        self.responses, self.done = [], threading.Event()

    def send(self, response=None, flags=0):
        self.responses.append(response)
        if flags & FINAL:
            self.done.set()

    def is_cancelled(self):
        return False


class Request:
    def __init__(self, **inputs):
        self.arrays, self.sender = inputs, Sender()

    def inputs(self):
        return [types.SimpleNamespace(name=lambda n=n: n, as_numpy=lambda a=a: a) for n, a in self.arrays.items()]

    def get_response_sender(self):
        return self.sender

    def request_id(self):
        return ""

    def parameters(self):
        return "{}"


def llm_request(ids, max_tokens):
    return Request(input_ids=np.array(ids, dtype=np.int32), max_tokens=np.array([max_tokens], dtype=np.int32),
                   sampling_parameters=np.array([json.dumps({"temperature": 0, "ignore_eos": True}).encode()],
                                                dtype=object))


@pytest.fixture
def pb(monkeypatch):
    fake = FakePb()
    monkeypatch.setitem(sys.modules, "triton_python_backend_utils", fake)
    root = logging.getLogger(serving_log.ROOT)
    saved = (list(root.handlers), root.level, root.propagate, threading.excepthook)
    root.handlers = [h for h in root.handlers if not getattr(h, "_qwen3", False)]
    yield fake
    root.handlers, root.level, root.propagate, threading.excepthook = saved[0], saved[1], saved[2], saved[3]


@pytest.fixture
def model(pb, a8w8_ckpt, tmp_path, monkeypatch):
    from backend_lib.serving.triton_llm import TritonLLMModel

    dead_file = tmp_path / "engine-dead"
    monkeypatch.setenv("QWEN3_ENGINE_DEAD", str(dead_file))
    params = {**SERVER_ENGINE, "checkpoint": str(a8w8_ckpt)}
    cfg = {"parameters": {k: {"string_value": v} for k, v in params.items()},
           "model_transaction_policy": {"decoupled": True}}
    m = TritonLLMModel()
    m.initialize({"model_name": "qwen3_test", "model_config": json.dumps(cfg), "model_repository": str(tmp_path),
                  "model_version": "1", "model_instance_kind": "CPU"})
    m.dead_file = dead_file
    yield m
    m.finalize()


def test_records_go_to_tritons_logger_by_level_and_a_dying_thread_is_logged(pb):
    serving_log.setup(pb)
    log = logging.getLogger("backend_lib.engine.somewhere")
    log.debug("d %d", 1)
    log.info("i")
    log.warning("w")
    try:
        raise ValueError("boom")
    except ValueError:
        log.exception("e")
    t = threading.Thread(target=lambda: 1 / 0, name="doomed")
    t.start()
    t.join()
    lines = FakeLogger.lines
    assert lines[:3] == [("verbose", "d 1"), ("info", "i"), ("warn", "w")]
    assert lines[3][0] == "error" and lines[3][1].startswith("e\nTraceback") and "ValueError: boom" in lines[3][1]
    assert lines[4][0] == "error" and lines[4][1].startswith("thread doomed died") and "ZeroDivisionError" in lines[4][1]
    serving_log.setup(pb)                 # idempotent: one handler
    logging.getLogger("backend_lib").info("once")
    assert FakeLogger.lines.count(("info", "once")) == 1


def test_an_unknown_log_level_is_an_error_naming_the_variable(pb, monkeypatch):
    monkeypatch.setenv("QWEN3_LOG_LEVEL", "LOUD")
    with pytest.raises(ValueError, match=r"^\$QWEN3_LOG_LEVEL: 'LOUD' is not a logging level"):
        serving_log.setup(pb)


def test_the_vllm_backend_metric_set_with_exact_per_request_observations(model, pb):
    req = llm_request([9707, 11, 1879, 0, 2585], 6)
    model.execute([req])
    assert req.sender.done.wait(60)
    time.sleep(0.3)   # a flush period
    fam = pb.families
    for name in ("vllm:prompt_tokens_total", "vllm:generation_tokens_total", "vllm:time_to_first_token_seconds",
                 "vllm:time_per_output_token_seconds", "vllm:e2e_request_latency_seconds",
                 "vllm:request_prompt_tokens", "vllm:request_generation_tokens", "vllm:request_params_n",
                 "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "vllm:request_success_total", "vllm:inter_token_latency_seconds"):
        assert name in fam, name
    one = {n: f.metrics[0] for n, f in fam.items() if len(f.metrics) == 1}
    assert one["vllm:request_prompt_tokens"].observed == [5]
    assert one["vllm:request_generation_tokens"].observed == [6]
    assert one["vllm:request_params_n"].observed == [1]
    assert len(one["vllm:time_per_output_token_seconds"].observed) == 5
    assert one["vllm:time_per_output_token_seconds"].observed == one["vllm:inter_token_latency_seconds"].observed
    (e2e,) = one["vllm:e2e_request_latency_seconds"].observed
    assert e2e >= one["vllm:time_to_first_token_seconds"].observed[0] + sum(one["vllm:inter_token_latency_seconds"].observed) - 1e-6
    assert one["vllm:request_prompt_tokens"].buckets[:4] == [1, 2, 5, 10] and \
        one["vllm:request_prompt_tokens"].buckets[-1] <= int(SERVER_ENGINE["max_model_len"])
    reasons = {m.labels["finished_reason"]: m.value for m in fam["vllm:request_success_total"].metrics}
    assert reasons == {"stop": 0, "length": 1, "abort": 0, "cancelled": 0, "error": 0}
    assert all(m.labels["model"] == "qwen3_test" and m.labels["version"] == "1"
               for f in fam.values() for m in f.metrics)


class Die(BaseException):
    """Escapes the engine loop's `except Exception`: the engine thread dies."""


def test_a_dead_engine_fails_requests_at_once_unloads_the_model_and_tells_the_launcher(model, pb, monkeypatch):
    monkeypatch.setattr(model.loop.engine, "step", lambda: (_ for _ in ()).throw(Die("engine thread killed")))
    open_request = llm_request([1, 2, 3], 50)
    model.execute([open_request])
    assert open_request.sender.done.wait(5)                          # the in-flight request is answered
    (resp,) = open_request.sender.responses
    assert resp["error"].code == "UNAVAILABLE" and "qwen3_test: the engine has stopped" in resp["error"].message
    deadline = time.time() + 5
    while not pb.unloaded and time.time() < deadline:
        time.sleep(0.05)
    assert pb.unloaded == ["qwen3_test"]
    assert model.dead_file.read_text() == "model qwen3_test: the engine has died\n"
    t0 = time.time()
    late = llm_request([1, 2, 3], 5)
    model.execute([late])
    assert late.sender.done.is_set() and time.time() - t0 < 0.5        # refused at once, not queued
    assert late.sender.responses[0]["error"].code == "UNAVAILABLE"
    assert any(level == "error" and "engine thread has died" in m for level, m in FakeLogger.lines)
    assert any(level == "error" and "Die: engine thread killed" in m for level, m in FakeLogger.lines)


def test_slow_cancellation_sweeps_never_starve_the_responses_behind_them():
    """The response thread handles one queued output, then sweeps when the pacer says so. A sweep that takes
    longer than CANCEL_SWEEP_S (many open requests, a loaded host: one server round trip each) once made it sweep
    after every single output, so 1 output per sweep went out and an abort's final response waited behind
    thousands (the disconnect storm's fallback). Paced, sweeps take at most 1 / (1 + SWEEP_SPACING) of the thread
    however long they are (a virtual clock: 1 ms an output)."""
    from backend_lib.serving.triton_llm import SWEEP_SPACING, SweepPacer

    for sweep_s in (0.01, 0.25, 2.0):
        pacer, now, outputs, sweeping = SweepPacer(), 0.0, 0, 0.0
        while now < 120.0:
            now += 0.001
            outputs += 1
            if pacer.due(now):
                pacer.swept(now, now + sweep_s)
                now += sweep_s
                sweeping += sweep_s
        assert sweeping / now <= 1 / (1 + SWEEP_SPACING) + 0.01, (sweep_s, sweeping / now)
        assert outputs >= 0.79 * now / 0.001, (sweep_s, outputs)   # the old pacing: 120 s / sweep_s outputs
