"""Shared by the benchmark workers (stdlib only: the vLLM worker runs in another venv)."""
from __future__ import annotations

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
