"""What the TurboQuant KV cache costs: TQ against the bf16 KV cache on the same tokens.

    python -m backend_lib.tools.kv_quality --checkpoint DIR [--text TEXT | --ids 1,2,3] [--budget 1GiB] [--json]

Prints the mean and max |delta log-prob| of every token, the perplexity with each cache, the
top-1 agreement of the next-token predictions, the KV bytes per token, and how many tokens fit
in the given memory budget with each cache.
"""
from __future__ import annotations

import argparse
import json
import math
import sys

from ..cli_common import add_engine_args, engine_config, parse_ids
from ..kv_cache import cache_class
from ..kv_cache.pool import parse_memory_budget

DEFAULT_TEXT = (
    "The Palace Museum in Beijing, the Forbidden City, was the imperial palace of the Ming and Qing dynasties. "
    "北京故宫是明清两代的皇家宫殿，旧称紫禁城，位于北京中轴线的中心。 "
    "def fibonacci(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a\n"
) * 4


def compare(checkpoint_args, ids: list[int], budget: str) -> dict:
    from ..engine import LLMEngine

    results = {}
    for kind in ("bf16", "tq"):
        cfg = engine_config(checkpoint_args, max_num_seqs=1, kv_cache=kind)
        eng = LLMEngine(cfg)
        lp, top1 = eng.score_detail(ids)
        mc = eng.model_config
        per_token = cache_class(kind).bytes_per_token(mc.num_layers, mc.num_kv_heads, mc.head_dim, eng.dtype)
        results[kind] = {"logprobs": lp, "top1": top1, "bytes_per_token": per_token}
        del eng
    b, t = results["bf16"], results["tq"]
    deltas = [abs(x - y) for x, y in zip(b["logprobs"][1:], t["logprobs"][1:])]
    ppl = {k: math.exp(-sum(r["logprobs"][1:]) / (len(ids) - 1)) for k, r in results.items()}
    agree = sum(x == y for x, y in zip(b["top1"][:-1], t["top1"][:-1])) / (len(ids) - 1)
    budget_bytes = parse_memory_budget(budget)
    if isinstance(budget_bytes, float):
        raise SystemExit("--budget must be a byte size here (e.g. 1GiB)")
    return {
        "tokens": len(ids),
        "mean_abs_delta_logprob": sum(deltas) / len(deltas),
        "max_abs_delta_logprob": max(deltas),
        "perplexity_bf16": ppl["bf16"], "perplexity_tq": ppl["tq"],
        "perplexity_change_pct": 100 * (ppl["tq"] / ppl["bf16"] - 1),
        "top1_agreement": agree,
        "kv_bytes_per_token_bf16": b["bytes_per_token"], "kv_bytes_per_token_tq": t["bytes_per_token"],
        "budget_bytes": budget_bytes,
        "tokens_in_budget_bf16": budget_bytes // b["bytes_per_token"],
        "tokens_in_budget_tq": budget_bytes // t["bytes_per_token"],
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_engine_args(ap)
    src = ap.add_mutually_exclusive_group()
    src.add_argument("--text")
    src.add_argument("--ids")
    ap.add_argument("--budget", default="1GiB", help="memory budget for the tokens-that-fit figure")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    if args.ids:
        ids = parse_ids(args.ids)
    else:
        from ..tokenizer import Tokenizer

        ids = Tokenizer(args.tokenizer or args.checkpoint).encode(args.text or DEFAULT_TEXT)
    if len(ids) < 2:
        print("error: need at least two tokens", file=sys.stderr)
        return 2
    if args.max_model_len is None:
        args.max_model_len = max(len(ids) + 1, 256)
    r = compare(args, ids, args.budget)
    if args.json:
        print(json.dumps(r))
        return 0
    print(f"tokens scored                {r['tokens']}")
    print(f"mean |delta logprob|         {r['mean_abs_delta_logprob']:.4f}   (max {r['max_abs_delta_logprob']:.4f})")
    print(f"perplexity bf16 / tq         {r['perplexity_bf16']:.4f} / {r['perplexity_tq']:.4f}   "
          f"({r['perplexity_change_pct']:+.2f} %)")
    print(f"top-1 agreement              {100 * r['top1_agreement']:.1f} %")
    print(f"KV bytes per token bf16 / tq {r['kv_bytes_per_token_bf16']} / {r['kv_bytes_per_token_tq']}   "
          f"({r['kv_bytes_per_token_bf16'] / r['kv_bytes_per_token_tq']:.2f}x less)")
    print(f"tokens in {args.budget:<8s}          {r['tokens_in_budget_bf16']} / {r['tokens_in_budget_tq']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
