"""Int4 weight-only linear (W4A16), the reference formula: dequantize in fp32, then an fp32 matmul.

W = (codes - zeros) * scales per group of contiguous columns (two fp32 roundings, the same as every kernel
set's in-register dequantization), y = x[:, perm] W^T accumulated in fp32, rounded to x.dtype. Each row is
its own matrix-vector product, so a row's bits never depend on the batch it came in (a whole-batch GEMM
may pick a different blocking, hence a different summation order, for a different number of rows).
"""
from __future__ import annotations

import torch


def w4a16_dequantize(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor) -> torch.Tensor:
    """fp32 [N, K] from codes uint8 [N, K] and fp32 scales / zeros [N, G] (groups of K / G columns)."""
    group = codes.shape[1] // scales.shape[1]
    return (codes.float() - zeros.float().repeat_interleave(group, dim=1)) * scales.float().repeat_interleave(group, 1)


def w4a16_prepare(codes, scales, zeros, perm=None):
    return w4a16_dequantize(codes, scales, zeros), perm


def w4a16_linear(x: torch.Tensor, prepared) -> torch.Tensor:
    w, perm = prepared
    shape = x.shape
    xf = x.reshape(-1, shape[-1]).float()
    if perm is not None:
        xf = xf.index_select(1, perm)
    y = torch.empty(xf.shape[0], w.shape[0], dtype=torch.float32, device=x.device)
    for i in range(xf.shape[0]):
        y[i] = torch.mv(w, xf[i])
    return y.to(x.dtype).reshape(*shape[:-1], w.shape[0])
