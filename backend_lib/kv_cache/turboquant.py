"""TurboQuant 4-bit paged KV cache (MSE variant): nibble codes + one fp32 scale per row.

K (after q/k-norm and RoPE) and V rows are normalized, rotated by a per-layer seeded orthogonal
matrix R_l, and each coordinate is replaced by the nearest of 16 Lloyd-Max centroids of
N(0, 1/head_dim). Attention never goes back to the original space: queries are rotated once,
scored against the codes, values are accumulated in the rotated space and the output is
de-rotated once per head and step. 68 bytes per token per KV head at head_dim 128 (bf16: 256).
"""
from __future__ import annotations

import torch

from .base import register_kv_cache
from .layout import key_block_width
from .metadata import AttentionMetadata
from .tq_codec import tq_codebook, tq_layer_seed, tq_rotation


@register_kv_cache("tq")
class TurboQuantKVCache:
    def __init__(self, num_layers: int, num_pages: int, page_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device, kernels, seed: int = 0):
        if head_dim % 2:
            raise ValueError(f"kv_cache tq: head_dim must be even, got {head_dim}")
        self.num_pages, self.page_size, self.kernels = num_pages, page_size, kernels
        self.seed = seed
        self.content_key = f"tq:{seed}"       # the rotations follow the seed
        self.centroids, self.boundaries = tq_codebook(head_dim, device)
        self.rotations = [tq_rotation(head_dim, tq_layer_seed(seed, i)).to(device) for i in range(num_layers)]
        # K codes blocked and transposed within a page like the dense K (byte c of consecutive keys
        # adjacent), V codes row by row
        kw = key_block_width(page_size)
        k_codes = (num_pages, num_kv_heads, page_size // kw, head_dim // 2, kw)
        v_codes = (num_pages, num_kv_heads, page_size, head_dim // 2)
        scales = (num_pages, num_kv_heads, page_size)
        self.k_codes = [kernels.zeros(k_codes, torch.uint8, device) for _ in range(num_layers)]
        self.v_codes = [kernels.zeros(v_codes, torch.uint8, device) for _ in range(num_layers)]
        self.k_scales = [kernels.zeros(scales, torch.float32, device) for _ in range(num_layers)]
        self.v_scales = [kernels.zeros(scales, torch.float32, device) for _ in range(num_layers)]

    @staticmethod
    def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * num_layers * num_kv_heads * (head_dim // 2 + 4)

    def copy_page(self, src: int, dst: int) -> None:
        """Copies page src's contents into page dst in every layer (a prompt's partial last page, taken by copy)."""
        for t in self.k_codes + self.v_codes + self.k_scales + self.v_scales:
            t[dst].copy_(t[src])

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata) -> None:
        self.kernels.tq_write(k, v, self.k_codes[layer], self.k_scales[layer], self.v_codes[layer],
                              self.v_scales[layer], meta.slot_mapping, self.rotations[layer], self.centroids,
                              self.boundaries)

    def attend(self, layer: int, q: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        return self.kernels.tq_paged_attention(q, self.k_codes[layer], self.k_scales[layer], self.v_codes[layer],
                                               self.v_scales[layer], meta.block_tables, meta.query_start_loc,
                                               meta.seq_lens, self.rotations[layer], self.centroids, scale)
