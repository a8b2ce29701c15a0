"""The whole stack against llama.cpp's `llama-server`, with one OpenAI client and one load.

    python -m bench.serving [--size 0.6b] [--concurrency 1,16] [--requests 8,32] [--input-len 128]
                            [--output-len 128] [--repeats 2] [--threads N] [--out DIR]

Ours: the venv's `tritonserver` serving `qwen3_a8w8` and the tokenizer model on the A8W8 demo checkpoint, with
the OpenAI front before it; with `--cotenant` the `qwen3_tq` model (bf16 demo checkpoint) is loaded too, as in
the default model repository (the launcher's work-conserving core share gives a lone request every core).
Theirs: `llama-server` (built by `python -m bench.run --setup-llamacpp`) on the Q8_0 GGUF of the same
checkpoint, with as many slots as the highest concurrency (continuous batching) and the same threads.

The client (this file, the standard library's http.client, one thread per concurrent request) sends the same requests to both: /v1/completions, the prompt as `input_len`
random token ids (one vocabulary: the GGUF is converted from the checkpoint), `max_tokens` output_len,
greedy, `ignore_eos`, streamed; each request's time to first token is taken at its first chunk with text,
its output tokens from the final usage (`stream_options.include_usage`). The two servers are measured in
turn, round by round (ours, theirs, ours, theirs, ...), so that this machine's drifting bandwidth hits both
alike; each figure is the median over rounds. Prints and writes serving.json: output tokens/s (completion
tokens over the round's wall time), TTFT p50 / p99 and their ratios.
"""
from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import statistics
import subprocess
import sys
import threading
import time
import urllib.parse
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from . import llamacpp
from .serve_load import wait_http

ROOT = Path(__file__).resolve().parent.parent
MODEL = "qwen3_a8w8"


def log(msg: str) -> None:
    print(f"[serving {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def _pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(round(q * (len(s) - 1))))]


def _one(base_url: str, model: str, prompt: list[int], output_len: int) -> tuple[float, int]:
    """One streamed completion over a fresh connection (stdlib http.client: the bench needs no HTTP library)."""
    u = urllib.parse.urlsplit(base_url)
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": output_len, "temperature": 0,
                       "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}})
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=1800)
    t0 = time.perf_counter()
    ttft, tokens, chunks = None, None, 0
    try:
        conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
        r = conn.getresponse()
        if r.status != 200:
            raise RuntimeError(f"{base_url}: HTTP {r.status}: {r.read()[:300]!r}")
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if event.get("choices") and event["choices"][0].get("text"):
                chunks += 1
                if ttft is None:
                    ttft = time.perf_counter() - t0
            if event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
    finally:
        conn.close()
    if ttft is None:
        raise RuntimeError(f"{base_url}: no text streamed")
    return ttft, tokens if tokens is not None else chunks


def run_load(base_url: str, model: str, prompts: list[list[int]], concurrency: int, output_len: int) -> dict:
    """`concurrency` clients, each sending the next prompt as soon as its previous response ended."""
    queue = list(prompts)
    lock = threading.Lock()
    ttfts, total = [], [0]

    def worker():
        while True:
            with lock:
                if not queue:
                    return
                prompt = queue.pop(0)
            ttft, n = _one(base_url, model, prompt, output_len)
            with lock:
                ttfts.append(ttft)
                total[0] += n

    t0 = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        for f in [pool.submit(worker) for _ in range(concurrency)]:
            f.result()
    wall = time.perf_counter() - t0
    return {"output_tokens_per_s": total[0] / wall, "ttft_p50_s": _pct(ttfts, 0.5), "ttft_p99_s": _pct(ttfts, 0.99),
            "completion_tokens": total[0], "wall_s": wall}


