"""Fused elementwise kernels: RMSNorm, add + RMSNorm, Qwen3's q/k RMSNorm + rotate-half RoPE, SiLU-mul.

Each rounds where reference/ops.py rounds (the normalized row to x.dtype before the weight, the sum before
the norm, each RoPE half), so they differ from it only by the approximate exp / sqrt of the device and the
order of one row's sum of squares. One program per row: a row never depends on its batch.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import INTERPRET, out_code, round_out


def row_warps(block: int) -> dict:
    """Warps for a one-row program of `block` elements: ~8 fp32 per thread (no spills at 8192)."""
    return {} if INTERPRET else dict(num_warps=min(16, max(4, block // 256)))


@triton.jit
def _rms_row(xf, mask, w_ptr, offs, K, eps, XD: tl.constexpr, OUT: tl.constexpr):
    """One row (fp32, already rounded to x.dtype) -> weight * round(x * rsqrt(mean(x^2) + eps)), fp32."""
    var = tl.sum(tl.where(mask, xf * xf, 0.0), axis=0) / K
    normed = round_out(xf / tl.sqrt_rn(var + eps), XD).to(tl.float32)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    return round_out(w * normed, OUT)


@triton.jit
def rms_norm_kernel(x_ptr, r_ptr, w_ptr, y_ptr, h_ptr, K, stride_x, stride_r, stride_y, stride_h, eps,
                    BLOCK: tl.constexpr, ADD: tl.constexpr, XD: tl.constexpr, OUT: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    mask = offs < K
    xf = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    if ADD:
        xf = round_out(xf + tl.load(r_ptr + row * stride_r + offs, mask=mask, other=0.0).to(tl.float32), XD)
        tl.store(h_ptr + row * stride_h + offs, xf, mask=mask)
        xf = xf.to(tl.float32)
    tl.store(y_ptr + row * stride_y + offs, _rms_row(xf, mask, w_ptr, offs, K, eps, XD, OUT), mask=mask)


def _rows(x: torch.Tensor) -> torch.Tensor:
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def _norm(x, residual, weight, eps):
    k = x.shape[-1]
    x2 = _rows(x)
    r2 = _rows(residual) if residual is not None else x2
    out_dtype = torch.promote_types(weight.dtype, x.dtype)
    y = torch.empty(x2.shape, dtype=out_dtype, device=x.device)
    h = torch.empty(x2.shape, dtype=x.dtype, device=x.device) if residual is not None else y
    if x2.shape[0]:
        rms_norm_kernel[(x2.shape[0],)](x2, r2, weight, y, h, k, x2.stride(0), r2.stride(0), y.stride(0),
                                        h.stride(0), float(eps), BLOCK=triton.next_power_of_2(k),
                                        ADD=residual is not None, XD=out_code(x.dtype), OUT=out_code(out_dtype),
                                        **row_warps(triton.next_power_of_2(k)))
    return y.reshape(x.shape), h.reshape(x.shape)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return _norm(x, None, weight, eps)[0]


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float):
    return _norm(x, residual, weight, eps)


# Heads a qk_norm_rope program takes: the interpreter pays per program and per op, not per element (8 heads a
# program: 3 programs a token for Qwen3-0.6B's 16 + 8 heads instead of 24), and a GPU program of [8, D / 2]
# halves holds ~4 fp32 a thread per tensor at 4 warps (no spills: tests/test_triton_aot.py).
QK_HEADS = 8


@triton.jit
def qk_norm_rope_kernel(qkv_ptr, qw_ptr, kw_ptr, pos_ptr, cs_ptr, q_ptr, k_ptr, stride_t, H, NH, eps,
                        D: tl.constexpr, HALF: tl.constexpr, XD: tl.constexpr, HB: tl.constexpr):
    """Program (token, block of HB heads): heads [0, H) are q heads, [H, NH) k heads; v is left in place. Each
    head is its own row of the block: its sum of squares, norm and rotation are those of a one-head program."""
    t = tl.program_id(0)
    hd = tl.program_id(1) * HB + tl.arange(0, HB)
    hm = (hd < NH)[:, None]
    offs = tl.arange(0, HALF)[None, :]
    base = qkv_ptr + t * stride_t + hd[:, None] * D + offs
    x1 = tl.load(base, mask=hm, other=0.0).to(tl.float32)
    x2 = tl.load(base + HALF, mask=hm, other=0.0).to(tl.float32)
    var = (tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / D
    r = tl.sqrt_rn(var + eps)[:, None]
    is_q = (hd < H)[:, None]
    w1 = tl.where(is_q, tl.load(qw_ptr + offs), tl.load(kw_ptr + offs)).to(tl.float32)
    w2 = tl.where(is_q, tl.load(qw_ptr + HALF + offs), tl.load(kw_ptr + HALF + offs)).to(tl.float32)
    n1 = round_out(w1 * round_out(x1 / r, XD).to(tl.float32), XD).to(tl.float32)
    n2 = round_out(w2 * round_out(x2 / r, XD).to(tl.float32), XD).to(tl.float32)
    p = tl.load(pos_ptr + t)
    cos = tl.load(cs_ptr + p * D + offs)
    sin = tl.load(cs_ptr + p * D + HALF + offs)
    o1 = round_out(n1 * cos - n2 * sin, XD)
    o2 = round_out(n2 * cos + n1 * sin, XD)
    out = tl.where(is_q, q_ptr + (t * H + hd[:, None]) * D, k_ptr + (t * (NH - H) + hd[:, None] - H) * D) + offs
    tl.store(out, o1, mask=hm)
    tl.store(out + HALF, o2, mask=hm)


def qk_norm_rope(qkv, q_w, k_w, positions, cos_sin, num_heads: int, num_kv_heads: int, eps: float):
    t = qkv.shape[0]
    d = cos_sin.shape[1]
    if q_w.dtype != qkv.dtype or k_w.dtype != qkv.dtype:
        raise TypeError("kernels triton: q/k norm weights must have the activations' dtype")
    qkv = qkv if qkv.stride(-1) == 1 else qkv.contiguous()
    q = torch.empty((t, num_heads, d), dtype=qkv.dtype, device=qkv.device)
    k = torch.empty((t, num_kv_heads, d), dtype=qkv.dtype, device=qkv.device)
    nh = num_heads + num_kv_heads
    hb = min(QK_HEADS, triton.next_power_of_2(nh))
    if t:
        qk_norm_rope_kernel[(t, triton.cdiv(nh, hb))](
            qkv, q_w, k_w, positions, cos_sin, q, k, qkv.stride(0), num_heads, nh, float(eps), D=d, HALF=d // 2,
            XD=out_code(qkv.dtype), HB=hb)
    v = qkv[:, nh * d:].reshape(t, num_kv_heads, d)
    return q, k, v


@triton.jit
def silu_mul_kernel(x_ptr, y_ptr, F, stride_x, stride_y, BLOCK: tl.constexpr, XD: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < F
    g = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(x_ptr + row * stride_x + F + offs, mask=mask, other=0.0).to(tl.float32)
    silu = round_out(g / (1.0 + tl.exp(-g)), XD).to(tl.float32)
    tl.store(y_ptr + row * stride_y + offs, round_out(silu * u, XD), mask=mask)


def silu_mul(x: torch.Tensor) -> torch.Tensor:
    x2 = _rows(x)
    f = x2.shape[-1] // 2
    y = torch.empty((x2.shape[0], f), dtype=x.dtype, device=x.device)
    block = min(1024, triton.next_power_of_2(f))
    if x2.shape[0]:
        silu_mul_kernel[(x2.shape[0], triton.cdiv(f, block))](x2, y, f, x2.stride(0), y.stride(0), BLOCK=block,
                                                               XD=out_code(x.dtype))
    return y.reshape(*x.shape[:-1], f)
