"""Qwen3 self-attention: fused qkv projection, per-head q/k RMSNorm, RoPE, paged KV cache, o_proj."""
from __future__ import annotations

import torch
from torch import nn

from ..kernels import Kernels


class Qwen3Attention(nn.Module):
    def __init__(self, layer_idx: int, qkv_proj: nn.Module, o_proj: nn.Module, q_norm: torch.Tensor,
                 k_norm: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int, eps: float,
                 kernels: Kernels):
        super().__init__()
        self.layer_idx = layer_idx
        self.qkv_proj, self.o_proj = qkv_proj, o_proj
        self.q_norm = nn.Parameter(q_norm, requires_grad=False)
        self.k_norm = nn.Parameter(k_norm, requires_grad=False)
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.eps, self.scale = eps, head_dim ** -0.5
        self.kernels = kernels

    def forward(self, x: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor, kv_cache, meta):
        t = x.shape[0]
        q, k, v = self.kernels.qk_norm_rope(self.qkv_proj.forward(x), self.q_norm, self.k_norm, positions, cos_sin,
                                            self.num_heads, self.num_kv_heads, self.eps)
        kv_cache.write(self.layer_idx, k, v, meta)
        o = kv_cache.attend(self.layer_idx, q, meta, self.scale)
        return self.o_proj.forward(o.reshape(t, self.num_heads * self.head_dim))
