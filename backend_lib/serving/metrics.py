"""vLLM-style custom metrics on Triton's metrics port (pb_utils.MetricFamily)."""
from __future__ import annotations

TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0]
ITL_BUCKETS = [0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
               2.5, 5.0]


class EngineMetrics:
    def __init__(self, pb_utils, labels: dict[str, str]):
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
        self.prompt_tokens = fam("vllm:prompt_tokens_total", "Prompt tokens of admitted requests", M.COUNTER).Metric(
            labels=labels)
        self.generation_tokens = fam("vllm:generation_tokens_total", "Generated tokens", M.COUNTER).Metric(
            labels=labels)
        self._success = fam("vllm:request_success_total", "Finished requests by finish reason", M.COUNTER)
        self._labels = labels
        self._by_reason: dict[str, object] = {}
        self.ttft = fam("vllm:time_to_first_token_seconds", "Time to first token", M.HISTOGRAM).Metric(
            labels=labels, buckets=TTFT_BUCKETS)
        self.itl = fam("vllm:inter_token_latency_seconds", "Time between consecutive tokens of a request",
                       M.HISTOGRAM).Metric(labels=labels, buckets=ITL_BUCKETS)

    def finished(self, reason: str) -> None:
        metric = self._by_reason.get(reason)
        if metric is None:
            metric = self._success.Metric(labels={**self._labels, "finished_reason": reason})
            self._by_reason[reason] = metric
        metric.increment(1)

    def update_gauges(self, running: int, waiting: int, pages_used: int, pages_total: int) -> None:
        self.running.set(running)
        self.waiting.set(waiting)
        self.pages_used.set(pages_used)
        self.pages_total.set(pages_total)
        self.usage.set(pages_used / pages_total if pages_total else 0.0)