def start_ours(ckpt: Path, bf16: Path | None, slots: int, ctx: int, out_dir: Path):
    from harness.triton_server import TritonServer, free_port, make_repository

    models = {MODEL: {"checkpoint": str(ckpt), "max_num_seqs": str(slots), "kv_cache_memory": "1GiB",
                      "max_model_len": str(ctx)},
              "qwen3_tokenizer": {"checkpoint": str(ckpt)}}
    if bf16 is not None:
        models["qwen3_tq"] = {"checkpoint": str(bf16), "max_num_seqs": str(slots), "kv_cache_memory": "1GiB",
                              "max_model_len": str(ctx)}
    repo = make_repository(out_dir / "models", models)
    log("starting tritonserver" + (" (qwen3_tq loaded too)" if bf16 else ""))
    server = TritonServer(repo, out_dir / "tritonserver.log").start(timeout=900)
    port = free_port()
    front = subprocess.Popen([sys.executable, "-m", "openai_frontend", "--triton-url", server.grpc_url,
                              "--port", str(port), "--log-level", "warning"], cwd=ROOT,
                             stdout=open(out_dir / "openai_front.log", "w"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    wait_http(f"{url}/health", 120, front)
    return url, (server, front)


def start_llama_server(gguf: Path, slots: int, ctx: int, threads: int, out_dir: Path):
    from harness.triton_server import free_port

    port = free_port()
    cmd = [str(llamacpp.binary("llama-server")), "-m", str(gguf), "-t", str(threads), "-tb", str(threads),
           "-c", str(slots * ctx), "-np", str(slots), "--host", "127.0.0.1", "--port", str(port), "--no-webui"]
    log("starting " + " ".join(cmd[1:]))
    proc = subprocess.Popen(cmd, stdout=open(out_dir / "llama_server.log", "w"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    wait_http(f"{url}/health", 300, proc)
    return url, proc


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="0.6b", choices=["0.6b", "tiny"])
    ap.add_argument("--concurrency", default="1,16")
    ap.add_argument("--requests", default="8,32", help="requests per round, one per concurrency")
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--cotenant", action="store_true", help="load qwen3_tq beside qwen3_a8w8 (the default repository)")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "serving"))
    args = ap.parse_args(argv)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    concs = [int(c) for c in args.concurrency.split(",")]
    nreqs = [int(n) for n in args.requests.split(",")]
    if len(nreqs) != len(concs):
        raise SystemExit("--requests: one count per --concurrency value")
    from .run import ensure_checkpoints

    ck = ensure_checkpoints(args.size)
    ggufs = llamacpp.installed(ck["bf16"])
    if ggufs is None:
        raise SystemExit("llama.cpp is not built: python -m bench.run --setup-llamacpp (or python -m bench.llamacpp setup)")
    slots, ctx = max(concs), args.input_len + args.output_len + 64
    rng = random.Random(0)
    ours = theirs = None
    rows = []
    try:
        our_url, ours = start_ours(ck["a8w8"], ck["bf16"] if args.cotenant else None, slots, ctx, out_dir)
        llama_url, theirs = start_llama_server(ggufs["q8_0"], slots, ctx, args.threads, out_dir)
        systems = {"this stack (tritonserver + front), A8W8": (our_url, MODEL),
                   "llama-server, Q8_0": (llama_url, "q8_0")}
        warm = [[rng.randrange(1000, 100_000) for _ in range(args.input_len)] for _ in range(2)]
        for name, (url, model) in systems.items():
            (run_load(url, model, warm, 2, 8))
            log(f"{name}: warmed up")
        for conc, n in zip(concs, nreqs):
            runs: dict[str, list[dict]] = {name: [] for name in systems}
            for r in range(args.repeats):
                prompts = [[rng.randrange(1000, 100_000) for _ in range(args.input_len)] for _ in range(n)]
                for name, (url, model) in systems.items():
                    res = (run_load(url, model, prompts, conc, args.output_len))
                    runs[name].append(res)
                    log(f"concurrency {conc} round {r + 1}: {name}: {res['output_tokens_per_s']:.1f} tokens/s, "
                        f"TTFT p50 {res['ttft_p50_s'] * 1000:.0f} ms")
            for name, rs in runs.items():
                rows.append({"system": name, "concurrency": conc, "requests": n,
                             "output_tokens_per_s": statistics.median(x["output_tokens_per_s"] for x in rs),
                             "ttft_p50_s": statistics.median(x["ttft_p50_s"] for x in rs),
                             "ttft_p99_s": statistics.median(x["ttft_p99_s"] for x in rs),
                             "rounds": rs})
    finally:
        if theirs is not None:
            theirs.terminate()
            theirs.wait(30)
        if ours is not None:
            ours[1].terminate()
            ours[1].wait(30)
            ours[0].stop()
    lines = [f"{args.input_len}-token random prompts, {args.output_len} tokens out, greedy, ignore_eos, {args.threads} "
             f"threads, median of {args.repeats} alternated rounds",
             "", "| concurrency | system | output tokens/s | TTFT p50 (ms) | TTFT p99 (ms) |", "|---|---|---:|---:|---:|"]
    for row in rows:
        lines.append(f"| {row['concurrency']} | {row['system']} | {row['output_tokens_per_s']:.1f} | "
                     f"{row['ttft_p50_s'] * 1000:.0f} | {row['ttft_p99_s'] * 1000:.0f} |")
    for conc in concs:
        a, b = [r for r in rows if r["concurrency"] == conc]
        lines.append(f"\nconcurrency {conc}: tokens/s {a['output_tokens_per_s'] / b['output_tokens_per_s']:.2f}x, "
                     f"TTFT p50 {a['ttft_p50_s'] / b['ttft_p50_s']:.2f}x of llama-server's")
    text = "\n".join(lines)
    (out_dir / "serving.json").write_text(json.dumps({"rows": rows, "args": vars(args)}, indent=1))
    (out_dir / "serving.md").write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
