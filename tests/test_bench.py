"""The benchmark's own arithmetic: the long-context prompts and the report's ratios (no model runs here)."""
from __future__ import annotations

from bench.report import write_report
from bench.run import decode_rate
from bench.workers.common import _long_decode


def test_long_decode_batches_share_the_base_prompt_and_end_in_distinct_tails():
    calls = []

    def run(prompts, max_tokens):
        calls.append(([list(p) for p in prompts], max_tokens))
        return [[0] * max_tokens for _ in prompts]

    out = _long_decode(run, base_len=4096, context=2048, batch=4, new_tokens=8, seed=3)
    assert set(out) == {"warm_s", "full_s", "prefill_s"}
    assert [m for _, m in calls] == [1, 1, 8, 1]                  # warm one, warm all, full, prefill
    assert len(calls[0][0]) == 1 and calls[0][0][0] == calls[1][0][0]
    batch = calls[2][0]
    assert calls[1][0] == batch == calls[3][0] and len(batch) == 4
    assert all(len(p) == 2048 for p in batch)
    assert all(p[:2032] == batch[0][:2032] for p in batch)         # the shared context
    assert len({tuple(p[2032:]) for p in batch}) == 4               # distinct tails
    # the context is the start of the base prompt, whatever the context length
    other = []
    _long_decode(lambda ps, m: other.append(ps) or [[0]] * len(ps), base_len=4096, context=4096, batch=1,
                 new_tokens=2, seed=3)
    assert other[0][0][:2032] == batch[0][:2032]


def test_the_report_gives_long_context_ratios_and_capacity(tmp_path):
    tq, bf, vl = "engine A8W8, TQ KV", "engine A8W8, bf16 KV", "vLLM-CPU W8A8, bf16 KV"
    rows = [{"group": "long", "system": s, "mode": "ttft", "prompt_len": 4096, "ttft_s": t}
            for s, t in ((bf, 30.0), (tq, 36.0), (vl, 40.0))]
    rows += [{"group": "long", "system": s, "mode": "long", "batch": 4, "prompt_len": 16384, "new_tokens": 32,
              "decode_tokens_per_s": r} for s, r in ((bf, 4.0), (tq, 7.0), (vl, 2.0))]
    rows += [{"group": "long", "system": s, "mode": "capacity", "kv_budget": "3GiB", "kv_tokens": n,
              "kv_bytes_per_token": b, "sequences_16384": n // 16384, "sequences_8192": n // 8192}
             for s, n, b in ((bf, 28086, 114688), (tq, 105738, 30464))]
    write_report(rows, {"cpu": "test", "cores": 2, "isa": []}, tmp_path)
    md = (tmp_path / "table.md").read_text()
    assert "| engine A8W8, bf16 KV | 30.0 (0.75x) |" in md          # TTFT / vLLM-CPU's
    assert "decode tokens/s (32 new tokens;" in md
    assert "| TQ KV / engine A8W8, bf16 KV | 1.75x |" in md
    assert "| TQ KV / vLLM-CPU W8A8, bf16 KV | 3.50x |" in md
    assert "| engine A8W8, TQ KV | 30464 | 105738 | 12 | 6 |" in md        # 8k, then 16k sequences
    assert "| engine A8W8, bf16 KV | 114688 | 28086 | 3 | 1 |" in md


def test_one_decode_rate_definition():
    assert decode_rate(4, 32, full_s=3.0, prefill_s=1.0) == 4 * 31 / 2.0   # B (N - 1) / (full - prefill)
    assert decode_rate(1, 2, full_s=1.0, prefill_s=1.0) > 1e8              # no division by zero
