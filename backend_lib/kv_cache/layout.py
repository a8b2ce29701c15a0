"""Page layout of the paged KV caches: keys are stored in blocks of KW keys, transposed, so a vector
holds one dimension of consecutive keys (dense K [P, KVH, S/KW, D, KW]; TurboQuant K codes likewise)."""
from __future__ import annotations

import torch


def key_block_width(page_size: int) -> int:
    return 32 if page_size % 32 == 0 else 16


def key_blocks_to_rows(k_cache: torch.Tensor) -> torch.Tensor:
    """[P, KVH, S/KW, X, KW] blocked keys -> [P, KVH, S, X] rows (a copy)."""
    p, h, nb, x, kw = k_cache.shape
    return k_cache.permute(0, 1, 2, 4, 3).reshape(p, h, nb * kw, x)


def blocked_kv_shapes(num_pages: int, page_size: int, num_kv_heads: int, head_dim: int):
    """(K shape, V shape) of one layer's dense cache in this layout: the reference, CPU and Triton sets'."""
    kw = key_block_width(page_size)
    return (num_pages, num_kv_heads, page_size // kw, head_dim, kw), (num_pages, num_kv_heads, page_size, head_dim)
