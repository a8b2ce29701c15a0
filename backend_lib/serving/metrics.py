"""vLLM-style custom metrics on Triton's metrics port (pb_utils.MetricFamily).

The names, kinds, labels ({model, version}) and buckets follow triton-inference-server/vllm_backend
(src/utils/metrics.py): vllm:prompt_tokens_total, vllm:generation_tokens_total,
vllm:time_to_first_token_seconds, vllm:time_per_output_token_seconds (each interval between two tokens
of a request, as vllm_backend observes it), vllm:e2e_request_latency_seconds,
vllm:request_prompt_tokens, vllm:request_generation_tokens and vllm:request_params_n; plus vLLM's
scheduler gauges (vllm:num_requests_running / _waiting, vllm:kv_cache_usage_perc), its
vllm:inter_token_latency_seconds, vllm:request_success_total{finished_reason} (every reason listed
from the start: stop, length, abort, cancelled, error) and the prefix-cache counters; with speculative
decoding on, vLLM's spec_decode counters (vllm:spec_decode_num_drafts_total, _num_draft_tokens_total,
_num_accepted_tokens_total and _num_accepted_tokens_per_pos_total{position}: the names under which vLLM's
Prometheus exposition shows its vllm:spec_decode_num_* counters).

Every metric update is a call into the server process. None is made on a request's path: the
threads that serve requests only record into a MetricsBuffer (a lock and a list append), and one
metrics thread flushes it to Triton every FLUSH_PERIOD_S together with the engine's gauges. So a
metrics call that stalls (as they can while the server shuts down) delays only other metrics, never a
response, and per-token serving pays no call into the server.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass

from ..contract.finish import FinishReason
from .log import get_logger

TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0]
ITL_BUCKETS = [0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
               2.5, 5.0]
TPOT_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5]   # vllm_backend's
E2E_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
               480.0, 960.0, 1920.0, 7680.0]                                                     # vLLM's
N_BUCKETS = [1, 2, 5, 10, 20]
FINISH_REASONS = (FinishReason.STOP, FinishReason.LENGTH, FinishReason.ABORT, FinishReason.CANCELLED,
                  FinishReason.ERROR)
FLUSH_PERIOD_S = 0.1
OTHER_LORA = "other"          # the lora_name label of every adapter registered at run time
MAX_LORA_INFO_SERIES = 64     # vllm:lora_requests_info series kept (the oldest combination dropped first)


def buckets_1_2_5(limit: int) -> list[float]:
    """1, 2, 5, 10, 20, 50, ... up to `limit` (vLLM's build_1_2_5_buckets, for token-count histograms)."""
    out, exp = [], 0
    while True:
        for m in (1, 2, 5):
            v = m * 10 ** exp
            if v > limit:
                return out
            out.append(float(v))
        exp += 1


@dataclass(frozen=True)
class FinishedRequest:
    reason: str
    e2e_s: float
    prompt_tokens: int
    generation_tokens: int
    lora_name: str | None = None     # its LoRA adapter (counted in vllm:lora_requests_total), None: the base
log = get_logger()


class MetricsBuffer:
    """What happened since the last flush; written by any thread."""

    def __init__(self):
        self._lock = threading.Lock()
        self._reset()

    def _reset(self):
        self.prompt_tokens = self.generation_tokens = 0
        self.ttft: list[float] = []
        self.itl: list[float] = []
        self.finished: list[FinishedRequest] = []

    def record(self, prompt_tokens: int = 0, generation_tokens: int = 0, ttft: float | None = None,
               itl: float | None = None, finished: FinishedRequest | None = None) -> None:
        with self._lock:
            self.prompt_tokens += prompt_tokens
            self.generation_tokens += generation_tokens
            if ttft is not None:
                self.ttft.append(ttft)
            if itl is not None:
                self.itl.append(itl)
            if finished is not None:
                self.finished.append(finished)

    def take(self) -> "MetricsBuffer":
        """The updates so far (a detached copy); the buffer starts empty again."""
        out = MetricsBuffer()
        with self._lock:
            out.prompt_tokens, out.generation_tokens = self.prompt_tokens, self.generation_tokens
            out.ttft, out.itl, out.finished = self.ttft, self.itl, self.finished
            self._reset()
        return out


class EngineMetrics:
    def __init__(self, pb_utils, labels: dict[str, str], max_model_len: int, max_loras: int | None = None,
                 configured_loras=frozenset(), spec_positions: int | None = None):
        """max_loras: LoRA on (vllm:lora_requests_info is published); None: off. configured_loras: the adapter
        names of the configuration, the only ones that become label values: a name registered at run time (any
        client's string) is counted as OTHER_LORA, so the series stay bounded however many names clients send.
        spec_positions: speculative decoding on with that num_speculative_tokens (the spec_decode counters are
        published); None: off."""
        M = pb_utils.MetricFamily
        self._families = []  # a MetricFamily must outlive its Metric objects

        def fam(name, desc, kind):
            family = M(name=name, description=desc, kind=kind)
            self._families.append(family)
            return family

        self.running = fam("vllm:num_requests_running", "Requests in the running batch", M.GAUGE).Metric(labels=labels)
        self.waiting = fam("vllm:num_requests_waiting", "Requests waiting to be scheduled", M.GAUGE).Metric(
            labels=labels)
        self.pages_used = fam("vllm:kv_cache_pages_used", "KV-cache pages in use", M.GAUGE).Metric(labels=labels)
        self.pages_total = fam("vllm:kv_cache_pages_total", "KV-cache pages in the pool", M.GAUGE).Metric(
            labels=labels)
        self.usage = fam("vllm:kv_cache_usage_perc", "KV-cache usage, 0 to 1", M.GAUGE).Metric(labels=labels)
        self.pages_cached = fam("vllm:kv_cache_pages_cached", "Full KV pages held in the prefix cache",
                                M.GAUGE).Metric(labels=labels)
        self.prefix_queries = fam("vllm:prefix_cache_queries_total", "Prompt tokens looked up in the prefix cache",
                                  M.COUNTER).Metric(labels=labels)
        self.prefix_hits = fam("vllm:prefix_cache_hits_total", "Prompt tokens found in the prefix cache",
                               M.COUNTER).Metric(labels=labels)
        self._published_queries = self._published_hits = 0
        self.prompt_tokens = fam("vllm:prompt_tokens_total", "Prompt tokens of admitted requests", M.COUNTER).Metric(
            labels=labels)
        self.generation_tokens = fam("vllm:generation_tokens_total", "Generated tokens", M.COUNTER).Metric(
            labels=labels)
        self._success = fam("vllm:request_success_total", "Finished requests by finish reason", M.COUNTER)
        self._labels = labels
        self._by_reason = {r: self._success.Metric(labels={**labels, "finished_reason": r}) for r in FINISH_REASONS}
        self.ttft = fam("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                        M.HISTOGRAM).Metric(labels=labels, buckets=TTFT_BUCKETS)
        self.tpot = fam("vllm:time_per_output_token_seconds", "Histogram of time per output token in seconds.",
                        M.HISTOGRAM).Metric(labels=labels, buckets=TPOT_BUCKETS)
        self.itl = fam("vllm:inter_token_latency_seconds", "Time between consecutive tokens of a request",
                       M.HISTOGRAM).Metric(labels=labels, buckets=ITL_BUCKETS)
        self.e2e = fam("vllm:e2e_request_latency_seconds", "Histogram of end to end request latency in seconds.",
                       M.HISTOGRAM).Metric(labels=labels, buckets=E2E_BUCKETS)
        token_buckets = buckets_1_2_5(max_model_len)
        self.request_prompt = fam("vllm:request_prompt_tokens", "Number of prefill tokens processed.",
                                  M.HISTOGRAM).Metric(labels=labels, buckets=token_buckets)
        self.request_generation = fam("vllm:request_generation_tokens", "Number of generation tokens processed.",
                                      M.HISTOGRAM).Metric(labels=labels, buckets=token_buckets)
        self.request_n = fam("vllm:request_params_n", "Histogram of the n request parameter.",
                             M.HISTOGRAM).Metric(labels=labels, buckets=N_BUCKETS)
        # vLLM's LoRA gauge: its labels name the adapters of the running and waiting requests, its value the time
        # they were last seen so (as vLLM's, the series with the latest value is the current state)
        self._max_loras = max_loras
        self._lora_info = None if max_loras is None else fam(
            "vllm:lora_requests_info", "Running stats on lora requests.", M.GAUGE)
        self._lora_series: dict[tuple, object] = {}
        self._lora_requests = None if max_loras is None else fam(
            "vllm:lora_requests_total", "Finished requests by LoRA adapter", M.COUNTER)
        self._lora_counts: dict[str, object] = {}
        self._configured_loras = frozenset(configured_loras)
        self._spec = None
        if spec_positions is not None:   # vLLM's spec_decode counters (EngineStats.spec_*)
            per_pos = fam("vllm:spec_decode_num_accepted_tokens_per_pos_total",
                          "Accepted tokens per draft position", M.COUNTER)
            self._spec = {
                "spec_num_drafts": fam("vllm:spec_decode_num_drafts_total", "Verifications with drafts",
                                       M.COUNTER).Metric(labels=labels),
                "spec_num_draft_tokens": fam("vllm:spec_decode_num_draft_tokens_total", "Draft tokens verified",
                                             M.COUNTER).Metric(labels=labels),
                "spec_num_accepted_tokens": fam("vllm:spec_decode_num_accepted_tokens_total",
                                                "Draft tokens accepted", M.COUNTER).Metric(labels=labels),
                "per_pos": [per_pos.Metric(labels={**labels, "position": str(i)}) for i in range(spec_positions)],
            }
            self._spec_published: dict[str, int] = {}

    def lora_label(self, name: str) -> str:
        return name if name in self._configured_loras else OTHER_LORA

    def _publish_spec(self, stats) -> None:
        """The engine's cumulative spec counters as counter increments since the last flush."""
        done = self._spec_published
        for key in ("spec_num_drafts", "spec_num_draft_tokens", "spec_num_accepted_tokens"):
            value = getattr(stats, key, 0)
            if value > done.get(key, 0):
                self._spec[key].increment(value - done.get(key, 0))
                done[key] = value
        for i, value in enumerate(getattr(stats, "spec_accepted_per_pos", ())[:len(self._spec["per_pos"])]):
            key = f"pos{i}"
            if value > done.get(key, 0):
                self._spec["per_pos"][i].increment(value - done.get(key, 0))
                done[key] = value

    def _finished(self, req: FinishedRequest) -> None:
        metric = self._by_reason.get(req.reason)
        if metric is None:    # a reason outside FINISH_REASONS still gets its series
            metric = self._by_reason[req.reason] = self._success.Metric(
                labels={**self._labels, "finished_reason": req.reason})
        metric.increment(1)
        self.e2e.observe(req.e2e_s)
        self.request_prompt.observe(req.prompt_tokens)
        self.request_generation.observe(req.generation_tokens)
        self.request_n.observe(1)    # each of n choices is an engine request of its own
        if req.lora_name is not None and self._lora_requests is not None:
            label = self.lora_label(req.lora_name)
            counter = self._lora_counts.get(label)
            if counter is None:
                counter = self._lora_counts[label] = self._lora_requests.Metric(
                    labels={**self._labels, "lora_name": label})
            counter.increment(1)

    def flush(self, updates: MetricsBuffer, stats) -> None:
        """Applies buffered updates and the engine's latest stats (calls into the server process)."""
        if updates.prompt_tokens:
            self.prompt_tokens.increment(updates.prompt_tokens)
        if updates.generation_tokens:
            self.generation_tokens.increment(updates.generation_tokens)
        for v in updates.ttft:
            self.ttft.observe(v)
        for v in updates.itl:
            self.itl.observe(v)
            self.tpot.observe(v)
        for req in updates.finished:
            self._finished(req)
        self.running.set(stats.running)
        self.waiting.set(stats.waiting)
        self.pages_used.set(stats.pages_used)
        self.pages_total.set(stats.pages_total)
        self.usage.set(stats.pages_used / stats.pages_total if stats.pages_total else 0.0)
        self.pages_cached.set(stats.pages_cached)
        if stats.prefix_cache_queries > self._published_queries:
            self.prefix_queries.increment(stats.prefix_cache_queries - self._published_queries)
            self._published_queries = stats.prefix_cache_queries
        if stats.prefix_cache_hits > self._published_hits:
            self.prefix_hits.increment(stats.prefix_cache_hits - self._published_hits)
            self._published_hits = stats.prefix_cache_hits
        if self._spec is not None:
            self._publish_spec(stats)
        if self._lora_info is not None:
            key = tuple(tuple(sorted({self.lora_label(n) for n in names})) for names in (stats.lora_running,
                                                                                         stats.lora_waiting))
            series = self._lora_series.get(key)
            if series is None:
                if len(self._lora_series) >= MAX_LORA_INFO_SERIES:   # the oldest combination's series goes
                    self._lora_series.pop(next(iter(self._lora_series)))
                series = self._lora_series[key] = self._lora_info.Metric(labels={
                    **self._labels, "max_lora": str(self._max_loras), "running_lora_adapters": ",".join(key[0]),
                    "waiting_lora_adapters": ",".join(key[1])})
            series.set(time.time())


class MetricsPublisher:
    """The metrics thread: flushes a MetricsBuffer and the engine stats every FLUSH_PERIOD_S, or at once
    when asked. flush(wait) lets a request's final response wait (briefly, bounded) until its counts are
    published, so a client that reads the metrics after its last response sees them."""

    def __init__(self, metrics: EngineMetrics, buffer: MetricsBuffer, stats, name: str):
        self.metrics, self.buffer, self.stats = metrics, buffer, stats
        self._cv = threading.Condition()
        self._requested = self._done = 0
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def flush(self, wait: float = 0.0) -> None:
        with self._cv:
            self._requested += 1
            target = self._requested
            self._cv.notify_all()
            if wait:
                self._cv.wait_for(lambda: self._done >= target or self._stopped, timeout=wait)

    def stop(self, timeout: float = 1.0) -> None:
        """No flush after this; waits (bounded: a call into a server that is going away can block for good)
        for a flush under way, so that no call is cut off half-way when the process exits."""
        with self._cv:
            self._stopped = True
            self._cv.notify_all()
        self._thread.join(timeout)

    def _run(self) -> None:
        while True:
            with self._cv:
                self._cv.wait_for(lambda: self._requested > self._done or self._stopped, timeout=FLUSH_PERIOD_S)
                if self._stopped:
                    return
                target = self._requested
            try:
                self.metrics.flush(self.buffer.take(), self.stats())
            except Exception:
                log.exception("metrics flush failed")
            with self._cv:
                self._done = max(self._done, target)
                self._cv.notify_all()
