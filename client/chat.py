"""A terminal chat over the tokenizer -> LLM ensemble, streaming each reply as it is generated.

    python -m client.chat [--model qwen3_a8w8_ensemble] [--no-thinking] [--system "..."] [--url localhost:8001]

The conversation is kept client-side and sent as `messages`; the tokenizer model renders it with
the checkpoint's Qwen3 chat template. Type /reset to start over, Ctrl-D to quit.
"""
from __future__ import annotations

import argparse
import sys

from .stream import stream_generate


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen3_a8w8_ensemble")
    ap.add_argument("--url", default="localhost:8001")
    ap.add_argument("--system", default=None)
    ap.add_argument("--no-thinking", action="store_true", help="enable_thinking=false in the chat template")
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--temperature", type=float, default=None)
    args = ap.parse_args(argv)
    history = [{"role": "system", "content": args.system}] if args.system else []
    sampling = {"temperature": args.temperature} if args.temperature is not None else None
    while True:
        try:
            user = input("you> ")
        except EOFError:
            print()
            return 0
        if user.strip() == "/reset":
            history = history[:1] if args.system else []
            continue
        if not user.strip():
            continue
        history.append({"role": "user", "content": user})
        sys.stdout.write("qwen> ")
        try:
            res = stream_generate(args.url, args.model, messages=history, enable_thinking=not args.no_thinking,
                                  max_tokens=args.max_tokens, sampling_parameters=sampling,
                                  on_text=lambda t: (sys.stdout.write(t), sys.stdout.flush()))
        except Exception as exc:
            print(f"\nerror: {exc}", file=sys.stderr)
            history.pop()
            continue
        print(f"\n[{len(res['output_ids'])} tokens, {res['finish_reason']}]")
        history.append({"role": "assistant", "content": res["text"]})


if __name__ == "__main__":
    sys.exit(main())
