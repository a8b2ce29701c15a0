"""The unquantized paged KV cache in the model dtype, in the kernel set's layout (`Kernels.kv_shapes`): by default
K [pages, kv_heads, page_size / KW, head_dim, KW] (blocks of KW keys, transposed, so a vector holds one dimension
of consecutive keys), V [pages, kv_heads, page_size, head_dim]."""
from __future__ import annotations

import torch

from .base import register_kv_cache
from .metadata import AttentionMetadata


@register_kv_cache("bf16")
class DenseKVCache:
    def __init__(self, num_layers: int, num_pages: int, page_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device, kernels, seed: int = 0):
        self.num_pages, self.page_size = num_pages, page_size
        self.kernels = kernels
        self.content_key = f"dense:{dtype}"   # nothing random: seed is not used
        k_shape, v_shape = kernels.kv_shapes(num_pages, page_size, num_kv_heads, head_dim)   # the set's layout
        self.k = [kernels.zeros(k_shape, dtype, device) for _ in range(num_layers)]   # huge pages on the CPU
        self.v = [kernels.zeros(v_shape, dtype, device) for _ in range(num_layers)]

    @staticmethod
    def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * num_layers * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()

    def copy_page(self, src: int, dst: int) -> None:
        """Copies page src's contents into page dst in every layer (a prompt's partial last page, taken by copy)."""
        for t in self.k + self.v:
            t[dst].copy_(t[src])

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata) -> None:
        self.kernels.write_kv(k, v, self.k[layer], self.v[layer], meta.slot_mapping)

    def attend(self, layer: int, q: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        return self.kernels.paged_attention(q, self.k[layer], self.v[layer], meta.block_tables,
                                            meta.query_start_loc, meta.seq_lens, scale)
