"""deploy/grafana/qwen3-triton.json, the Grafana dashboard: its panels cover what an operator watches, every
query is per model (the `model` template variable), and every metric a query names is one the real tritonserver
exports (scraped from the `triton` fixture's metrics port after a request)."""
from __future__ import annotations

import re

import pytest

from dashboard_helpers import SPEC_PREFIX, dashboard, exported_sample_names, metric_names, queries, unexported


def test_the_metric_name_reader():
    assert metric_names('histogram_quantile(0.99, sum by (le, model) (rate(vllm:time_to_first_token_seconds_bucket'
                        '{model=~"$model"}[$__rate_interval])))') == {"vllm:time_to_first_token_seconds_bucket"}
    assert metric_names('sum by (model) (rate(a_total{x="b(c)"}[5m])) / on (model) group_left b_total offset 1h'
                        ' > 1e3') == {"a_total", "b_total"}
    assert metric_names("vllm:num_requests_running") == {"vllm:num_requests_running"}


def test_the_panels_cover_the_serving_signals_per_model():
    dash = dashboard()
    exprs = " ".join(e for _, e in queries(dash))
    for needed in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:prompt_tokens_total",
                   "vllm:generation_tokens_total", "vllm:time_to_first_token_seconds_bucket",
                   "vllm:time_per_output_token_seconds_bucket", "vllm:kv_cache_pages_used",
                   "vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total", "vllm:request_success_total",
                   "vllm:spec_decode_num_accepted_tokens_total", "vllm:spec_decode_num_draft_tokens_total",
                   "vllm:spec_decode_num_drafts_total", "vllm:spec_decode_num_accepted_tokens_per_pos_total"):
        assert needed in exprs, needed
    for quantile in ("0.5", "0.9", "0.99"):
        assert f"histogram_quantile({quantile}, sum by (le, model) (rate(vllm:time_to_first_token_seconds_bucket" \
            in exprs
    assert 'finished_reason=~"abort|cancelled"' in exprs
    (model,) = [v for v in dash["templating"]["list"] if v["name"] == "model"]
    assert model["multi"] and model["includeAll"]
    for where, expr in queries(dash):
        if where.startswith("panel"):
            assert 'model=~"$model"' in expr, where
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    for p in dash["panels"]:
        assert p["datasource"]["uid"] == "${datasource}", p["title"]


@pytest.mark.slow
@pytest.mark.server
def test_every_query_names_a_metric_the_server_exports(triton):
    from client.stream import stream_generate

    stream_generate(triton.grpc_url, "qwen3_a8w8", "Hello", max_tokens=4)   # every histogram has a sample
    assert triton.wait_until(lambda: 'vllm:time_to_first_token_seconds_count{model="qwen3_a8w8"' in triton.metrics(), 5)
    page = triton.metrics()
    exported = exported_sample_names(page)
    assert "vllm:time_to_first_token_seconds_bucket" in exported   # the page was read, histograms included
    # the speculative-decoding panel's counters exist only on a model with speculative_config: they are checked
    # against such a server in tests/test_speculative_server.py
    missing = {(where, n) for where, n in unexported(dashboard(), exported) if not n.startswith(SPEC_PREFIX)}
    assert not missing, sorted(missing)
    assert {where.split(" ", 1)[1].rsplit(" ", 1)[0] for where, n in unexported(dashboard(), exported)} \
        == {"'Speculative decoding: acceptance'"}
    for name in {n for _, e in queries(dashboard()) for n in metric_names(e) if not n.startswith(SPEC_PREFIX)}:
        for model in ("qwen3_a8w8", "qwen3_tq"):
            assert re.search(rf'^{re.escape(name)}\{{[^}}]*model="{model}"', page, re.M), (name, model)
    # the check is live: a panel with a misspelled metric is reported
    broken = dashboard()
    broken["panels"][0]["targets"][0]["expr"] = 'sum(vllm:num_request_running{model=~"$model"})'
    assert {name for _, name in unexported(broken, exported) if not name.startswith(SPEC_PREFIX)} \
        == {"vllm:num_request_running"}
