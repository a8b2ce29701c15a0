"""This engine, in-process (see common.py for the protocol).

    python -m bench.workers.engine_worker --checkpoint DIR [--kv-cache bf16|tq] [--prefix-caching]

Prefix caching is off unless asked for: the decode and TTFT groups repeat the same prompts, which a cache
would serve (vLLM's worker turns it off for the same reason).
"""
from __future__ import annotations

import itertools

from bench.workers.common import arg_parser, serve


def main() -> None:
    ap = arg_parser(__doc__)
    ap.add_argument("--kv-cache", default="bf16")
    ap.add_argument("--prefix-caching", action="store_true")
    args = ap.parse_args()
    from backend_lib.config import EngineConfig
    from backend_lib.engine import LLMEngine

    eng = LLMEngine(EngineConfig(checkpoint=args.checkpoint, kv_cache=args.kv_cache, kv_cache_memory="8GiB",
                                 max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len,
                                 max_num_batched_tokens=512, enable_prefix_caching=args.prefix_caching))
    ids = itertools.count()

    def run(batch_prompts, max_tokens):
        params = eng.make_params({"temperature": 0, "max_tokens": max_tokens, "ignore_eos": True})
        rids = [f"b{next(ids)}" for _ in batch_prompts]
        out: dict[str, list[int]] = {r: [] for r in rids}
        for r, p in zip(rids, batch_prompts):
            eng.add_request(r, p, params)
        while eng.has_unfinished():
            for o in eng.step():
                out[o.request_id] += o.new_token_ids
        return [out[r] for r in rids]

    serve(run)


if __name__ == "__main__":
    main()
