"""This engine, in-process: decode tokens/s, time to first token, long-context decode.

    python -m bench.workers.engine_worker --checkpoint DIR --kv-cache bf16|tq --mode decode|ttft|long ...
"""
from __future__ import annotations

import itertools

from bench.workers.common import arg_parser, measure


def main() -> None:
    ap = arg_parser(__doc__, modes=("decode", "ttft", "long"))
    ap.add_argument("--kv-cache", default="bf16")
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

    measure(args, run, kv_cache=args.kv_cache)


if __name__ == "__main__":
    main()
