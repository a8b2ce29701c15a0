"""The protocol of the benchmark workers (stdlib only: the vLLM worker runs in another venv).

A worker loads its model once, prints READY, then answers one JSON command per stdin line with one
`RESULT {json}` line, so that the orchestrator can interleave the systems measurement by measurement:
  {"op": "decode", "batch": B, "prompt_len": P, "new_tokens": N} -> {"full_s", "prefill_s"}
      one generation of N tokens and one of 1 token for the batch (their difference is the decode time)
  {"op": "ttft", "prompt_len": P} -> {"ttft_s"}   one 1-token generation of one prompt
"""
from __future__ import annotations

import argparse
import json
import random
import sys
import time


def prompts(n: int, length: int, seed: int = 0) -> list[list[int]]:
    """The same random token-id prompts for every system."""
    rng = random.Random(seed * 1_000_003 + length)
    return [[rng.randrange(1000, 100_000) for _ in range(length)] for _ in range(n)]


def arg_parser(doc: str) -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=doc)
    ap.add_argument("--checkpoint", required=True)
    ap.add_argument("--max-model-len", type=int, default=2200)
    ap.add_argument("--max-num-seqs", type=int, default=16)
    return ap


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def serve(run) -> None:
    """run(prompts, max_tokens) generates for a batch; answers commands until stdin closes."""
    run(prompts(1, 16), 2)   # warm-up: kernels, allocator
    print("READY", flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "decode":
            ps = prompts(cmd["batch"], cmd["prompt_len"])
            full = _timed(lambda: run(ps, cmd["new_tokens"]))
            prefill = _timed(lambda: run(ps, 1))
            out = {"full_s": full, "prefill_s": prefill}
        elif cmd["op"] == "ttft":
            ps = prompts(1, cmd["prompt_len"])
            out = {"ttft_s": _timed(lambda: run(ps, 1))}
        else:
            out = {"error": f"unknown op {cmd['op']!r}"}
        print("RESULT " + json.dumps(out), flush=True)
