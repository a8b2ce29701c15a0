"""Load generator: N concurrent gRPC streams, with genai-perf's latency and throughput statistics.

    python -m client.loadgen --model qwen3_a8w8 --concurrency 8 --requests 32 --prompt-tokens 128
        --max-tokens 128 [--url localhost:8001] [--json out.json]

Per request: time to first token (TTFT), inter-token latency (ITL, (last - first) / (tokens - 1)),
request latency and output tokens/s; overall: output tokens/s and requests/s over the run.
Reported as avg, min, max, p50, p90, p99, as genai-perf does.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
import uuid

import tritonclient.grpc.aio as grpcaio

from .triton_inputs import build_inputs, is_final, response_text


def percentiles(values: list[float]) -> dict:
    if not values:
        return {}
    vals = sorted(values)

    def pct(p):
        k = (len(vals) - 1) * p / 100
        lo, hi = int(k), min(int(k) + 1, len(vals) - 1)
        return vals[lo] + (vals[hi] - vals[lo]) * (k - lo)

    return {"avg": statistics.fmean(vals), "min": vals[0], "max": vals[-1], "p50": pct(50), "p90": pct(90),
            "p99": pct(99)}


async def one_request(client, model: str, request: dict) -> dict:
    inputs = build_inputs(**request)

    async def requests():
        yield {"model_name": model, "inputs": inputs, "request_id": uuid.uuid4().hex,
               "enable_empty_final_response": True}

    t0 = time.perf_counter()
    times, ids, error = [], [], None
    async for result, err in client.stream_infer(requests()):
        if err is not None:
            error = str(err)
            break
        _, new_ids = response_text(result)
        if new_ids:
            times.append(time.perf_counter())
            ids.extend(new_ids)
        if is_final(result):
            break
    return {"start": t0, "token_times": times, "output_ids": ids, "error": error, "end": time.perf_counter()}


async def run_load(url: str, model: str, concurrency: int, requests: list[dict]) -> dict:
    client = grpcaio.InferenceServerClient(url)
    pending = list(enumerate(requests))
    records: list[dict | None] = [None] * len(requests)

    async def worker():
        while pending:
            i, req = pending.pop(0)
            records[i] = await one_request(client, model, req)

    t0 = time.perf_counter()
    await asyncio.gather(*[worker() for _ in range(concurrency)])
    duration = time.perf_counter() - t0
    await client.close()
    return summarize(records, duration, concurrency)


def summarize(records: list[dict], duration: float, concurrency: int) -> dict:
    ok = [r for r in records if r["error"] is None and r["token_times"]]
    ttft = [r["token_times"][0] - r["start"] for r in ok]
    itl = [(r["token_times"][-1] - r["token_times"][0]) / (len(r["token_times"]) - 1) for r in ok
           if len(r["token_times"]) > 1]
    latency = [r["end"] - r["start"] for r in ok]
    per_req_tps = [len(r["output_ids"]) / (r["end"] - r["start"]) for r in ok]
    tokens = sum(len(r["output_ids"]) for r in ok)
    return {"concurrency": concurrency, "requests": len(records), "errors": len(records) - len(ok),
            "duration_s": duration, "output_tokens": tokens, "output_tokens_per_s": tokens / duration,
            "requests_per_s": len(ok) / duration, "time_to_first_token_s": percentiles(ttft),
            "inter_token_latency_s": percentiles(itl), "request_latency_s": percentiles(latency),
            "output_tokens_per_s_per_request": percentiles(per_req_tps),
            "error_messages": sorted({r["error"] for r in records if r["error"]})[:5],
            "records": records}


def print_report(summary: dict) -> None:
    print(f"concurrency {summary['concurrency']}, {summary['requests']} requests, {summary['errors']} errors, "
          f"{summary['duration_s']:.1f} s")
    print(f"output tokens/s {summary['output_tokens_per_s']:.1f}, requests/s {summary['requests_per_s']:.2f}")
    print(f"{'statistic':34s} {'avg':>9s} {'min':>9s} {'max':>9s} {'p50':>9s} {'p90':>9s} {'p99':>9s}")
    for key, scale, unit in (("time_to_first_token_s", 1000, "ms"), ("inter_token_latency_s", 1000, "ms"),
                             ("request_latency_s", 1000, "ms"), ("output_tokens_per_s_per_request", 1, "tok/s")):
        s = summary[key]
        if s:
            label = f"{key[:-2] if unit == 'ms' else key} ({unit})"
            print(f"{label:34s} " + " ".join(f"{s[k] * scale:9.2f}" for k in ("avg", "min", "max", "p50", "p90", "p99")))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen3_a8w8")
    ap.add_argument("--url", default="localhost:8001")
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--requests", type=int, default=None, help="total requests (default: one per stream)")
    src = ap.add_mutually_exclusive_group()
    src.add_argument("--prompt", default=None)
    src.add_argument("--prompt-tokens", type=int, default=128, help="random token-id prompts of this length")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--ignore-eos", action="store_true", default=True)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None, help="write the summary (and per-request records) here")
    args = ap.parse_args(argv)
    rng = random.Random(args.seed)
    n = args.requests or args.concurrency
    sampling = {"temperature": args.temperature, "ignore_eos": args.ignore_eos}
    reqs = []
    for _ in range(n):
        req = {"stream": True, "max_tokens": args.max_tokens, "sampling_parameters": sampling}
        if args.prompt is not None:
            req["prompt"] = args.prompt
        else:
            req["input_ids"] = [rng.randrange(1000, 100000) for _ in range(args.prompt_tokens)]
        reqs.append(req)
    summary = asyncio.run(run_load(args.url, args.model, args.concurrency, reqs))
    print_report(summary)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=1)
    return 1 if summary["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
