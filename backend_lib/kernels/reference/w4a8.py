"""The int4 head on int8 activations (`lm_head_quant: int4a8`), the reference formula in torch ops (any device).

W[n, k] = (codes[n, k] - 8) * scales[n, g] (the int4 head's symmetric codes, groups of K / G contiguous columns),
x quantized per row as the A8W8 linears do (quantize_per_token: xq int8, s_x). Per output:
    isum_g = sum_{k in g} xq[k] (codes[n, k] - 8)                               exact int32
    acc = 0; for g in order: acc = acc + float(isum_g) * scales[n, g]            fp32, a product then a sum
    y = acc * s_x, rounded to x.dtype.
float(isum_g) is exact (|isum_g| < 2^24 for groups up to 16384 columns) and every fp32 step is one elementwise op, so
a row's bits depend on that row only, and csrc/w4a8.cpp computes the same bits (tests/test_w4a8_head.py).
"""
from __future__ import annotations

import torch

from .ops import int8_matmul, quantize_per_token


def w4a8_prepare(codes: torch.Tensor, scales: torch.Tensor):
    """(codes - 8 as int8 [N, K], scales fp32 [N, G])."""
    return (codes.to(torch.int16) - 8).to(torch.int8), scales.float().contiguous()


def w4a8_linear(x: torch.Tensor, prepared) -> torch.Tensor:
    w, scales = prepared
    shape = x.shape
    q, s = quantize_per_token(x.reshape(-1, shape[-1]))
    n, k = w.shape
    group = k // scales.shape[1]
    acc = torch.zeros(q.shape[0], n, dtype=torch.float32, device=x.device)
    for g in range(scales.shape[1]):
        cols = slice(g * group, (g + 1) * group)
        acc = acc + int8_matmul(q[:, cols], w[:, cols]).float() * scales[:, g][None, :]
    return (acc * s).to(x.dtype).reshape(*shape[:-1], n)
