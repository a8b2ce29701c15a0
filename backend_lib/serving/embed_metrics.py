"""The embedding and rerank models' metrics on Triton's metrics port, in vLLM's names (as its pooling models
count): vllm:prompt_tokens_total (tokens embedded or scored) and vllm:request_success_total{finished_reason}
(stop: answered, error: refused or failed), labels {model, version}. Triton's own nv_inference_* count the
requests and batches besides.

As the LLM models' (metrics.py), no metric call is made on a request's path: execute only adds to counters under
a lock; one thread publishes them every FLUSH_PERIOD_S.
"""
from __future__ import annotations

import threading

from .log import get_logger
from .metrics import FLUSH_PERIOD_S

log = get_logger()


class EmbedMetrics:
    def __init__(self, pb_utils, labels: dict[str, str]):
        M = pb_utils.MetricFamily
        self._families = [M(name="vllm:prompt_tokens_total", description="Prompt tokens of admitted requests",
                            kind=M.COUNTER),
                          M(name="vllm:request_success_total", description="Finished requests by finish reason",
                            kind=M.COUNTER)]
        self._tokens = self._families[0].Metric(labels=labels)
        self._ok = self._families[1].Metric(labels={**labels, "finished_reason": "stop"})
        self._failed = self._families[1].Metric(labels={**labels, "finished_reason": "error"})
        self._lock = threading.Lock()
        self._pending = [0, 0, 0]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="embed-metrics", daemon=True)
        self._thread.start()

    def record(self, tokens: int, answered: int, failed: int) -> None:
        with self._lock:
            self._pending[0] += tokens
            self._pending[1] += answered
            self._pending[2] += failed

    def flush(self) -> None:
        with self._lock:
            tokens, ok, failed = self._pending
            self._pending = [0, 0, 0]
        for metric, value in ((self._tokens, tokens), (self._ok, ok), (self._failed, failed)):
            if value:
                metric.increment(value)

    def _run(self) -> None:
        while not self._stop.wait(FLUSH_PERIOD_S):
            try:
                self.flush()
            except Exception:   # a metrics call failing (the server stopping) never ends serving
                log.debug("embedding metrics flush failed", exc_info=True)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=1.0)
