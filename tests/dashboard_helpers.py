"""The Grafana dashboard's queries and the metric names they select (tests/test_dashboard.py checks them against the
real server's metrics page, tests/test_speculative_server.py the speculative-decoding panel's, whose counters only a
model with speculative_config exports)."""
from __future__ import annotations

import json
import re

from helpers import ROOT

DASHBOARD = ROOT / "deploy" / "grafana" / "qwen3-triton.json"
SPEC_PREFIX = "vllm:spec_decode_"   # metrics a model exports only with speculative decoding on

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


def exported_sample_names(text: str) -> set[str]:
    """Names of the samples on a Prometheus text page (histograms as their _bucket/_sum/_count series)."""
    return {re.match(r"[^{\s]+", line).group() for line in text.splitlines() if line and not line.startswith("#")}


def unexported(dash: dict, exported: set[str]) -> set[tuple[str, str]]:
    """(where, metric) of every metric a query names that is not among `exported`."""
    return {(where, name) for where, expr in queries(dash) for name in metric_names(expr) if name not in exported}
