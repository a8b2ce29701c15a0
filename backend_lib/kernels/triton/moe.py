"""The fused mixture-of-experts kernels: (token, expert) pairs sorted by expert and padded to the block, one
grouped GEMM launch over every expert for gate/up with SwiGLU fused in its epilogue, one for down with the
router weight fused in its epilogue, and the per-token combine (vLLM's moe_align_block_size + fused_moe design,
written here from the idea, not the code).

Pairs. Token t's k experts are sorted ascending (its pair j = its j-th smallest expert, p = t * k + j: the order
transformers' expert loop adds them). `align` lays the pairs out expert by expert, each expert's run padded to
a multiple of BLOCK_M with a sentinel (P = T * k), and names each block's expert: a block of BLOCK_M rows is
one expert's, so a program multiplies its rows by one expert's weight tile. All on the device with shapes fixed
by (T, k, E, BLOCK_M) (the padded length's upper bound P + min(E, P) * (BLOCK_M - 1)): no host read, so a
decode step never syncs and a CUDA graph can hold it; programs past the real padded length return at once.

Exactness (the composed path, kernels/moe.py over this set's own slots, bit for bit, and the reference for
A8W8):
- A8W8: each program quantizes its rows per token exactly as a8w8_kernel does (absmax over the whole K, div_rn,
  round half to even), int8 `tl.dot` into int32 (exact, so any tiling gives the same bits), `(acc * s) * w_s`
  rounded to the model dtype. The gate and up halves of a row are two accumulators of the same program, and the
  epilogue is silu_mul_kernel's (`round(g / (1 + exp(-g)))`, then `round(silu * u)`), so the intermediate row
  equals silu_mul(gate_up(x)). The down GEMM re-quantizes that row per pair, like the composed down projection.
- float (bf16 / fp16 / fp32 experts): float_linear_kernel's K blocking (its BLOCK_K, fdot), one tiling for every
  batch, so a row's summation order never depends on the step.
- W4A16 (packed int4 experts): each weight tile dequantized in registers exactly as w4a16_kernel does, then the
  float path with full fp32 products (its tiling, interpreted: w4a16_kernel's BLOCK_K, so the composed path's
  bits there). GPTQ act order (HAS_PERM): the pair's row loaded through its expert's perm, a[row, perm_e[k]]
  against weight column k, w4a16_kernel's gathered load, so the same products in the same order: gate/up
  through the expert's gate_up perm (PERM_UP: the up half through its own), down through its perm over the
  SwiGLU columns. Without HAS_PERM the code is the non-perm kernel's (the same PTX).
- the router weight: `round(y * w)` in the model dtype (one product of two model-dtype values, as `y * w`),
  then the combine adds each token's k products in ascending expert order, rounding to the model dtype after
  each add (`out = c0; out += c1; ...`). A token's output reads only its own pairs: batch invariant.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import INTERPRET, fdot, out_code, rne, round_out


@triton.jit
def moe_gemm_kernel(a_ptr, w_ptr, ws_ptr, wz_ptr, pw_ptr, y_ptr, sorted_ptr, bexp_ptr, npad_ptr, perm_ptr, P, N, K,
                    G, GS, stride_am, stride_ym, A_DIV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_K: tl.constexpr, QUANT: tl.constexpr, GATED: tl.constexpr, MUL_W: tl.constexpr,
                    EVEN_K: tl.constexpr, OUT: tl.constexpr, INTERP: tl.constexpr, PREC: tl.constexpr,
                    W4: tl.constexpr, TILE_GROUP: tl.constexpr, HAS_PERM: tl.constexpr, PERM_UP: tl.constexpr):
    """Program (block of BLOCK_M sorted pair slots, BLOCK_N output columns). Rows of A: pair // A_DIV (the
    token's hidden row for gate/up, A_DIV = k; the pair's intermediate row for down, A_DIV = 1). The expert's
    weight is w[e] [N_w, K] (N_w = 2N gated: gate rows [0, N), up rows [N, 2N)). y [P, N]. W4: w[e] is packed
    int4 [N_w, ceil(K / 2)] uint8 (w4a16.py's layout) with fp32 scales ws / zeros wz [E, N_w, G] (groups of GS
    columns), dequantized per tile as w4a16_kernel does (QUANT False: the float path's fp32 accumulation).
    HAS_PERM (W4 only): act order, expert e's perm int32 [K] at perm_ptr + e * K; the pair's row is loaded through
    it (a[row, perm_e[k]] against weight column k, w4a16_kernel's gathered load). PERM_UP (gated): gate and up
    each carry their own, [E, 2, K] (the up half's row loaded through perm_e[1]); else gate/up share perm_e."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    if pid_m * BLOCK_M >= tl.load(npad_ptr):
        return
    e = tl.load(bexp_ptr + pid_m).to(tl.int64)
    pair = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    m_ok = pair < P
    row = tl.where(m_ok, pair // A_DIV, 0)                    # padding slots read row 0 (never stored)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = rn < N
    rn_c = tl.minimum(rn, N - 1)                              # columns past N read column N - 1 (never stored)
    rk = tl.arange(0, BLOCK_K)
    n_w = 2 * N if GATED else N
    # int32 offsets from scalar bases: one register per element, not a 64-bit pointer (no register spills)
    a_offs = (row * stride_am)[:, None] + rk[None, :]
    if HAS_PERM:
        a_rows = (row * stride_am)[:, None]
        p_base = perm_ptr + e * (2 * K if PERM_UP else K)     # expert e's perm (its gate's, then its up's)
    if W4:
        kp = (K + 1) // 2
        w_base = w_ptr + e * n_w * kp
        sz_base = e * n_w                                    # the expert's first row of scales / zeros
        w_offs = rn_c[None, :] * kp + (rk // 2)[:, None]       # a byte per two columns
        shift = ((rk % 2) * 4).to(tl.uint8)[:, None]
    else:
        w_base = w_ptr + e * n_w * K                          # the expert's weight (a scalar 64-bit address)
        w_offs = rn_c[None, :] * K + rk[:, None]               # [BLOCK_K, BLOCK_N] tile of W^T
    if QUANT:
        amax = tl.zeros((BLOCK_M,), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            if EVEN_K:
                at = tl.load(a_ptr + k0 + a_offs)
            else:
                at = tl.load(a_ptr + k0 + a_offs, mask=(k0 + rk)[None, :] < K, other=0.0)
            amax = tl.maximum(amax, tl.max(tl.abs(at.to(tl.float32)), axis=1))
        s = tl.where(amax > 0, tl.div_rn(amax, tl.full((BLOCK_M,), 127.0, tl.float32)), 1.0)
        acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
        acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
    else:
        acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if W4:
            k_ok = (k0 + rk) < K
            if HAS_PERM:        # the gathered column load: a[row, perm_e[k]]
                pcol = tl.load(p_base + k0 + rk, mask=k_ok, other=0)
                at = tl.load(a_ptr + a_rows + pcol[None, :], mask=k_ok[None, :], other=0.0)
            else:
                at = tl.load(a_ptr + k0 + a_offs, mask=k_ok[None, :], other=0.0)
            wg = _w4_tile(w_base + k0 // 2 + w_offs, wz_ptr, ws_ptr, sz_base + rn_c, k0, rk, k_ok, shift, G, GS,
                          TILE_GROUP)
        elif EVEN_K:
            at = tl.load(a_ptr + k0 + a_offs)
            wg = tl.load(w_base + k0 + w_offs)
        else:
            k_ok = (k0 + rk) < K
            at = tl.load(a_ptr + k0 + a_offs, mask=k_ok[None, :], other=0.0)
            wg = tl.load(w_base + k0 + w_offs, mask=k_ok[:, None], other=0)
        if QUANT:
            q = rne(tl.div_rn(at.to(tl.float32), s[:, None]))
            q = tl.minimum(tl.maximum(q, -128.0), 127.0).to(tl.int8)
            acc_g += tl.dot(q, wg, out_dtype=tl.int32)
        else:
            acc_g += fdot(at, wg, INTERP, PREC)
        if GATED:
            if W4:
                wu = _w4_tile(w_base + N * kp + k0 // 2 + w_offs, wz_ptr, ws_ptr, sz_base + N + rn_c, k0, rk,
                              k_ok, shift, G, GS, TILE_GROUP)
            elif EVEN_K:
                wu = tl.load(w_base + N * K + k0 + w_offs)
            else:
                wu = tl.load(w_base + N * K + k0 + w_offs, mask=((k0 + rk) < K)[:, None], other=0)
            if QUANT:
                acc_u += tl.dot(q, wu, out_dtype=tl.int32)
            elif PERM_UP:       # the up projection's own act order
                pcol_u = tl.load(p_base + K + k0 + rk, mask=k_ok, other=0)
                at_u = tl.load(a_ptr + a_rows + pcol_u[None, :], mask=k_ok[None, :], other=0.0)
                acc_u += fdot(at_u, wu, INTERP, PREC)
            else:
                acc_u += fdot(at, wu, INTERP, PREC)
    if QUANT:
        wsg = tl.load(ws_ptr + e * n_w + rn_c)
        y = round_out((acc_g.to(tl.float32) * s[:, None]) * wsg[None, :], OUT).to(tl.float32)
    else:
        y = round_out(acc_g, OUT).to(tl.float32)
    if GATED:
        if QUANT:
            wsu = tl.load(ws_ptr + e * n_w + N + rn_c)
            u = round_out((acc_u.to(tl.float32) * s[:, None]) * wsu[None, :], OUT).to(tl.float32)
        else:
            u = round_out(acc_u, OUT).to(tl.float32)
        silu = round_out(y / (1.0 + tl.exp(-y)), OUT).to(tl.float32)      # silu_mul_kernel's epilogue
        y = silu * u
    if MUL_W:
        w = tl.load(pw_ptr + tl.where(m_ok, pair, 0)).to(tl.float32)
        y = round_out(y, OUT).to(tl.float32) * w[:, None]
    tl.store(y_ptr + tl.where(m_ok, pair, 0).to(tl.int64)[:, None] * stride_ym + rn[None, :], round_out(y, OUT),
             mask=m_ok[:, None] & n_ok[None, :])


@triton.jit
def _w4_tile(ptrs, wz_ptr, ws_ptr, rows, k0, rk, k_ok, shift, G, GS, TILE_GROUP: tl.constexpr):
    """fp32 [BLOCK_K, BLOCK_N] of W^T from packed int4 bytes: `(code - zero) * scale` (w4a16_kernel's math);
    rows: the tile's weight rows (of the stacked [E * N_w, G] scales / zeros). Columns past K give 0."""
    b = tl.load(ptrs, mask=k_ok[:, None], other=0)        # k0 is even (BLOCK_K is), so k0 // 2 is its byte
    codes = ((b >> shift) & 0xF).to(tl.float32)
    if TILE_GROUP:          # one group per tile
        g = k0 // GS
        s = tl.load(ws_ptr + rows * G + g)[None, :]
        z = tl.load(wz_ptr + rows * G + g)[None, :]
    else:
        g = (k0 + rk) // GS
        s = tl.load(ws_ptr + rows[None, :] * G + g[:, None], mask=k_ok[:, None], other=0.0)
        z = tl.load(wz_ptr + rows[None, :] * G + g[:, None], mask=k_ok[:, None], other=0.0)
    return tl.where(k_ok[:, None], (codes - z) * s, 0.0)


@triton.jit
def moe_combine_kernel(c_ptr, y_ptr, H, TOPK: tl.constexpr, BLOCK: tl.constexpr, OUT: tl.constexpr):
    """Program (token, block of columns): out = c[t, 0] + c[t, 1] + ... in order, rounded after each add."""
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < H
    base = c_ptr + t * TOPK * H + offs
    acc = tl.load(base, mask=mask, other=0.0).to(tl.float32)
    for j in tl.static_range(1, TOPK):
        acc = round_out(acc + tl.load(base + j * H, mask=mask, other=0.0).to(tl.float32), OUT).to(tl.float32)
    tl.store(y_ptr + t * H + offs, round_out(acc, OUT), mask=mask)


# Tiles. A8W8 is exact in any tiling, so its tiles follow the rows per expert (decode: 16-row MMA tiles over a
# few pairs; prefill: taller tiles). The float GEMM keeps one tiling for every batch (its summation order) and,
# interpreted, float_linear_kernel's BLOCK_K, so that it gives the composed path's bits there. The two launches
# of a step share BLOCK_M (align's padding); the gated one holds two accumulators and two weight tiles, so its
# tiles are narrower. Sized so that no variant spills registers on sm_90 / sm_80 (tests/test_triton_aot.py).
def moe_config(quant: bool, pairs: int, experts: int, gated: bool = False, w4: bool = False) -> dict:
    """The tiles of one of a step's MoE GEMMs: a function of the shapes only. W4A16 (w4): one tiling for every
    batch with w4a16.py's BLOCK_K (the composed path's K order); the gated kernel's two fp32 FMA dots and two
    dequantized tiles need its narrow N tiles (16 x 16 x 32) to stay below 255 registers with no spills."""
    if INTERPRET:
        return dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=32)
    if w4:
        return dict(BLOCK_M=16, BLOCK_N=16 if gated else 64, BLOCK_K=32, num_warps=4, num_stages=3)
    if not quant:
        return dict(BLOCK_M=16, BLOCK_N=32 if gated else 64, BLOCK_K=64, num_warps=4, num_stages=3)
    if pairs <= 4 * experts:       # decode: about one row per touched expert, bandwidth bound
        return dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=64 if gated else 128, num_warps=4, num_stages=4)
    return dict(BLOCK_M=64, BLOCK_N=32 if gated else 64, BLOCK_K=32, num_warps=4, num_stages=3)


MOE_BUCKETS = ((1, 128), (4096, 128))       # (pairs, experts) of each A8W8 branch (the AOT test compiles both)
COMBINE_BLOCK = 1024


def align(topk_ids: torch.Tensor, num_experts: int, block_m: int):
    """The pairs laid out expert by expert, each expert's run padded to a multiple of block_m.

    topk_ids int64 [T, k] (distinct per row). Returns (sorted_pairs int32 [EM] (pair ids, P = T * k where
    padding), block_expert int32 [EM / block_m], num_padded int32 [1], perm int64 [T, k] (token t's j-th pair
    is its topk_ids[t, perm[t, j]]). EM = the padded length's upper bound, a function of the shapes only.
    Device ops with shapes fixed by (T, k, E, block_m): no host read."""
    t, k = topk_ids.shape
    p = t * k
    dev = topk_ids.device
    sorted_ids, perm = topk_ids.sort(dim=1, stable=True)
    flat = sorted_ids.reshape(-1)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=dev).scatter_add_(
        0, flat, torch.ones(p, dtype=torch.int64, device=dev))
    padded = (counts + block_m - 1) // block_m * block_m
    ends = torch.cumsum(padded, 0)
    starts = ends - padded
    order = torch.argsort(flat, stable=True)                  # pairs expert by expert, ascending within one
    expert_of = flat.index_select(0, order)
    first = torch.cumsum(counts, 0) - counts                  # each expert's first slot among the P pairs
    dest = starts.index_select(0, expert_of) + torch.arange(p, device=dev) - first.index_select(0, expert_of)
    em = triton.cdiv(p + min(num_experts, p) * (block_m - 1), block_m) * block_m
    sorted_pairs = torch.full((em,), p, dtype=torch.int32, device=dev)
    sorted_pairs.scatter_(0, dest, order.to(torch.int32))
    blocks = torch.arange(0, em, block_m, device=dev)
    block_expert = torch.searchsorted(ends, blocks, right=True).clamp_(max=num_experts - 1).to(torch.int32)
    # narrow, not ends[-1:]: fake CUDA tensors of a CPU-only torch cannot be sliced (tests/test_no_host_sync.py)
    return sorted_pairs, block_expert, ends.narrow(0, num_experts - 1, 1).to(torch.int32), perm


def moe_gemm(a: torch.Tensor, w: torch.Tensor, w_scale, sorted_pairs: torch.Tensor, block_expert: torch.Tensor,
             num_padded: torch.Tensor, pair_weights, num_pairs: int, a_div: int, gated: bool,
             out_dtype: torch.dtype, cfg: dict, w_zero=None, perm=None) -> torch.Tensor:
    """a [rows, K] (a row per token, a_div = k; or per pair, a_div = 1); w [E, N_w, K] int8 (w_scale fp32
    [E, N_w]), float, or packed int4 uint8 [E, N_w, ceil(K / 2)] (w_scale / w_zero fp32 [E, N_w, G]); -> y
    [num_pairs, N] in out_dtype (N = N_w / 2 gated, SwiGLU; times pair_weights [P] when given). perm (packed
    int4 only): the experts' act orders, int32 [E, K] (gated: gate and up share each), or [E, 2, K] gated (gate's
    and up's own)."""
    a = a if a.stride(-1) == 1 else a.contiguous()
    e, n_w, k = w.shape
    w4 = w.dtype == torch.uint8
    groups, gs = 1, 1
    if w4:
        k = a.shape[1]
        groups = w_scale.shape[2]
        gs = k // groups
        if w.shape[2] != (k + 1) // 2 or k % groups:
            raise ValueError(f"moe w4a16: rows of {k} columns, packed experts {tuple(w.shape)} in {groups} groups")
    perm_up = perm is not None and perm.dim() == 3
    if perm is not None and (not w4 or perm.dtype != torch.int32 or not perm.is_contiguous() or
                             tuple(perm.shape) not in ((e, k), (e, 2, k) if gated else (e, k))):
        raise ValueError(f"moe: perm {perm.dtype} {tuple(perm.shape)} is no int32 act order of packed int4 experts "
                         f"[{e}, {'2, ' if gated else ''}{k}] ({w.dtype} weights)")
    n = n_w // 2 if gated else n_w
    y = torch.empty((num_pairs, n), dtype=out_dtype, device=a.device)
    if num_pairs == 0:
        return y
    quant = w.dtype == torch.int8
    full = w4 or (not quant and (torch.float32 in (a.dtype, w.dtype) or a.dtype != w.dtype))   # W4: fp32 weight
    grid = (sorted_pairs.shape[0] // cfg["BLOCK_M"], triton.cdiv(n, cfg["BLOCK_N"]))
    moe_gemm_kernel[grid](a, w, w_scale if quant or w4 else w, w_zero if w4 else w,
                          pair_weights if pair_weights is not None else a, y,
                          sorted_pairs, block_expert, num_padded, perm if perm is not None else sorted_pairs,
                          num_pairs, n, k, groups, gs, a.stride(0), y.stride(0), A_DIV=a_div, QUANT=quant,
                          GATED=gated, MUL_W=pair_weights is not None, EVEN_K=k % cfg["BLOCK_K"] == 0,
                          OUT=out_code(out_dtype), INTERP=INTERPRET, PREC=int(full), W4=w4,
                          TILE_GROUP=w4 and gs % cfg["BLOCK_K"] == 0, HAS_PERM=perm is not None, PERM_UP=perm_up,
                          **cfg)
    return y


def moe_combine(contrib: torch.Tensor, topk: int) -> torch.Tensor:
    """contrib [T * k, H] (token t's pairs at t * k + j, ascending expert) -> [T, H], added in order."""
    p, h = contrib.shape
    t = p // topk
    y = torch.empty((t, h), dtype=contrib.dtype, device=contrib.device)
    block = min(COMBINE_BLOCK, triton.next_power_of_2(h))
    if t:
        moe_combine_kernel[(t, triton.cdiv(h, block))](contrib, y, h, TOPK=topk, BLOCK=block,
                                                        OUT=out_code(contrib.dtype))
    return y
