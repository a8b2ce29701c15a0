"""The protocol of the benchmark workers (stdlib only: the vLLM worker runs in another venv).

A worker loads its model once, prints READY, then answers one JSON command per stdin line with one
`RESULT {json}` line, so that the orchestrator can interleave the systems measurement by measurement:
  {"op": "decode", "batch": B, "prompt_len": P, "new_tokens": N} -> {"full_s", "prefill_s"}
      one generation of N tokens and one of 1 token for the batch (their difference is the decode time)
  {"op": "ttft", "prompt_len": P[, "seed": K]} -> {"ttft_s"}   one 1-token generation of one prompt
  {"op": "long_decode", "base_len": L, "context": C, "batch": B, "new_tokens": N, "seed": K}
      -> {"warm_s", "full_s", "prefill_s"}: B prompts of C tokens that share the first C - 16 tokens of one
      L-token base prompt (seed K) and end in distinct 16-token tails; a 1-token generation of the batch
      first puts the shared context in the prefix cache (warm_s), then full_s / prefill_s as for "decode",
      both on a warm cache: their difference is decode time at context C, each sequence reading its C keys
  {"op": "multiturn", "conversations": C, "system_len": S, "turns": T, "user_len": U, "reply_len": R, "seed": K}
      -> {"ttft_s": [[per conversation] per turn], "total_s"}: C chats that share an S-token system prompt, T
      turns each; a turn is a 1-token generation of the history (its time to first token) and an R-token
      reply, which joins the history with the next U-token user message
  {"op": "shared_prefix", "requests": N, "prefix_len": P, "question_len": Q, "seed": K}
      -> {"ttft_s": [...], "total_s"}: N 1-token generations of one P-token prefix plus a distinct question
  {"op": "kv_capacity"} -> {"kv_tokens", "kv_bytes_per_token"}: what the worker's KV budget holds
`run(prompts, max_tokens)` returns the generated ids of each prompt. A new seed gives new prompts, so a
prefix cache starts cold in every measurement.
"""
from __future__ import annotations

import argparse
import json
import os
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


def _multiturn(run, conversations, system_len, turns, user_len, reply_len, seed) -> dict:
    system = prompts(1, system_len, seed=seed)[0]
    users = [prompts(turns, user_len, seed=seed * 100 + c + 1) for c in range(conversations)]
    history = [system + users[c][0] for c in range(conversations)]
    ttft: list[list[float]] = []
    t0 = time.perf_counter()
    for t in range(turns):
        ttft.append([])
        for c in range(conversations):
            ttft[-1].append(_timed(lambda: run([history[c]], 1)))
            reply = run([history[c]], reply_len)[0]
            if t + 1 < turns:
                history[c] = history[c] + list(reply) + users[c][t + 1]
    return {"ttft_s": ttft, "total_s": time.perf_counter() - t0}


def _long_decode(run, base_len, context, batch, new_tokens, seed) -> dict:
    base = prompts(1, base_len, seed=seed)[0][:context - 16]
    ps = [base + tail for tail in prompts(batch, 16, seed=seed + 1)]
    warm = _timed(lambda: run(ps[:1], 1)) + _timed(lambda: run(ps, 1))   # the first one fills the cache
    full = _timed(lambda: run(ps, new_tokens))
    prefill = _timed(lambda: run(ps, 1))
    return {"warm_s": warm, "full_s": full, "prefill_s": prefill}


def _shared_prefix(run, requests, prefix_len, question_len, seed) -> dict:
    prefix = prompts(1, prefix_len, seed=seed)[0]
    questions = prompts(requests, question_len, seed=seed + 1)
    t0 = time.perf_counter()
    ttft = [_timed(lambda: run([prefix + q], 1)) for q in questions]
    return {"ttft_s": ttft, "total_s": time.perf_counter() - t0}


def _status_mib(pid: int, key: str) -> float:
    try:
        for line in open(f"/proc/{pid}/status"):
            if line.startswith(key + ":"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def _descendants(pid: int) -> list[int]:
    out = []
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            for child in open(f"/proc/{pid}/task/{task}/children").read().split():
                out += [int(child)] + _descendants(int(child))
    except OSError:
        pass
    return out


def memory() -> dict:
    """Resident memory of this worker and its child processes (vLLM's engine core runs in one): now, at its
    peak (VmHWM, per process, summed), and the anonymous / file-backed split of this process."""
    pids = [os.getpid()] + _descendants(os.getpid())
    return {"rss_mib": sum(_status_mib(p, "VmRSS") for p in pids),
            "peak_rss_mib": sum(_status_mib(p, "VmHWM") for p in pids),
            "anon_mib": _status_mib(os.getpid(), "RssAnon"), "file_mib": _status_mib(os.getpid(), "RssFile"),
            "processes": len(pids)}


def serve(run, kv_capacity=None) -> None:
    """run(prompts, max_tokens) generates for a batch; answers commands until stdin closes. kv_capacity() ->
    (tokens, bytes per token) of the KV budget, where the worker can tell."""
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
            ps = prompts(1, cmd["prompt_len"], seed=cmd.get("seed", 0))
            out = {"ttft_s": _timed(lambda: run(ps, 1))}
        elif cmd["op"] == "multiturn":
            out = _multiturn(run, **{k: v for k, v in cmd.items() if k != "op"})
        elif cmd["op"] == "long_decode":
            out = _long_decode(run, **{k: v for k, v in cmd.items() if k != "op"})
        elif cmd["op"] == "kv_capacity":
            tokens, per_token = kv_capacity() if kv_capacity else (None, None)
            out = {"kv_tokens": tokens, "kv_bytes_per_token": per_token}
        elif cmd["op"] == "memory":
            out = memory()
        elif cmd["op"] == "shared_prefix":
            out = _shared_prefix(run, **{k: v for k, v in cmd.items() if k != "op"})
        else:
            out = {"error": f"unknown op {cmd['op']!r}"}
        print("RESULT " + json.dumps(out), flush=True)
