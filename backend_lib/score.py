"""Score a text: the log-probability of every token given those before it, and the perplexity.

    python -m backend_lib.score --checkpoint DIR (--text TEXT | --ids 1,2,3) [--dtype ...] [--kv-cache bf16|tq]
        [--json]

The tool that measures what each quantization costs: run it on the same ids with different
checkpoints (bf16 vs A8W8) or KV caches (bf16 vs tq) and compare. `logprobs` is a list whose
first entry is null (the first token has no context).
"""
from __future__ import annotations

import argparse
import json
import math
import sys

from .cli_common import add_engine_args, engine_config, parse_ids


def perplexity(logprobs: list[float | None]) -> float:
    vals = [lp for lp in logprobs if lp is not None]
    return math.exp(-sum(vals) / len(vals)) if vals else float("nan")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_engine_args(ap)
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--text")
    src.add_argument("--ids")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)

    from .engine import LLMEngine

    engine = LLMEngine(engine_config(args, max_num_seqs=1))
    ids = parse_ids(args.ids) if args.ids is not None else engine.tokenizer.encode(args.text)
    if len(ids) < 2:
        print("error: need at least two tokens to score", file=sys.stderr)
        return 2
    logprobs = engine.score(ids)
    ppl = perplexity(logprobs)
    if args.json:
        print(json.dumps({"ids": ids, "logprobs": logprobs, "perplexity": ppl}))
    else:
        for i, (t, lp) in enumerate(zip(ids, logprobs)):
            piece = engine.tokenizer.decode([t], skip_special_tokens=False)
            print(f"{i:5d} {t:7d} {'' if lp is None else f'{lp:10.4f}'} {piece!r}")
        print(f"perplexity {ppl:.4f} over {len(ids) - 1} tokens")
    return 0


if __name__ == "__main__":
    sys.exit(main())
