"""python -m openai_frontend [--triton-url localhost:8001] [--host 127.0.0.1] [--port 9000] [--api-key KEY]
[--reasoning-parser qwen3|none] [--responses-store-count N] [--responses-store-mib MIB]"""
from __future__ import annotations

import argparse
import os
import sys

import uvicorn

from .app import create_app
from .responses_store import DEFAULT_MAX_BYTES, DEFAULT_MAX_RESPONSES, ResponseStore


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m openai_frontend",
                                 description="OpenAI-compatible HTTP front over the Triton LLM models.")
    ap.add_argument("--triton-url", default="localhost:8001", help="Triton gRPC endpoint")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=9000)
    ap.add_argument("--api-key", default=os.environ.get("QWEN3_API_KEY") or None,
                    help="require 'Authorization: Bearer KEY' on /v1/* (default: $QWEN3_API_KEY)")
    ap.add_argument("--tokenizer", default=None,
                    help="tokenizer folder for logprob token strings (default: 'token_id:<id>')")
    ap.add_argument("--reasoning-parser", default="qwen3", choices=["qwen3", "none"],
                    help="qwen3: the think block becomes reasoning_content; none: raw text as content")
    ap.add_argument("--responses-store-count", type=int, default=DEFAULT_MAX_RESPONSES,
                    help="/v1/responses: most responses kept for GET and previous_response_id (oldest evicted)")
    ap.add_argument("--responses-store-mib", type=float, default=DEFAULT_MAX_BYTES / 2**20,
                    help="/v1/responses: most MiB of stored responses (oldest evicted)")
    ap.add_argument("--log-level", default="info")
    args = ap.parse_args(argv)
    tokenizer = None
    if args.tokenizer:
        from backend_lib.tokenizer import Tokenizer

        tokenizer = Tokenizer(args.tokenizer)
    if args.responses_store_count < 0 or args.responses_store_mib < 0:
        ap.error("--responses-store-count and --responses-store-mib must be >= 0")
    store = ResponseStore(args.responses_store_count, int(args.responses_store_mib * 2**20))
    app = create_app(args.triton_url, api_key=args.api_key, tokenizer=tokenizer,
                     reasoning=args.reasoning_parser == "qwen3", responses_store=store)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
    return 0


if __name__ == "__main__":
    sys.exit(main())
