"""Co-tenancy: the two LLM models of one tritonserver busy at once, and an engine beside a CPU-bound process.

    python -m bench.cotenancy [--size 0.6b|tiny] [--concurrency 4] [--tokens 96] [--policy default,static,shared]

1. Through tritonserver (both LLM models loaded, client.loadgen, 128-token prompts): output tokens/s of
   qwen3_a8w8 alone, of qwen3_tq alone, and of both at once. Fair time-sharing of the cores gives
   (solo_a + solo_b) / 2 in total; the figure is total / that. `--policy default` is the launcher's
   work-conserving share (a model busy alone on every core, busy ones splitting them), `static` its fixed
   split (each model its part of the cores, busy or not), `shared` every model on every core (the layout
   before the policy, with libgomp's own spin) for comparison.
2. In-process engine decode (batch 4) alone and beside a process that keeps one core busy: with 2 cores
   its share is half, so the ratio should be at least 0.5.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import tempfile
import time
from pathlib import Path

from bench.run import decode_rate, ensure_checkpoints
from bench.workers.common import prompts
from client.loadgen import run_load
from harness.triton_server import TritonServer, make_repository


def _load(url: str, model: str, concurrency: int, tokens: int) -> dict:
    reqs = [{"input_ids": p, "stream": True, "max_tokens": tokens,
             "sampling_parameters": {"temperature": 0, "ignore_eos": True}} for p in prompts(concurrency * 2, 128)]
    return asyncio.run(run_load(url, model, concurrency, reqs))


def _both(url: str, concurrency: int, tokens: int) -> dict:
    async def go():
        def reqs(seed):
            return [{"input_ids": p, "stream": True, "max_tokens": tokens,
                     "sampling_parameters": {"temperature": 0, "ignore_eos": True}}
                    for p in prompts(concurrency * 2, 128, seed=seed)]
        a, b = await asyncio.gather(run_load(url, "qwen3_a8w8", concurrency, reqs(1)),
                                    run_load(url, "qwen3_tq", concurrency, reqs(2)))
        return {"qwen3_a8w8": a, "qwen3_tq": b}
    return asyncio.run(go())


def server_case(ck: dict, policy: str, concurrency: int, tokens: int, out: Path) -> dict:
    engine = {"kv_cache_memory": "1GiB", "max_model_len": "1100", "max_num_seqs": "16"}
    repo = make_repository(out / f"models-{policy}", {
        "qwen3_a8w8": {**engine, "checkpoint": str(ck["a8w8"])},
        "qwen3_tq": {**engine, "checkpoint": str(ck["a8w8"]), "kv_cache": "tq"}})
    env = {"default": {}, "static": {"QWEN3_CPU_PARTITION": "static"},
           "shared": {"QWEN3_CPU_PARTITION": "off", "GOMP_SPINCOUNT": "300000"}}[policy]
    server = TritonServer(repo, out / f"tritonserver-{policy}.log", env=env).start(timeout=900)
    try:
        for m in ("qwen3_a8w8", "qwen3_tq"):
            _load(server.grpc_url, m, 1, 2)   # warm-up
        solo = {m: _load(server.grpc_url, m, concurrency, tokens)["output_tokens_per_s"]
                for m in ("qwen3_a8w8", "qwen3_tq")}
        both = {m: r["output_tokens_per_s"] for m, r in _both(server.grpc_url, concurrency, tokens).items()}
    finally:
        server.stop()
    fair = sum(solo.values()) / 2
    return {"policy": policy, "solo_tok_s": solo, "both_tok_s": both, "both_total_tok_s": sum(both.values()),
            "fair_share_tok_s": fair, "total_vs_fair": sum(both.values()) / fair}


def _burn(stop) -> None:
    x = 0
    while not stop.is_set():
        for _ in range(100_000):
            x += 1


def neighbour_case(ck: dict, tokens: int) -> dict:
    from backend_lib.config import EngineConfig
    from backend_lib.engine import LLMEngine

    eng = LLMEngine(EngineConfig(checkpoint=str(ck["a8w8"]), kv_cache_memory="1GiB", max_model_len=1100,
                                 max_num_seqs=8))

    def rate() -> float:
        ps = prompts(4, 128)

        def run(n):
            t = time.perf_counter()
            eng.generate(ps, eng.make_params({"temperature": 0, "max_tokens": n, "ignore_eos": True}))
            return time.perf_counter() - t
        return decode_rate(4, tokens, run(tokens), run(1))

    rate()
    alone = rate()
    stop = multiprocessing.Event()
    burner = multiprocessing.Process(target=_burn, args=(stop,), daemon=True)
    burner.start()
    try:
        time.sleep(0.5)
        beside = rate()
    finally:
        stop.set()
        burner.join(5)
    cores = len(os.sched_getaffinity(0))
    return {"decode_tok_s_alone": alone, "decode_tok_s_beside_a_busy_process": beside, "ratio": beside / alone,
            "fair_share": (cores - 1) / cores if cores > 1 else 0.5}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="0.6b", choices=["0.6b", "tiny"])
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--policy", default="default,shared", help="comma list of: default, static, shared")
    ap.add_argument("--skip-neighbour", action="store_true")
    args = ap.parse_args()
    ck = ensure_checkpoints(args.size)
    out = Path(tempfile.mkdtemp(prefix="cotenancy-"))
    results = {"size": args.size, "concurrency": args.concurrency, "tokens": args.tokens, "cases": []}
    for policy in filter(None, args.policy.split(",")):
        r = server_case(ck, policy, args.concurrency, args.tokens, out)
        results["cases"].append(r)
        print(f"{policy:>8}: solo {r['solo_tok_s']['qwen3_a8w8']:.1f} + {r['solo_tok_s']['qwen3_tq']:.1f} tok/s; both "
              f"busy {r['both_tok_s']['qwen3_a8w8']:.1f} + {r['both_tok_s']['qwen3_tq']:.1f} = "
              f"{r['both_total_tok_s']:.1f} ({r['total_vs_fair']:.2f}x fair time-sharing)", flush=True)
    if not args.skip_neighbour:
        n = neighbour_case(ck, args.tokens)
        results["neighbour"] = n
        print(f"engine decode beside a busy process: {n['decode_tok_s_beside_a_busy_process']:.1f} vs "
              f"{n['decode_tok_s_alone']:.1f} tok/s alone ({n['ratio']:.2f}; its fair share {n['fair_share']:.2f})")
    print(json.dumps(results))


if __name__ == "__main__":
    main()
