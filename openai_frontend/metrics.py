"""The front's /metrics (Prometheus text, what aiperf and Prometheus scrape on the API port): the front's own
request counters and latency histograms, then Triton's metrics (nv_* and the models' vllm:*), fetched from
Triton's metrics port at each scrape. When Triton's page cannot be had within TRITON_TIMEOUT_S, the front's
metrics come alone with a comment line saying why: a scrape never fails because of Triton.

- openai_frontend_requests_total{endpoint, method, status}: requests answered, by route (its path template, a
  mount's path, `other` for a path no route serves), HTTP method (one of METHODS, `other` for any other token a
  client sends: h11 takes any method, and a label value a client picks would be a new series for good) and HTTP
  status (499: the client went away first).
- openai_frontend_request_duration_seconds{endpoint}: from the request's arrival to its response's last byte
  (a stream's end).
- openai_frontend_time_to_first_token_seconds{endpoint}: streamed responses, from the request's arrival to the
  first event; the front starts a stream only once Triton's first response (the first token) has come.
"""
from __future__ import annotations

import asyncio
import time
import urllib.request

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4
from starlette.responses import Response

TRITON_METRICS_PORT = 8002
METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "DELETE", "OPTIONS", "PATCH"})   # the method label's values
TRITON_TIMEOUT_S = 1.0
DURATION_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0)


def default_triton_metrics_url(triton_url: str) -> str:
    """Triton's metrics page on the host of its gRPC endpoint (`host:port`), on Triton's default metrics port."""
    host = triton_url.split("://", 1)[-1].rsplit(":", 1)[0] if ":" in triton_url else triton_url
    return f"http://{host}:{TRITON_METRICS_PORT}/metrics"


def _fetch(url: str) -> str:
    with urllib.request.urlopen(url, timeout=TRITON_TIMEOUT_S) as r:
        return r.read().decode("utf-8", errors="replace")


class FrontMetrics:
    """The front's metrics (a registry of its own: several apps in one process never share counts), counted by
    CountRequests, and the /metrics response."""

    def __init__(self, triton_metrics_url: str | None):
        self.triton_metrics_url = triton_metrics_url or None
        self.registry = CollectorRegistry()
        self.requests = Counter("openai_frontend_requests", "HTTP requests answered by the OpenAI front",
                                ["endpoint", "method", "status"], registry=self.registry)
        self.duration = Histogram("openai_frontend_request_duration_seconds",
                                  "From a request's arrival to its response's last byte", ["endpoint"],
                                  buckets=DURATION_BUCKETS, registry=self.registry)
        self.ttft = Histogram("openai_frontend_time_to_first_token_seconds",
                              "Streamed responses: from the request's arrival to the first event (the first token)",
                              ["endpoint"], buckets=TTFT_BUCKETS, registry=self.registry)

    async def _triton(self) -> str:
        url = self.triton_metrics_url
        if url is None:
            return "# Triton metrics: not fetched (--triton-metrics-url is empty)\n"
        try:
            text = await asyncio.wait_for(asyncio.to_thread(_fetch, url), TRITON_TIMEOUT_S + 0.1)
        except Exception as exc:   # noqa: BLE001  (any failure: the front's metrics alone)
            reason = " ".join((str(exc) or type(exc).__name__).split())[:200]
            return f"# Triton metrics unavailable from {url}: {reason}\n"
        return text if text.endswith("\n") else text + "\n"

    async def response(self) -> Response:
        text = generate_latest(self.registry).decode() + await self._triton()
        return Response(text, media_type=CONTENT_TYPE_PLAIN_0_0_4)


class CountRequests:
    """ASGI middleware: every HTTP request counted and timed in `metrics` (pure ASGI, so that a stream is timed to
    its end). app.add_middleware(CountRequests, metrics=...)."""

    def __init__(self, app, metrics: FrontMetrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        start = time.perf_counter()
        status, stream, first = None, False, None

        async def sending(message):
            nonlocal status, stream, first
            if message["type"] == "http.response.start":
                status = message["status"]
                stream = dict(message.get("headers") or []).get(b"content-type", b"").startswith(b"text/event-stream")
            elif stream and first is None and message.get("body"):
                first = time.perf_counter()
            await send(message)

        try:
            await self.app(scope, receive, sending)
        finally:
            m = self.metrics
            # the route's path template; a mount's path (the playground's files); `other`: no route
            endpoint = getattr(scope.get("route"), "path", None) or scope.get("root_path") or "other"
            method = scope.get("method", "")
            m.requests.labels(endpoint, method if method in METHODS else "other", str(status or 500)).inc()
            m.duration.labels(endpoint).observe(time.perf_counter() - start)
            if first is not None:
                m.ttft.labels(endpoint).observe(first - start)
