"""The compiled CPU kernel set: C++ kernels (csrc/) built at load by build.py and cached on disk.

Batch invariant like every set; the A8W8 GEMM is VNNI / AVX2 int8 with exact int32 accumulation.
"""
from __future__ import annotations

import torch

from ..contract import Kernels
from .build import load_cpu_extension

__all__ = ["load"]


def _w4a16_prepare(codes, scales, zeros, perm=None):
    """(packed int32 [N/8, K], scales and zeros fp32 [N/8, G, 8], perm int64 [K] or empty): csrc/w4a16.cpp."""
    n, g = scales.shape

    def blocked(t):
        return t.float().reshape(n // 8, 8, g).transpose(1, 2).contiguous()

    perm = torch.empty(0, dtype=torch.int64) if perm is None else perm.to(torch.int64).contiguous()
    return torch.ops.qwen3_cpu.w4a16_pack(codes), blocked(scales), blocked(zeros), perm


def load(cache_dir=None) -> Kernels | None:
    """The CPU set, or None where the C++ kernels cannot be built (no compiler)."""
    if not load_cpu_extension(cache_dir):
        return None
    ops = torch.ops.qwen3_cpu
    return Kernels(
        name="cpu",
        rms_norm=ops.rms_norm,
        add_rms_norm=ops.add_rms_norm,
        qk_norm_rope=ops.qk_norm_rope,
        silu_mul=ops.silu_mul,
        a8w8_prepare=lambda w_q, w_scale: (ops.a8w8_pack(w_q), w_scale.float().contiguous(), ops.a8w8_colsum(w_q)),
        a8w8_linear=lambda x, prepared: ops.a8w8_linear(x, *prepared),
        w4a16_prepare=_w4a16_prepare,
        w4a16_linear=lambda x, p: ops.w4a16_linear(x, *p),
        float_prepare=lambda w: (ops.float_pack(w), w.shape[0], w.shape[1]),
        float_linear=lambda x, p, out_dtype=None: ops.float_linear(x, p[0], p[1], out_dtype),
        float_rows=lambda p, ids: ops.float_packed_rows(p[0], ids, p[2]),
        write_kv=ops.write_kv,
        paged_attention=ops.paged_attention,
        tq_write=ops.tq_write,
        tq_paged_attention=ops.tq_paged_attention,
    )
