"""transformers `generate` (the baseline): decode tokens/s and time to first token.

    python -m bench.workers.hf_worker --checkpoint DIR --mode decode|ttft [--batches 1,8,16]
"""
from __future__ import annotations

import argparse
import statistics

from bench.workers.common import decode_rate, emit, prompts, timed


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--checkpoint", required=True)
    ap.add_argument("--mode", choices=["decode", "ttft"], required=True)
    ap.add_argument("--batches", default="1,8,16")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(args.checkpoint, dtype=torch.bfloat16).eval()

    def run(batch_prompts, max_tokens):
        x = torch.tensor(batch_prompts)
        with torch.inference_mode():
            model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=max_tokens, min_new_tokens=max_tokens,
                           do_sample=False, pad_token_id=0)

    if args.mode == "decode":
        for b in [int(v) for v in args.batches.split(",")]:
            ps = prompts(b, args.prompt_len)
            emit({"mode": "decode", "prompt_len": args.prompt_len,
                  **decode_rate(lambda n: run(ps, n), b, args.new_tokens, args.repeats)})
    else:
        ps = prompts(1, args.prompt_len)
        run(ps, 1)
        emit({"mode": "ttft", "prompt_len": args.prompt_len,
              "ttft_s": statistics.median(timed(lambda: run(ps, 1), args.repeats))})


if __name__ == "__main__":
    main()
