"""The MoE group: Qwen3-30B-A3B's shape with fewer layers (the same 128 experts of width 768, 8 per token, the same
attention and vocabulary), this engine in A8W8 and W4A16 beside llama.cpp's `qwen3moe` in Q8_0 and Q4_0 (its own
converter and llama-quantize from the bf16 demo checkpoint, its own llama-batched-bench), interleaved round by
round (A, B, C, D, STREAM, A, B, ...), each figure the median of the rounds.

    python -m bench.moe --group [--layers 4] [--rounds 3] [--batch 1,16] [--prompt-len 128] [--new-tokens 64]

Batch-1 decode is compared with its bandwidth floor: the bytes one decode token reads (each layer's attention
weights and KV rows, the router, the 8 routed experts, the final norm and the head; the weights in the engine's
packed form: int8 + fp32 scale and column sum per row, int4 + fp32 scale and zero per group of 128) over a STREAM
read (bench/step_profile.py) measured in the same rounds. The checkpoints keep lm_head in bf16 as the published MoE
releases do; llama.cpp's Q8_0 / Q4_0 quantize theirs to Q8_0 / Q6_K, so the engine quantizes its head at load too:
int8 for A8W8 (`--lm-head-quant int8`, the bytes of Q8_0's), int4 codes on int8 activations for W4A16
(`--lm-head-quant int4a8`, group 128: the bytes and the kind of arithmetic of a Q4_0 head, which llama.cpp's
`q4_0-q4head` file has; its default Q4_0 file's Q6_K head reads 1.46x those). The W4A16 checkpoint runs twice: with
its experts and attention as stored (`W4A16`: the fp32 FMA a weight of the W4A16 contract) and with
`--moe-experts-quant int4a8 --int4-activations int8` (`W4A16 int4a8`: the same codes on int8 activations in the
experts and the attention projections, llama.cpp's Q4_0 x Q8_0 in kind, its scales in fp32 without the zeros).
Only the ratios of one run mean anything on a shared host.
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from backend_lib.layers.linear import INT4_HEAD_GROUP

from . import llamacpp
from .run import ROOT, Worker, decode_rate, log
from .step_profile import stream_read_gbs

SIZE = "30b-a3b"
# engine label, checkpoint, the engine's lm_head_quant, its moe_experts_quant, its int4_activations, llama.cpp quants
# (the first: the one llama-quantize makes by default; q4_0-q4head: Q4_0 with its head in Q4_0, the bytes of the
# engine's int4 head, llama.cpp's side of a bytes-matched comparison)
PAIRS = (("A8W8", "a8w8", "int8", "checkpoint", "checkpoint", ("q8_0",)),
         ("W4A16", "w4a16", "int4a8", "checkpoint", "checkpoint", ("q4_0", "q4_0-q4head")),
         ("W4A16 int4a8", "w4a16", "int4a8", "int4a8", "int8", ("q4_0", "q4_0-q4head")))
QUANTS = tuple(q for *_, qs in PAIRS for q in qs)


def checkpoint_dir(layers: int, fmt: str, size: str = SIZE) -> Path:
    return ROOT / "demo_checkpoints" / f"qwen3-{size}-l{layers}-{fmt}"


def ensure_checkpoints(layers: int, formats=("bf16", "a8w8", "w4a16"), size: str = SIZE) -> dict[str, Path]:
    """size: 30b-a3b (the bench), tiny-moe (a smoke run of the whole group in a minute)."""
    out = {}
    for fmt in formats:
        path = checkpoint_dir(layers, fmt, size)
        if not (path / "config.json").is_file():
            log(f"building the {size} ({layers} layers) {fmt} demo checkpoint")
            extra = ["--group-size", "128" if size == SIZE else "32"] if fmt == "w4a16" else []
            if size == SIZE:   # tensor by tensor: random_model would hold the 4 layers' 3.1B parameters in fp32
                extra.append("--stream")
            subprocess.run(["nice", "-n", "10", sys.executable, "-m", "backend_lib.tools.make_demo_checkpoint",
                            str(path), "--size", size, "--layers", str(layers), "--format", fmt, "--overwrite", *extra],
                           cwd=ROOT, check=True)
        out[fmt] = path
    return out


def _w_bytes(fmt: str, n: int, k: int, group: int = 128) -> int:
    """Bytes of one [n, k] weight in the engine's packed form."""
    if fmt == "a8w8":
        return n * k + 8 * n
    if fmt == "w4a16":
        return n * k // 2 + n * (k // group) * 8
    if fmt == "w4a8":   # the int4a8 head: the same codes, fp32 scales (no zeros: 8)
        return n * k // 2 + n * (k // group) * 4
    return 2 * n * k


