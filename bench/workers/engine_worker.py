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
    ap.add_argument("--kv-cache-memory", default="8GiB")
    ap.add_argument("--lm-head-quant", default="checkpoint")
    ap.add_argument("--moe-experts-quant", default="checkpoint")
    ap.add_argument("--int4-activations", default="checkpoint")
    args = ap.parse_args()
    from backend_lib.config import EngineConfig
    from backend_lib.engine import LLMEngine

    eng = LLMEngine(EngineConfig(checkpoint=args.checkpoint, kv_cache=args.kv_cache,
                                 kv_cache_memory=args.kv_cache_memory, max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len,
                                 max_num_batched_tokens=512, enable_prefix_caching=args.prefix_caching,
                                 lm_head_quant=args.lm_head_quant, moe_experts_quant=args.moe_experts_quant,
                                 int4_activations=args.int4_activations))
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

    def kv_capacity():
        """Tokens the KV budget holds (the pool itself is capped at max_num_seqs x max_model_len)."""
        from backend_lib.kv_cache.base import cache_class
        from backend_lib.kv_cache.pool import budget_bytes

        mc = eng.model_config
        per_token = cache_class(args.kv_cache).bytes_per_token(mc.num_layers, mc.num_kv_heads, mc.head_dim, eng.dtype)
        return budget_bytes(args.kv_cache_memory, eng.device) // per_token, per_token

    serve(run, kv_capacity)


if __name__ == "__main__":
    main()
