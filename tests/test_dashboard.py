"""deploy/grafana/qwen3-triton.json, the Grafana dashboard: its panels cover what an operator watches, every
query is per model (the `model` template variable), and every metric a query names is one the real tritonserver
exports (scraped from the `triton` fixture's metrics port after a request)."""
from __future__ import annotations

import json
import re

import pytest

from helpers import ROOT

DASHBOARD = ROOT / "deploy" / "grafana" / "qwen3-triton.json"

# PromQL words that are not metric names: aggregation/grouping keywords and binary operators. Functions and
# aggregations are recognised by the "(" after them.
_KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or", "unless",
             "offset", "atan2", "inf", "nan"}
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'')
_GROUPING = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)")
_IDENT = re.compile(r"[A-Za-z_:][A-Za-z0-9_:]*")


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects. A small reader, not a PromQL parser (none is on PyPI for
    Python without a Go toolchain): strings, label matchers ({...}), range and subquery brackets ([...]) and
    grouping label lists (by (...)) are removed, then every identifier not followed by "(" (a function or an
    aggregation) and not a keyword or a number is a metric name."""
    text = _STRING.sub('""', expr)
    text = re.sub(r"\{[^}]*\}", " ", text)
    text = re.sub(r"\[[^\]]*\]", " ", text)
    text = _GROUPING.sub(" ", text)
    names = set()
    for m in _IDENT.finditer(text):
        rest = text[m.end():].lstrip()
        if rest.startswith("(") or m.group().lower() in _KEYWORDS:
            continue
        if m.start() > 0 and (text[m.start() - 1].isdigit() or text[m.start() - 1] in ".$"):
            continue   # 1e3's "e3", a Grafana variable ($__rate_interval)
        names.add(m.group())
    return names


def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def queries(dash: dict) -> list[tuple[str, str]]:
    """(where, PromQL) of every panel target and every query template variable."""
    out = [(f"panel {p['title']!r} {t['refId']}", t["expr"]) for p in dash["panels"] for t in p.get("targets", [])]
    for var in dash["templating"]["list"]:
        if var["type"] == "query":
            q = var["query"]["query"] if isinstance(var["query"], dict) else var["query"]
            inner = re.fullmatch(r"label_values\((.*),\s*\w+\)", q)
            out.append((f"variable {var['name']}", inner.group(1) if inner else q))
    return out


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
                   "vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total", "vllm:request_success_total"):
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


def exported_sample_names(text: str) -> set[str]:
    """Names of the samples on a Prometheus text page (histograms as their _bucket/_sum/_count series)."""
    return {re.match(r"[^{\s]+", line).group() for line in text.splitlines() if line and not line.startswith("#")}


def unexported(dash: dict, exported: set[str]) -> set[tuple[str, str]]:
    """(where, metric) of every metric a query names that is not among `exported`."""
    return {(where, name) for where, expr in queries(dash) for name in metric_names(expr) if name not in exported}


@pytest.mark.slow
@pytest.mark.server
def test_every_query_names_a_metric_the_server_exports(triton):
    from client.stream import stream_generate

    stream_generate(triton.grpc_url, "qwen3_a8w8", "Hello", max_tokens=4)   # every histogram has a sample
    assert triton.wait_until(lambda: 'vllm:time_to_first_token_seconds_count{model="qwen3_a8w8"' in triton.metrics(), 5)
    page = triton.metrics()
    exported = exported_sample_names(page)
    assert "vllm:time_to_first_token_seconds_bucket" in exported   # the page was read, histograms included
    assert not unexported(dashboard(), exported), sorted(unexported(dashboard(), exported))
    for name in {n for _, e in queries(dashboard()) for n in metric_names(e)}:   # per model, both models
        for model in ("qwen3_a8w8", "qwen3_tq"):
            assert re.search(rf'^{re.escape(name)}\{{[^}}]*model="{model}"', page, re.M), (name, model)
    # the check is live: a panel with a misspelled metric is reported
    broken = dashboard()
    broken["panels"][0]["targets"][0]["expr"] = 'sum(vllm:num_request_running{model=~"$model"})'
    assert {name for _, name in unexported(broken, exported)} == {"vllm:num_request_running"}
