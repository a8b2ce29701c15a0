"""The compiled CPU kernel set: C++ kernels (csrc/) built at load by build.py and cached on disk.

Batch invariant like every set; the A8W8 GEMM is VNNI / AVX2 int8 with exact int32 accumulation.
"""
from __future__ import annotations

import torch

from ..contract import Kernels
from .build import load_cpu_extension
from .moe import cpu_moe

__all__ = ["load"]


def _w4a16_prepare(codes, scales, zeros, perm=None):
    """(packed int32 [N/64, K/8, 64], scales and zeros fp32 [N/64, G, 64], perm int64 [K] or empty, N, the zero
    point of the batch-1 table lookup or -1): csrc/w4a16.cpp, panels of 64 outputs (padding: scale 0, zero 0)."""
    n, g = scales.shape
    zeros = zeros.float()
    # The AVX-512 path subtracts zeros as 2^23 + zero, exact for the integers every int4 format stores.
    if not bool((zeros == zeros.round()).all()) or bool((zeros.abs() > 2 ** 20).any()):
        raise ValueError("w4a16: zero points must be integers (int4 codes)")
    perm = torch.empty(0, dtype=torch.int64) if perm is None else perm.to(torch.int64).contiguous()
    return (torch.ops.qwen3_cpu.w4a16_pack(codes), _panel_blocked(scales), _panel_blocked(zeros), perm, n,
            _lut_zero(scales, zeros))


def _panel_blocked(t):
    """fp32 [N, G] -> [ceil(N / 64), G, 64], each panel's 64 outputs contiguous per group (padding: 0)."""
    n, g = t.shape
    panels = -(-n // 64)
    t = torch.cat([t.float(), t.new_zeros(panels * 64 - n, g, dtype=torch.float32)])
    return t.reshape(panels, 64, g).transpose(1, 2).contiguous()


def _w4a8_prepare(codes, scales):
    """(packed int32 [N/64, K/8, 64] as w4a16_pack's, scales fp32 [N/64, G, 64], N): csrc/w4a8.cpp, zero point 8."""
    return torch.ops.qwen3_cpu.w4a16_pack(codes), _panel_blocked(scales), scales.shape[0]


def _lut_zero(scales, zeros) -> float:
    """The one zero point of the weight when csrc/w4a16.cpp's batch-1 table lookup is exact for it, else -1: all
    zeros one integer in [0, 16], every scale zero or normal in [2^-100, 2^100] with its low 4 mantissa bits zero
    (at most 20 significant bits: bf16 and fp16 scales, as checkpoints store them)."""
    z0 = float(zeros.flatten()[0]) if zeros.numel() else -1.0
    s = scales.float()
    bits = s.view(torch.int32)
    exact = ((bits & 0xF) == 0) & ((s == 0) | ((s.abs() >= 2.0 ** -100) & (s.abs() <= 2.0 ** 100)))
    if not (0 <= z0 <= 16 and bool((zeros == z0).all()) and bool(exact.all())):
        return -1.0
    return z0


def load(cache_dir=None) -> Kernels | None:
    """The CPU set, or None where the C++ kernels cannot be built (no compiler)."""
    if not load_cpu_extension(cache_dir):
        return None
    ops = torch.ops.qwen3_cpu
    this: list[Kernels] = []   # the set itself, for the MoE slot's composed fallback
    kernels = Kernels(
        name="cpu",
        rms_norm=ops.rms_norm,
        add_rms_norm=ops.add_rms_norm,
        qk_norm_rope=ops.qk_norm_rope,
        silu_mul=ops.silu_mul,
        a8w8_prepare=lambda w_q, w_scale: (ops.a8w8_pack(w_q), w_scale.float().contiguous(), ops.a8w8_colsum(w_q)),
        a8w8_linear=lambda x, prepared: ops.a8w8_linear(x, *prepared),
        w4a16_prepare=_w4a16_prepare,
        w4a16_linear=lambda x, p: ops.w4a16_linear(x, *p),
        w4a8_prepare=_w4a8_prepare,
        w4a8_linear=lambda x, p: ops.w4a8_linear(x, *p),
        float_prepare=lambda w: (ops.float_pack(w), w.shape[0], w.shape[1]),
        float_linear=lambda x, p, out_dtype=None: ops.float_linear(x, p[0], p[1], out_dtype),
        float_rows=lambda p, ids: ops.float_packed_rows(p[0], ids, p[2]),
        float_linear_rows=lambda x, p, ids: ops.float_linear_rows(x, p[0], p[1], ids),
        greedy_screen=ops.greedy_screen,
        argmax_rows=ops.argmax_rows,
        greedy_head_picks=lambda x, p8, c, d, wmax, p, coef, margin, limit: ops.greedy_head_picks(
            x, *p8, c, d, wmax, p[0], p[1], coef, margin, limit),
        write_kv=ops.write_kv,
        paged_attention=ops.paged_attention,
        tq_write=ops.tq_write,
        tq_paged_attention=ops.tq_paged_attention,
        moe=lambda x, ids, weights, experts: cpu_moe(this[0], x, ids, weights, experts),
        stream_zeros=ops.stream_zeros,
    )
    this.append(kernels)
    return kernels
