"""This engine, in-process: decode tokens/s, time to first token, long-context decode.

    python -m bench.workers.engine_worker --checkpoint DIR --kv-cache bf16|tq --mode decode|ttft|long ...
"""
from __future__ import annotations

import argparse
import itertools
import statistics

from bench.workers.common import decode_rate, emit, prompts, timed


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--checkpoint", required=True)
    ap.add_argument("--kv-cache", default="bf16")
    ap.add_argument("--mode", choices=["decode", "ttft", "long"], required=True)
    ap.add_argument("--batches", default="1,8,16")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()

    from backend_lib.config import EngineConfig
    from backend_lib.engine import LLMEngine

    batches = [int(b) for b in args.batches.split(",")]
    max_len = args.prompt_len + args.new_tokens + 8
    eng = LLMEngine(EngineConfig(checkpoint=args.checkpoint, kv_cache=args.kv_cache, kv_cache_memory="6GiB",
                                 max_num_seqs=max(batches), max_model_len=max(max_len, 256),
                                 max_num_batched_tokens=max(512, max(batches))))
    ids = itertools.count()

    def run(batch_prompts, max_tokens):
        params = eng.make_params({"temperature": 0, "max_tokens": max_tokens, "ignore_eos": True})
        for p in batch_prompts:
            eng.add_request(f"b{next(ids)}", p, params)
        while eng.has_unfinished():
            eng.step()

    if args.mode in ("decode", "long"):
        for b in batches:
            ps = prompts(b, args.prompt_len)
            r = decode_rate(lambda n: run(ps, n), b, args.new_tokens, args.repeats)
            emit({"mode": args.mode, "kv_cache": args.kv_cache, "prompt_len": args.prompt_len, **r})
    else:
        ps = prompts(1, args.prompt_len)
        run(ps, 1)
        t = statistics.median(timed(lambda: run(ps, 1), args.repeats))
        emit({"mode": "ttft", "kv_cache": args.kv_cache, "prompt_len": args.prompt_len, "ttft_s": t})


if __name__ == "__main__":
    main()
