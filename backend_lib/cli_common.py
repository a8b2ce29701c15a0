"""Arguments shared by the command-line tools (checkpoint, dtype, KV cache, device)."""
from __future__ import annotations

import argparse
import logging

from .config import EngineConfig


def add_engine_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--checkpoint", required=True, help="checkpoint folder (config.json, safetensors, tokenizer)")
    ap.add_argument("--tokenizer", default=None, help="tokenizer folder (default: the checkpoint)")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32", "float16"])
    ap.add_argument("--kv-cache", default="bf16", choices=["bf16", "tq"])
    ap.add_argument("--page-size", type=int, default=128)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--max-model-len", type=int, default=None)
    ap.add_argument("--kv-cache-memory", default="1GiB")
    ap.add_argument("--kernels", default="auto", choices=["auto", "reference", "cpu"])
    ap.add_argument("-v", "--verbose", action="store_true", help="log loading progress to stderr")


def engine_config(args, **overrides) -> EngineConfig:
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(asctime)s %(name)s: %(message)s")
    fields = dict(checkpoint=args.checkpoint, tokenizer=args.tokenizer, dtype=args.dtype, kv_cache=args.kv_cache,
                  page_size=args.page_size, device=args.device, max_model_len=args.max_model_len,
                  kv_cache_memory=args.kv_cache_memory, kernels=args.kernels)
    fields.update(overrides)
    return EngineConfig(**fields)


def parse_ids(text: str) -> list[int]:
    try:
        return [int(t) for t in text.replace(" ", "").split(",") if t]
    except ValueError:
        raise SystemExit(f"error: ids must be comma-separated integers, got {text!r}") from None
