"""Shared by the benchmark workers (stdlib only: the vLLM worker runs in another venv)."""
from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time


def prompts(n: int, length: int, seed: int = 0) -> list[list[int]]:
    """The same random token-id prompts for every system."""
    rng = random.Random(seed * 1_000_003 + length)
    return [[rng.randrange(1000, 100_000) for _ in range(length)] for _ in range(n)]


def timed(fn, repeats: int) -> list[float]:
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def decode_rate(run, batch: int, new_tokens: int, repeats: int) -> dict:
    """Decode tokens/s as (whole generation) - (prefill + first token), so prefill never counts.

    run(max_tokens) generates for the batch. Each figure is the median of `repeats` runs.
    """
    run(2)  # warm-up (kernel caches, allocator)
    full = statistics.median(timed(lambda: run(new_tokens), repeats))
    first = statistics.median(timed(lambda: run(1), repeats))
    decode_s = max(full - first, 1e-9)
    return {"batch": batch, "new_tokens": new_tokens, "total_s": full, "prefill_s": first,
            "decode_tokens_per_s": batch * (new_tokens - 1) / decode_s}


def emit(result: dict) -> None:
    print("RESULT " + json.dumps(result), flush=True)
    sys.stdout.flush()


def arg_parser(doc: str, modes=("decode", "ttft")) -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=doc)
    ap.add_argument("--checkpoint", required=True)
    ap.add_argument("--mode", choices=list(modes), required=True)
    ap.add_argument("--batches", default="1,8,16")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    return ap


def measure(args, run, **labels) -> None:
    """run(prompts, max_tokens) generates for a batch. decode/long: decode_rate per batch size; ttft: the
    median time of a one-token request."""
    if args.mode in ("decode", "long"):
        for b in [int(v) for v in args.batches.split(",")]:
            ps = prompts(b, args.prompt_len)
            emit({"mode": args.mode, "prompt_len": args.prompt_len, **labels,
                  **decode_rate(lambda n: run(ps, n), b, args.new_tokens, args.repeats)})
    else:
        ps = prompts(1, args.prompt_len)
        run(ps, 1)
        emit({"mode": "ttft", "prompt_len": args.prompt_len, **labels,
              "ttft_s": statistics.median(timed(lambda: run(ps, 1), args.repeats))})
