"""Linear kernels: A8W8 (per-token int8 activation quantization fused into an int8 GEMM) and float (fp32
accumulation over bf16 / fp32 weights, kept in their own dtype).

A8W8 is bit-exact with reference.a8w8_linear: the same quantization (`div_rn` scale and quotient, round half
to even, clamp), exact int32 accumulation of int8 `tl.dot`, the same fp32 products `(acc * s) * w_scale`, and
the same rounding to the output dtype. Each program recomputes its rows' absmax over K (x is small next to
W) so no separate quantization pass or int8 copy of x exists.

Tile sizes depend on nothing but the mode (GPU or interpreter) and, for A8W8, M (its math is exact, so any
tiling gives the same bits); the float GEMM keeps one tiling for every M so that a row's K summation order
never depends on the batch.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import INTERPRET, fdot, out_code, rne, round_out


@triton.jit
def a8w8_kernel(x_ptr, w_ptr, ws_ptr, y_ptr, M, N, K, stride_xm, stride_ym,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, OUT: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    m_ok = rm < M
    n_ok = rn < N
    amax = tl.zeros((BLOCK_M,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = (k0 + rk) < K
        xt = tl.load(x_ptr + rm[:, None] * stride_xm + (k0 + rk)[None, :], mask=m_ok[:, None] & k_ok[None, :],
                     other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.max(tl.abs(xt), axis=1))
    s = tl.where(amax > 0, tl.div_rn(amax, tl.full((BLOCK_M,), 127.0, tl.float32)), 1.0)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = (k0 + rk) < K
        xt = tl.load(x_ptr + rm[:, None] * stride_xm + (k0 + rk)[None, :], mask=m_ok[:, None] & k_ok[None, :],
                     other=0.0).to(tl.float32)
        q = rne(tl.div_rn(xt, s[:, None]))
        q = tl.minimum(tl.maximum(q, -128.0), 127.0).to(tl.int8)
        wt = tl.load(w_ptr + rn[None, :] * K + (k0 + rk)[:, None], mask=n_ok[None, :] & k_ok[:, None], other=0)
        acc += tl.dot(q, wt, out_dtype=tl.int32)
    ws = tl.load(ws_ptr + rn, mask=n_ok, other=0.0)
    y = (acc.to(tl.float32) * s[:, None]) * ws[None, :]
    tl.store(y_ptr + rm[:, None] * stride_ym + rn[None, :], round_out(y, OUT), mask=m_ok[:, None] & n_ok[None, :])


def a8w8_config(m: int) -> dict:
    if INTERPRET:
        return dict(BLOCK_M=16, BLOCK_N=128, BLOCK_K=64)
    if m <= 16:      # decode: a GEMV in 16-row MMA tiles, bandwidth bound
        return dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=4)
    if m <= 64:
        return dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=3)
    return dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, num_warps=8, num_stages=3)


def a8w8_linear(x: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor) -> torch.Tensor:
    """x [..., K] float, w_q int8 [N, K] contiguous, w_scale fp32 [N] -> [..., N] in x.dtype."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m, k = x2.shape
    n = w_q.shape[0]
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m:
        cfg = a8w8_config(m)
        grid = (triton.cdiv(m, cfg["BLOCK_M"]), triton.cdiv(n, cfg["BLOCK_N"]))
        a8w8_kernel[grid](x2, w_q, w_scale, y, m, n, k, x2.stride(0), y.stride(0), OUT=out_code(x.dtype), **cfg)
    return y.reshape(*shape[:-1], n)


@triton.jit
def float_linear_kernel(x_ptr, w_ptr, y_ptr, M, N, K, stride_xm, stride_ym,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, OUT: tl.constexpr,
                        INTERP: tl.constexpr, IEEE: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    m_ok = rm < M
    n_ok = rn < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = (k0 + rk) < K
        xt = tl.load(x_ptr + rm[:, None] * stride_xm + (k0 + rk)[None, :], mask=m_ok[:, None] & k_ok[None, :],
                     other=0.0)
        wt = tl.load(w_ptr + rn[None, :] * K + (k0 + rk)[:, None], mask=n_ok[None, :] & k_ok[:, None], other=0.0)
        acc += fdot(xt, wt, INTERP, IEEE)
    tl.store(y_ptr + rm[:, None] * stride_ym + rn[None, :], round_out(acc, OUT), mask=m_ok[:, None] & n_ok[None, :])


# one tiling for every M (batch invariance of the fp32 summation order)
FLOAT_CONFIG = (dict(BLOCK_M=4, BLOCK_N=2048, BLOCK_K=32) if INTERPRET
                else dict(BLOCK_M=32, BLOCK_N=64, BLOCK_K=64, num_warps=4, num_stages=4))


def float_linear(x: torch.Tensor, w: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """x [..., K] @ w [N, K]^T with fp32 accumulation -> out_dtype (default x.dtype)."""
    shape = x.shape
    out_dtype = out_dtype or x.dtype
    x2 = x.reshape(-1, shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m, k = x2.shape
    n = w.shape[0]
    y = torch.empty((m, n), dtype=out_dtype, device=x.device)
    if m:
        cfg = FLOAT_CONFIG
        grid = (triton.cdiv(m, cfg["BLOCK_M"]), triton.cdiv(n, cfg["BLOCK_N"]))
        float_linear_kernel[grid](x2, w, y, m, n, k, x2.stride(0), y.stride(0), OUT=out_code(out_dtype),
                                  INTERP=INTERPRET, IEEE=torch.float32 in (x2.dtype, w.dtype) or x2.dtype != w.dtype,
                                  **cfg)
    return y.reshape(*shape[:-1], n)
