"""Sizes the KV page pool from a memory budget and allocates it, halving on allocation failure."""
from __future__ import annotations

import gc
import logging
import re

import torch

from ..device import free_memory_bytes
from . import dense, turboquant  # noqa: F401 (each registers its cache kind)
from .base import KV_CACHES, cache_class

log = logging.getLogger(__name__)

KV_CACHE_KINDS = tuple(KV_CACHES)
_UNITS = {"": 1, "b": 1, "k": 2**10, "kb": 10**3, "kib": 2**10, "m": 2**20, "mb": 10**6, "mib": 2**20,
          "g": 2**30, "gb": 10**9, "gib": 2**30}


def parse_memory_budget(value) -> float | int:
    """'2GiB', '512MB', 1073741824 (bytes) or a fraction of free memory in (0, 1] such as 0.3."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        num, unit = float(value), ""
    else:
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(value))
        if not m or m.group(2).lower() not in _UNITS:
            raise ValueError(f"kv_cache_memory: {value!r} is neither a byte size (e.g. 2GiB) nor a fraction (e.g. 0.3)")
        num, unit = float(m.group(1)), m.group(2).lower()
    if num <= 0:
        raise ValueError(f"kv_cache_memory: must be positive, got {value!r}")
    if unit == "" and num <= 1.0:
        return num  # fraction
    return int(num * _UNITS[unit])


def budget_bytes(budget, device: torch.device) -> int:
    budget = parse_memory_budget(budget)
    return int(budget * free_memory_bytes(device)) if isinstance(budget, float) else budget


def pool_token_capacity(kind: str, model_cfg, dtype: torch.dtype, device: torch.device, budget,
                        page_size: int) -> int:
    """Tokens (whole pages) that the budget holds: the default max_model_len is capped by it."""
    per_token = cache_class(kind).bytes_per_token(model_cfg.num_layers, model_cfg.num_kv_heads, model_cfg.head_dim,
                                                  dtype)
    return budget_bytes(budget, device) // (per_token * page_size) * page_size


def allocate_kv_cache(kind: str, model_cfg, dtype: torch.dtype, device: torch.device, kernels, budget,
                      page_size: int, max_model_len: int, max_num_seqs: int, nbytes: int | None = None,
                      **cache_kwargs):
    """The pool: `nbytes` when given (sized after warm-up, engine/warmup.py), else the budget's bytes."""
    cls = cache_class(kind)
    per_token = cls.bytes_per_token(model_cfg.num_layers, model_cfg.num_kv_heads, model_cfg.head_dim, dtype)
    per_page = per_token * page_size
    nbytes = budget_bytes(budget, device) if nbytes is None else nbytes
    floor = -(-max_model_len // page_size)
    useful = max_num_seqs * floor
    pages = min(nbytes // per_page, useful)
    if pages < floor:
        raise ValueError(
            f"kv_cache_memory: {nbytes / 2**20:.1f} MiB holds {nbytes // per_page} pages of "
            f"{page_size} tokens, but one max_model_len={max_model_len} sequence needs {floor}; "
            "raise kv_cache_memory or lower max_model_len")
    while True:
        try:
            cache = cls(model_cfg.num_layers, pages, page_size, model_cfg.num_kv_heads, model_cfg.head_dim,
                        dtype, device, kernels, **cache_kwargs)
            break
        except (RuntimeError, MemoryError) as exc:
            cache = None
            gc.collect()
            if pages <= floor:
                raise RuntimeError(f"KV cache: could not allocate even {pages} pages ({exc})") from exc
            log.warning("KV cache: allocating %d pages failed (%s); retrying with %d", pages, exc,
                        max(floor, pages // 2))
            pages = max(floor, pages // 2)
    log.info("KV cache %s: %d pages x %d tokens = %d tokens, %.1f MiB (%d bytes/token)", kind, pages, page_size,
             pages * page_size, pages * per_page / 2**20, per_token)
    return cache
