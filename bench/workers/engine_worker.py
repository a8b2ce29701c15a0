"""This engine, in-process (see common.py for the protocol).

    python -m bench.workers.engine_worker --checkpoint DIR [--kv-cache bf16|tq]
"""
from __future__ import annotations

import itertools

from bench.workers.common import arg_parser, serve


def main() -> None:
    ap = arg_parser(__doc__)
    ap.add_argument("--kv-cache", default="bf16")
    args = ap.parse_args()
    from backend_lib.config import EngineConfig
    from backend_lib.engine import LLMEngine

    eng = LLMEngine(EngineConfig(checkpoint=args.checkpoint, kv_cache=args.kv_cache, kv_cache_memory="8GiB",
                                 max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len,
                                 max_num_batched_tokens=512))
    ids = itertools.count()

    def run(batch_prompts, max_tokens):
        params = eng.make_params({"temperature": 0, "max_tokens": max_tokens, "ignore_eos": True})
        for p in batch_prompts:
            eng.add_request(f"b{next(ids)}", p, params)
        while eng.has_unfinished():
            eng.step()

    serve(run)


if __name__ == "__main__":
    main()
