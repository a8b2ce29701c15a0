"""Generate text from a checkpoint, streaming to the terminal.

    python -m backend_lib.generate --checkpoint DIR (--prompt TEXT | --prompt-ids 1,2,3) [--max-tokens N]
        [--temperature T] [--top-p P] [--top-k K] [--seed S] [--ignore-eos] [--dtype bfloat16|float32]
        [--kv-cache bf16|tq] [--page-size N] [--device D] [--chat] [--json]

With --json the last stdout line is one JSON object: output_ids, text, finish_reason, and counts.
Sampling defaults come from the checkpoint's generation_config.json; --temperature 0 is greedy.
"""
from __future__ import annotations

import argparse
import json
import sys
import time

from .cli_common import add_engine_args, engine_config, parse_ids
from .contract.errors import RequestError


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_engine_args(ap)
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt")
    src.add_argument("--prompt-ids")
    ap.add_argument("--chat", action="store_true", help="wrap --prompt as a user message in the chat template")
    ap.add_argument("--no-thinking", action="store_true", help="with --chat: enable_thinking=false")
    ap.add_argument("--max-tokens", type=int, default=None)
    ap.add_argument("--min-tokens", type=int, default=None)
    ap.add_argument("--temperature", type=float, default=None)
    ap.add_argument("--top-p", type=float, default=None)
    ap.add_argument("--top-k", type=int, default=None)
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    ap.add_argument("--ignore-eos", action="store_true")
    ap.add_argument("--json", action="store_true", help="print a JSON summary as the last stdout line")
    args = ap.parse_args(argv)

    from .engine import LLMEngine

    engine = LLMEngine(engine_config(args, max_num_seqs=1))
    tok = engine.tokenizer
    if args.prompt_ids is not None:
        prompt_ids = parse_ids(args.prompt_ids)
    elif args.chat:
        text = tok.apply_chat_template([{"role": "user", "content": args.prompt}], add_generation_prompt=True,
                                       enable_thinking=not args.no_thinking)
        prompt_ids = tok.encode(text)
    else:
        prompt_ids = tok.encode(args.prompt)
    fields = {"max_tokens": args.max_tokens, "min_tokens": args.min_tokens, "temperature": args.temperature,
              "top_p": args.top_p, "top_k": args.top_k, "seed": args.seed, "stop": args.stop,
              "ignore_eos": args.ignore_eos or None}
    try:
        params = engine.make_params({k: v for k, v in fields.items() if v is not None})
        engine.add_request("cli", prompt_ids, params)
    except RequestError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    out_ids, text, reason = [], [], None
    t0 = time.perf_counter()
    t_first = None
    while reason is None:
        for out in engine.step():
            if t_first is None and out.new_token_ids:
                t_first = time.perf_counter()
            out_ids += out.new_token_ids
            text.append(out.new_text)
            if not args.json:
                sys.stdout.write(out.new_text)
                sys.stdout.flush()
            if out.finished:
                reason = out.finish_reason
    t1 = time.perf_counter()
    decode_tps = (len(out_ids) - 1) / (t1 - t_first) if t_first and len(out_ids) > 1 and t1 > t_first else None
    if args.json:
        print(json.dumps({"output_ids": out_ids, "text": "".join(text), "finish_reason": reason,
                          "prompt_ids": prompt_ids, "num_prompt_tokens": len(prompt_ids),
                          "num_output_tokens": len(out_ids), "time_to_first_token_s": (t_first or t1) - t0,
                          "decode_tokens_per_s": decode_tps,
                          "prefix_cache_hits": engine.stats.prefix_cache_hits}, ensure_ascii=False))
    else:
        sys.stdout.write("\n")
        print(f"[{len(out_ids)} tokens, finish_reason={reason}, ttft {((t_first or t1) - t0) * 1000:.0f} ms"
              + (f", {decode_tps:.1f} tokens/s" if decode_tps else "") + "]", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
