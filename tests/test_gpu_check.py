"""bench.gpu_check's CPU dry run (Triton interpreter, tiny shapes): the same checks, GEMV and decode timing code
the GPU run executes, its JSON and its table."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("triton", reason="the triton package is not installed (pip install -e '.[test]')")

from helpers import ROOT  # noqa: E402


def test_gpu_check_dry_run_passes_and_reports(tmp_path):
    out = tmp_path / "gpu_check.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-m", "bench.gpu_check", "--dry-run", "--json", str(out)], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    r = json.loads(out.read_text())
    assert r["dry_run"] and r["all_checks_ok"] and r["skipped"] == []
    a8w8 = [c for c in r["checks"] if c["check"].startswith("a8w8_linear")]
    assert len(a8w8) == 3 and all(c["bit_exact"] for c in a8w8)
    assert {c["check"] for c in r["checks"]} >= {"paged_attention bf16", "tq_write codes",
                                                 "decode step logits vs reference"}
    assert [d["batch"] for d in r["decode"]] == [1, 2]
    assert all(d["eager_tokens_per_s"] > 0 and d["graph_tokens_per_s"] is None and 0 < d["share_of_floor"]
               for d in r["decode"])
    assert r["gemv"] and r["gemv"][0]["GBps"] > 0
    moe = [c for c in r["checks"] if c["check"].startswith("fused moe a8w8")]
    assert len(moe) == 2 and all(c["bit_exact"] for c in moe) and [m["GBps"] > 0 for m in r["moe"]] == [True] * 2
    last = proc.stdout.strip().splitlines()[-1].split()
    assert last[:2] == ["tiny", "2"]          # the table comes last