def bytes_per_token(cfg: dict, fmt: str, context: int, head: str = "int8", group: int = 128,
                    experts_quant: str = "checkpoint", int4_activations: str = "checkpoint") -> dict[str, int]:
    """What one batch-1 decode token reads, by part, at `context` tokens in the KV cache (bf16); head: the
    engine's lm_head_quant (int8, int4 / int4a8 in groups of 128, or checkpoint: bf16); experts_quant: its
    moe_experts_quant (int4a8: the codes and fp32 scales, no zeros); int4_activations: its int4_activations (int8:
    the int4 attention projections' codes and fp32 scales, no zeros)."""
    h, d = cfg["hidden_size"], cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    nh, kvh, layers = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["num_hidden_layers"]
    inter, k = cfg["moe_intermediate_size"], cfg["num_experts_per_tok"]
    e = cfg["num_experts"] if "num_experts" in cfg else cfg["num_local_experts"]
    afmt = "w4a8" if fmt == "w4a16" and int4_activations == "int8" else fmt
    attn = _w_bytes(afmt, (nh + 2 * kvh) * d, h, group) + _w_bytes(afmt, h, nh * d, group) + 2 * (2 * h + 2 * d)
    kv = context * kvh * d * 2 * 2
    router = 2 * e * h
    efmt = "w4a8" if experts_quant == "int4a8" else fmt
    experts = k * (_w_bytes(efmt, 2 * inter, h, group) + _w_bytes(efmt, h, inter, group))
    vocab = cfg["vocab_size"]
    head_group = INT4_HEAD_GROUP if h % INT4_HEAD_GROUP == 0 else h   # layers/linear.py int4_head_weight's groups
    head_w = _w_bytes({"int8": "a8w8", "int4": "w4a16", "int4a8": "w4a8"}.get(head, "bf16"), vocab, h, head_group)
    return {"attention": layers * attn, "kv": layers * kv, "router": layers * router, "experts": layers * experts,
            "head": head_w + 2 * h + 2 * h, "total": layers * (attn + kv + router + experts) + head_w + 4 * h}


def round_ratios(ours: list[float], theirs: list[float]) -> dict:
    """The ratio of two systems measured in the same rounds, round by round: on a host whose bandwidth swings 2x
    between minutes, a round's pair (run back to back) shares its minute, so the median of the per-round ratios is
    steadier than the ratio of the medians; with the lowest and highest round and how many rounds were above 1."""
    r = sorted(a / b for a, b in zip(ours, theirs))
    return {"median": statistics.median(r), "min": r[0], "max": r[-1], "above_1": sum(x > 1 for x in r), "n": len(r)}


def ratio_keys(quants) -> list[str]:
    """The summary's key of each llama.cpp file of a format: `llamacpp` for the first (the default file, the one
    bench/report.py's table and the targets read), its tag for the others."""
    return ["llamacpp", *quants[1:]]


def summary_line(row: dict, batches: list[int]) -> str:
    """One engine format's bytes, floor and ratios to each of its llama.cpp files (with the per-round figures)."""
    nb = row["bytes_per_token"]
    parts = ", ".join(f"{k} {v / 1e6:.1f}" for k, v in nb.items() if k != "total")
    line = f"  {row['system']:<18} bytes/token {nb['total'] / 1e6:.1f} MB ({parts}): floor " \
           f"{row['floor_tokens_per_s']:.1f} tokens/s"
    if "vs_floor_b1" in row:
        line += f"; batch 1 = {row['vs_floor_b1']:.2f}x the floor (target >= 0.8)"
        if "vs_floor_b1_rounds" in row:
            rr = row["vs_floor_b1_rounds"]
            line += f" [per round, each against its own STREAM read: median {rr['median']:.2f}x, " \
                    f"{rr['min']:.2f}-{rr['max']:.2f}]"
    for b in batches:
        for key, quant in zip(ratio_keys(row["quants"]), row["quants"]):
            if f"vs_{key}_b{b}" not in row:
                continue
            target = f" (target >= {1.15 if b == 1 else 1.5})" if key == "llamacpp" else ""
            rr = row[f"vs_{key}_b{b}_rounds"]
            line += (f"; batch {b} = {row[f'vs_{key}_b{b}']:.2f}x llama.cpp {quant.upper()}{target} [per round: "
                     f"median {rr['median']:.2f}x, {rr['min']:.2f}-{rr['max']:.2f}, {rr['above_1']}/{rr['n']} above 1]")
    return line


