"""Arguments shared by the command-line tools (checkpoint, dtype, KV cache, device).

Defaults are EngineConfig's (an option left out is not passed), so the CLIs, the Triton models and
the bench never disagree about them.
"""
from __future__ import annotations

import argparse
import logging

from .config import GREEDY_HEADS, LM_HEAD_QUANTS, EngineConfig
from .layers.linear import INT4_ACTIVATIONS
from .layers.moe import MOE_EXPERTS_QUANTS
from .kernels import KERNEL_BACKENDS
from .kv_cache import KV_CACHE_KINDS


def add_engine_args(ap: argparse.ArgumentParser) -> None:
    d = EngineConfig(checkpoint="-")
    ap.add_argument("--checkpoint", required=True,
                    help="checkpoint folder (config.json, safetensors, tokenizer) or Hugging Face id org/name[@revision]")
    ap.add_argument("--tokenizer", help="tokenizer folder or Hugging Face id (default: the checkpoint)")
    ap.add_argument("--dtype", choices=["bfloat16", "float32", "float16"], help=f"default {d.dtype}")
    ap.add_argument("--kv-cache", choices=list(KV_CACHE_KINDS), help=f"default {d.kv_cache}")
    ap.add_argument("--page-size", type=int, help=f"default {d.page_size}")
    ap.add_argument("--device", help=f"default {d.device}")
    ap.add_argument("--max-model-len", type=int, help="default: the checkpoint's, capped by the KV budget")
    ap.add_argument("--kv-cache-memory", help=f"default {d.kv_cache_memory}")
    ap.add_argument("--kernels", choices=list(KERNEL_BACKENDS), help=f"default {d.kernels}")
    ap.add_argument("--lm-head-quant", choices=list(LM_HEAD_QUANTS), help=f"default {d.lm_head_quant}")
    ap.add_argument("--moe-experts-quant", choices=list(MOE_EXPERTS_QUANTS), help=f"default {d.moe_experts_quant}")
    ap.add_argument("--int4-activations", choices=list(INT4_ACTIVATIONS), help=f"default {d.int4_activations}")
    ap.add_argument("--greedy-head", choices=list(GREEDY_HEADS), help=f"default {d.greedy_head}")
    ap.add_argument("-v", "--verbose", action="store_true", help="log loading progress to stderr")


def engine_config(args, **overrides) -> EngineConfig:
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(asctime)s %(name)s: %(message)s")
    fields = dict(checkpoint=args.checkpoint, tokenizer=args.tokenizer, dtype=args.dtype, kv_cache=args.kv_cache,
                  page_size=args.page_size, device=args.device, max_model_len=args.max_model_len,
                  kv_cache_memory=args.kv_cache_memory, kernels=args.kernels, lm_head_quant=args.lm_head_quant,
                  greedy_head=args.greedy_head, moe_experts_quant=args.moe_experts_quant,
                  int4_activations=args.int4_activations)
    fields.update(overrides)
    return EngineConfig(**{k: v for k, v in fields.items() if v is not None}).resolve_locations()


def parse_ids(text: str) -> list[int]:
    try:
        return [int(t) for t in text.replace(" ", "").split(",") if t]
    except ValueError:
        raise SystemExit(f"error: ids must be comma-separated integers, got {text!r}") from None
