"""Int4 weight-only linear (W4A16): the weight kept packed, dequantized in registers, fp32 accumulation.

Prepared form (`w4a16_prepare`): (packed, scales, zeros, perm)
  packed  uint8 [N, ceil(K / 2)]: two codes per byte along K, column 2j in the low nibble and 2j + 1 in the
          high one (an odd K pads its last byte's high nibble with 0, never read: the K edge is masked);
  scales  fp32 [N, G], zeros fp32 [N, G] as the contract gives them (groups of K / G contiguous columns of the
          perm-ordered weight; channel-wise is G = 1);
  perm    int32 [K] or None: GPTQ / compressed-tensors activation order, applied to x as the kernel loads it
          (x[:, perm], no gathered copy of x).
Bytes rather than eight codes per int32 word: a tile's byte address is simply column // 2, any BLOCK_K even,
and an odd K needs no word padding; the weight is 1/8 of the fp32 dequantized copy the reference holds.

Each weight element is dequantized as the contract and reference.w4a16_dequantize write it: `(code - zero) *
scale` in fp32, two roundings (no FMA can form: a difference times a factor), then multiplied with x (upcast
to fp32) and accumulated in fp32 (`fdot` PREC 1: full fp32, no TF32, no bf16 rounding of the weight). One
tiling for every M (W4A16_CONFIG), so a row's K summation order never depends on the batch.

What is exact (tests/test_kernels_triton.py, under the interpreter): the dequantized weight is bit for bit
the reference's (a one-hot x reads it back), and with the interpreter's tiling (FLOAT_CONFIG's) a row's bits
equal float_linear_kernel's over that dequantized fp32 weight. Bit equality with reference.w4a16_linear
itself is not possible: its torch.mv sums K in BLAS's order, not in this kernel's tiles (fp32 tolerance).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import INTERPRET, fdot, out_code, round_out
from .linear import FLOAT_CONFIG


@triton.jit
def w4a16_kernel(x_ptr, w_ptr, s_ptr, z_ptr, perm_ptr, y_ptr, M, N, K, G, GS, stride_xm, stride_ym,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, OUT: tl.constexpr,
                 HAS_PERM: tl.constexpr, TILE_GROUP: tl.constexpr, INTERP: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    m_ok = rm < M
    n_ok = rn < N
    kp = (K + 1) // 2                       # packed bytes per weight row
    shift = ((rk % 2) * 4).to(tl.uint8)     # low nibble: even column, high: odd
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + rk
        k_ok = kk < K
        if HAS_PERM:
            xcol = tl.load(perm_ptr + kk, mask=k_ok, other=0)
        else:
            xcol = kk
        xt = tl.load(x_ptr + rm[:, None] * stride_xm + xcol[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        wmask = n_ok[None, :] & k_ok[:, None]
        b = tl.load(w_ptr + rn[None, :] * kp + (kk // 2)[:, None], mask=wmask, other=0)
        codes = ((b >> shift[:, None]) & 0xF).to(tl.float32)
        if TILE_GROUP:      # the group size a multiple of BLOCK_K: one group per tile, [BLOCK_N] loads
            g = k0 // GS
            s = tl.load(s_ptr + rn * G + g, mask=n_ok, other=0.0)[None, :]
            z = tl.load(z_ptr + rn * G + g, mask=n_ok, other=0.0)[None, :]
        else:
            g = kk // GS
            s = tl.load(s_ptr + rn[None, :] * G + g[:, None], mask=wmask, other=0.0)
            z = tl.load(z_ptr + rn[None, :] * G + g[:, None], mask=wmask, other=0.0)
        w = (codes - z) * s                 # [BLOCK_K, BLOCK_N] fp32, two roundings
        w = tl.where(wmask, w, 0.0)
        acc += fdot(xt, w, INTERP, 1)
    tl.store(y_ptr + rm[:, None] * stride_ym + rn[None, :], round_out(acc, OUT), mask=m_ok[:, None] & n_ok[None, :])


# one tiling for every M (batch invariance of the fp32 summation order). Interpreted: FLOAT_CONFIG's, so that a
# row equals float_linear's over the dequantized weight bit for bit (the test's exactness check).
W4A16_CONFIG = (dict(FLOAT_CONFIG) if INTERPRET
                else dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=32, num_warps=4, num_stages=3))


def w4a16_prepare(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, perm: torch.Tensor | None = None):
    """The contract's canonical int4 weight -> (packed uint8 [N, ceil(K/2)], scales fp32 [N, G], zeros fp32 [N, G],
    perm int32 [K] or None). Runs once at load (the range check reads the codes on the host)."""
    if codes.dtype != torch.uint8 or codes.dim() != 2:
        raise ValueError(f"w4a16: codes must be uint8 [N, K], got {codes.dtype} {tuple(codes.shape)}")
    n, k = codes.shape
    if scales.shape != zeros.shape or scales.dim() != 2 or scales.shape[0] != n or k % scales.shape[1]:
        raise ValueError(f"w4a16: scales / zeros {tuple(scales.shape)} / {tuple(zeros.shape)} do not make groups of "
                         f"the {k} columns of {n} rows")
    if codes.numel() and int(codes.max()) > 15:
        raise ValueError("w4a16: codes must be int4 (0..15)")
    if perm is not None and perm.shape != (k,):
        raise ValueError(f"w4a16: perm must have the {k} columns, got {tuple(perm.shape)}")
    c = codes if k % 2 == 0 else torch.nn.functional.pad(codes, (0, 1))
    packed = (c[:, 0::2] | (c[:, 1::2] << 4)).contiguous()
    return (packed, scales.float().contiguous(), zeros.float().contiguous(),
            None if perm is None else perm.to(torch.int32).contiguous())


def w4a16_linear(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                 perm: torch.Tensor | None) -> torch.Tensor:
    """x [..., K] float -> [..., N] in x.dtype: x[:, perm] ((codes - zeros) * scales)^T, fp32 accumulation."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m, k = x2.shape
    n, g = scales.shape
    if packed.shape != (n, (k + 1) // 2) or k % g:
        raise ValueError(f"w4a16: x has {k} columns, the weight packs {tuple(packed.shape)} with {g} groups")
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m and n:
        cfg = W4A16_CONFIG
        gs = k // g
        grid = (triton.cdiv(m, cfg["BLOCK_M"]), triton.cdiv(n, cfg["BLOCK_N"]))
        w4a16_kernel[grid](x2, packed, scales, zeros, perm if perm is not None else packed, y, m, n, k, g, gs,
                           x2.stride(0), y.stride(0), OUT=out_code(x.dtype), HAS_PERM=perm is not None,
                           TILE_GROUP=gs % cfg["BLOCK_K"] == 0, INTERP=INTERPRET, **cfg)
    return y.reshape(*shape[:-1], n)