def run_group(layers: int, rounds: int, batches: list[int], prompt_len: int, new_tokens: int,
              out: str | None = None, size: str = SIZE) -> list[dict]:
    ck = ensure_checkpoints(layers, size=size)
    ggufs = llamacpp.installed(ck["bf16"], quants=QUANTS, need_bf16=False)
    if ggufs is None and all(llamacpp.binary(t).is_file() for t in llamacpp.TARGETS):
        ggufs = llamacpp.convert(ck["bf16"], quants=QUANTS, keep_bf16=False)
    if ggufs is None:
        log("llama.cpp is not built (python -m bench.llamacpp build): the engine against its floor only")
    out_dir = Path(out or ROOT / "bench" / "results" / time.strftime("moe-%Y%m%d-%H%M%S"))
    out_dir.mkdir(parents=True, exist_ok=True)
    threads = len(os.sched_getaffinity(0))
    max_len = str(prompt_len + new_tokens + 16)
    engine = [sys.executable, "-m", "bench.workers.engine_worker", "--max-model-len", max_len, "--max-num-seqs",
              str(max(batches)), "--kv-cache-memory", "1GiB"]
    systems: dict = {}
    for label, fmt, head, experts_quant, int4_act, quants in PAIRS:
        tag = fmt if experts_quant == "checkpoint" else f"{fmt}-{experts_quant}"
        systems[f"engine {label}"] = Worker(f"moe-engine-{tag}", engine + [
            "--checkpoint", str(ck[fmt]), "--lm-head-quant", head, "--moe-experts-quant", experts_quant,
            "--int4-activations", int4_act], out_dir)
        for quant in quants if ggufs is not None else ():
            if f"llama.cpp {quant.upper()}" not in systems:   # one per file, shared by the engines of its format
                systems[f"llama.cpp {quant.upper()}"] = llamacpp.LlamaCppSystem(ggufs[quant], threads,
                                                                                 out_dir / "llamacpp.log")
    decode: dict[tuple[str, int], list[float]] = {}
    stream: list[float] = []
    try:
        for r in range(rounds):
            for name, w in systems.items():
                if isinstance(w, Worker):
                    for b in batches:
                        res = w.call(op="decode", batch=b, prompt_len=prompt_len, new_tokens=new_tokens)
                        decode.setdefault((name, b), []).append(
                            decode_rate(b, new_tokens, res["full_s"], res["prefill_s"]))
                else:
                    for row in w.call(op="batched", prompt_len=prompt_len, new_tokens=new_tokens,
                                      batches=batches)["rows"]:
                        decode.setdefault((name, row["batch"]), []).append(row["decode_tokens_per_s"])
            stream.append(stream_read_gbs(threads, gib=1.0, repeats=3))
            log(f"MoE round {r + 1}: " + ", ".join(f"{n} b{b} {v[-1]:.1f}" for (n, b), v in decode.items())
                + f", STREAM {stream[-1]:.1f} GB/s")
        mem = {name: w.call(op="memory") for name, w in systems.items() if isinstance(w, Worker)}
    finally:
        for w in systems.values():
            w.close()
    cfg = json.loads((ck["a8w8"] / "config.json").read_text())
    w4cfg = json.loads((ck["w4a16"] / "config.json").read_text())
    group = w4cfg["quantization_config"]["config_groups"]["group_0"]["weights"]["group_size"] or cfg["hidden_size"]
    gbs = statistics.median(stream)
    rows = []
    med = {key: statistics.median(v) for key, v in decode.items()}
    for (name, b), v in med.items():
        rows.append({"group": "moe", "system": name, "mode": "decode", "batch": b, "prompt_len": prompt_len,
                     "new_tokens": new_tokens, "layers": layers, "decode_tokens_per_s": v, "runs": decode[(name, b)]})
    for label, fmt, head, experts_quant, int4_act, quants in PAIRS:
        nb = bytes_per_token(cfg, fmt, prompt_len + new_tokens // 2, head=head, group=group,
                             experts_quant=experts_quant, int4_activations=int4_act)
        floor = gbs * 1e9 / nb["total"]
        eng = f"engine {label}"
        summary = {"group": "moe", "system": eng, "mode": "summary", "format": fmt, "lm_head_quant": head,
                   "moe_experts_quant": experts_quant, "int4_activations": int4_act,
                   "layers": layers, "quants": quants,
                   "stream_gbs": gbs, "stream_gbs_rounds": stream, "bytes_per_token": nb, "floor_tokens_per_s": floor,
                   "rss_mib": mem.get(eng, {}).get("rss_mib")}
        for b in batches:
            for key, quant in zip(ratio_keys(quants), quants):
                cpp = f"llama.cpp {quant.upper()}"
                if (cpp, b) in med:
                    summary[f"vs_{key}_b{b}"] = med[(eng, b)] / med[(cpp, b)]
                    summary[f"vs_{key}_b{b}_rounds"] = round_ratios(decode[(eng, b)], decode[(cpp, b)])
        if 1 in batches:
            summary["vs_floor_b1"] = med[(eng, 1)] / floor
            # the round's decode against the round's own STREAM read (the host's bandwidth swings 2x between
            # minutes: the medians of the two come from different rounds)
            summary["vs_floor_b1_rounds"] = round_ratios(decode[(eng, 1)], [g * 1e9 / nb["total"] for g in stream])
        rows.append(summary)
    (out_dir / "results.json").write_text(json.dumps({"rows": rows}, indent=1))
    print(f"MoE group: {size} shape, {layers} layers, {rounds} rounds interleaved, {threads} threads; "
          f"STREAM read {gbs:.1f} GB/s (median); shared host: only these ratios mean anything")
    for row in rows:
        if row["mode"] == "decode":
            print(f"  {row['system']:<18} batch {row['batch']:3d}: {row['decode_tokens_per_s']:8.2f} tokens/s")
    for row in rows:
        if row["mode"] == "summary":
            print(summary_line(row, batches))
    print(f"results in {out_dir}")
    return rows
