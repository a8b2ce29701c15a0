"""Paged attention over block tables (prefill, chunked prefill and decode in one kernel), the KV writes, and
TurboQuant: encode-and-write, attention in the rotated space, the row rotations.

The caches keep the layout of kv_cache/ (K in blocks of KW keys, transposed; V row by row): every key is
gathered through the block table with its own address, so any page size works and nothing is copied.

Batch invariance and row identity. A program takes BLOCK_T query tokens of one sequence times the G query
heads of one KV head (GQA: the K/V tile is read once for the group), and walks its keys in BLOCK_N blocks,
grouped in SPLIT-key splits, both at fixed absolute positions from key 0. Each split runs its own online
softmax and the splits merge in order (flash-decoding's partials, merged in the program; a parallel-split
decode kernel merging the same partials in the same order gives the same bits). Keys past a row's own
position (causal) or past the tile's last row are exact no-ops (p = 0, rescale by exp(0) = 1), so a row's
result depends only on its position and its context: the same bits in a whole prompt, a chunk, a decode step
or any batch. The tile shapes never depend on the batch.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import INTERPRET, fdot, out_code, round_out

# GPU: 16 query tokens x the group's heads per tile, 64-key blocks, 512-key splits. Interpreter: smaller, so
# that tests on short contexts cross blocks, splits and pages.
TILE = dict(BLOCK_T=4, BLOCK_N=16, SPLIT=32) if INTERPRET else dict(BLOCK_T=16, BLOCK_N=64, SPLIT=512)
GPU_LAUNCH = {} if INTERPRET else dict(num_warps=4, num_stages=2)


@triton.jit
def _tile_of(pid, qsl_ptr, B, BLOCK_T: tl.constexpr):
    """The (sequence, first query of the tile) of program pid: tiles of each sequence, in sequence order,
    counted from the device's query_start_loc (no host copy of it). b == B: a spare program."""
    b = pid * 0
    before = pid * 0
    for i in range(0, B):
        n = tl.load(qsl_ptr + i + 1) - tl.load(qsl_ptr + i)
        tiles = (n + BLOCK_T - 1) // BLOCK_T
        take = (before + tiles <= pid) & (b == i)
        b = tl.where(take, i + 1, b)
        before = tl.where(take, before + tiles, before)
    return b, (pid - before) * BLOCK_T


@triton.jit
def attention_kernel(q_ptr, o_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, cent_ptr, bt_ptr, qsl_ptr, lens_ptr, B, sm_scale,
                     stride_qt, stride_qh, stride_ot, stride_oh,
                     stride_kp, stride_kh, stride_kb, stride_vp, stride_vh, stride_vs,
                     stride_sp, stride_sh, stride_bt,
                     G: tl.constexpr, GP: tl.constexpr, HALF: tl.constexpr, PAGE: tl.constexpr, KW: tl.constexpr,
                     BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr, TQ: tl.constexpr,
                     OUT: tl.constexpr, PD: tl.constexpr, INTERP: tl.constexpr, IEEE: tl.constexpr):
    """Dense (TQ = False): K [P, KVH, S/KW, D, KW], V [P, KVH, S, D] in the model dtype.
    TQ: K codes [P, KVH, S/KW, D/2, KW], V codes [P, KVH, S, D/2] uint8 (nibble c | nibble c + D/2 << 4),
    scales [P, KVH, S] fp32, q already rotated (fp32), output in the rotated space (fp32).
    Both halves of head_dim are kept apart (the TQ byte holds one dim of each), the same for dense."""
    pid = tl.program_id(0)
    kvh = tl.program_id(1)
    b, t0 = _tile_of(pid, qsl_ptr, B, BLOCK_T)
    live = b < B
    bb = tl.where(live, b, 0)
    q_lo = tl.load(qsl_ptr + bb)
    n_q = tl.where(live, tl.load(qsl_ptr + bb + 1) - q_lo, 0)
    seq_len = tl.load(lens_ptr + bb)

    r = tl.arange(0, BLOCK_T * GP)
    t = t0 + r // GP
    g = r % GP
    row_ok = (t < n_q) & (g < G)
    q_pos = seq_len - n_q + t
    head = kvh * G + g
    c = tl.arange(0, HALF)
    q_rows = q_ptr + (q_lo + t)[:, None] * stride_qt + head[:, None] * stride_qh + c[None, :]
    qa = tl.load(q_rows, mask=row_ok[:, None], other=0.0)
    qb = tl.load(q_rows + HALF, mask=row_ok[:, None], other=0.0)

    # keys this tile needs: up to its last row's position
    last = tl.max(tl.where(row_ok, q_pos, -1), axis=0)
    hi = tl.where(n_q > t0, last + 1, 0)

    m_tot = tl.full((BLOCK_T * GP,), float("-inf"), tl.float32)
    l_tot = tl.zeros((BLOCK_T * GP,), tl.float32)
    acc_a = tl.zeros((BLOCK_T * GP, HALF), tl.float32)
    acc_b = tl.zeros((BLOCK_T * GP, HALF), tl.float32)
    for s0 in range(0, hi, SPLIT):
        m = tl.full((BLOCK_T * GP,), float("-inf"), tl.float32)
        l = tl.zeros((BLOCK_T * GP,), tl.float32)
        sa = tl.zeros((BLOCK_T * GP, HALF), tl.float32)
        sb = tl.zeros((BLOCK_T * GP, HALF), tl.float32)
        for n0 in range(s0, tl.minimum(s0 + SPLIT, hi), BLOCK_N):
            j = n0 + tl.arange(0, BLOCK_N)
            j_ok = j < hi
            page = tl.load(bt_ptr + bb * stride_bt + j // PAGE, mask=j_ok, other=0).to(tl.int64)
            off = j % PAGE
            kbase = k_ptr + page * stride_kp + kvh * stride_kh + (off // KW) * stride_kb + off % KW
            vbase = v_ptr + page * stride_vp + kvh * stride_vh + off * stride_vs
            if TQ:
                kc = tl.load(kbase[None, :] + c[:, None] * KW, mask=j_ok[None, :], other=0).to(tl.int32)
                ka = tl.load(cent_ptr + (kc & 15))
                kb = tl.load(cent_ptr + (kc >> 4))
                k_scale = tl.load(ks_ptr + page * stride_sp + kvh * stride_sh + off, mask=j_ok, other=0.0)
                s = (fdot(qa, ka, INTERP, True) + fdot(qb, kb, INTERP, True)) * k_scale[None, :]
            else:
                ka = tl.load(kbase[None, :] + c[:, None] * KW, mask=j_ok[None, :], other=0.0)
                kb = tl.load(kbase[None, :] + (c + HALF)[:, None] * KW, mask=j_ok[None, :], other=0.0)
                s = fdot(qa, ka, INTERP, IEEE) + fdot(qb, kb, INTERP, IEEE)
            s = s * sm_scale
            visible = (j[None, :] <= q_pos[:, None]) & j_ok[None, :] & row_ok[:, None]
            s = tl.where(visible, s, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, axis=1))
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp(m - m_use)
            p = tl.exp(s - m_use[:, None])
            l = l * alpha + tl.sum(p, axis=1)
            if TQ:
                vc = tl.load(vbase[:, None] + c[None, :], mask=j_ok[:, None], other=0).to(tl.int32)
                v_scale = tl.load(vs_ptr + page * stride_sp + kvh * stride_sh + off, mask=j_ok, other=0.0)
                pv = p * v_scale[None, :]
                sa = sa * alpha[:, None] + fdot(pv, tl.load(cent_ptr + (vc & 15)), INTERP, True)
                sb = sb * alpha[:, None] + fdot(pv, tl.load(cent_ptr + (vc >> 4)), INTERP, True)
            else:
                va = tl.load(vbase[:, None] + c[None, :], mask=j_ok[:, None], other=0.0)
                vb = tl.load(vbase[:, None] + (c + HALF)[None, :], mask=j_ok[:, None], other=0.0)
                # p = p_hi + p_lo, both in V's dtype, for two 16-bit MMAs: p keeps ~16 bits (one 16-bit p
                # would keep 8), each product is exact in the fp32 accumulator. fp32 V: one full-precision dot.
                p_hi = round_out(p, PD)
                p_lo = round_out(p - p_hi.to(tl.float32), PD)
                sa = sa * alpha[:, None] + fdot(p_hi, va, INTERP, IEEE)
                sb = sb * alpha[:, None] + fdot(p_hi, vb, INTERP, IEEE)
                if PD != 0:
                    sa += fdot(p_lo, va, INTERP, IEEE)
                    sb += fdot(p_lo, vb, INTERP, IEEE)
            m = m_new
        big = tl.maximum(m_tot, m)
        big_use = tl.where(big == float("-inf"), 0.0, big)
        a_tot = tl.exp(m_tot - big_use)
        a_s = tl.exp(m - big_use)
        l_tot = l_tot * a_tot + l * a_s
        acc_a = acc_a * a_tot[:, None] + sa * a_s[:, None]
        acc_b = acc_b * a_tot[:, None] + sb * a_s[:, None]
        m_tot = big
    inv = 1.0 / tl.where(l_tot > 0, l_tot, 1.0)
    o_rows = o_ptr + (q_lo + t)[:, None] * stride_ot + head[:, None] * stride_oh + c[None, :]
    tl.store(o_rows, round_out(acc_a * inv[:, None], OUT), mask=row_ok[:, None])
    tl.store(o_rows + HALF, round_out(acc_b * inv[:, None], OUT), mask=row_ok[:, None])


def _launch(q, out, k, v, ks, vs, cent, block_tables, query_start_loc, seq_lens, scale, tq: bool):
    t, h, d = q.shape
    kvh = k.shape[1]
    page = v.shape[2]
    kw = k.shape[-1]
    g = h // kvh
    b = block_tables.shape[0]
    if t == 0 or b == 0:
        return out
    cfg = TILE
    # an upper bound of the tiles, from shapes only: sum_b ceil(n_b / BLOCK_T) <= ceil(T / BLOCK_T) + B
    grid = (triton.cdiv(t, cfg["BLOCK_T"]) + b, kvh)
    dummy = seq_lens
    attention_kernel[grid](
        q, out, k, v, ks if tq else dummy, vs if tq else dummy, cent if tq else dummy, block_tables,
        query_start_loc, seq_lens, b, float(scale),
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2),
        ks.stride(0) if tq else 0, ks.stride(1) if tq else 0, block_tables.stride(0),
        G=g, GP=triton.next_power_of_2(g), HALF=d // 2, PAGE=page, KW=kw, TQ=tq, OUT=out_code(out.dtype),
        PD=out_code(v.dtype) if not tq else 0, INTERP=INTERPRET, IEEE=q.dtype == torch.float32, **cfg,
        **GPU_LAUNCH)
    return out


def paged_attention(q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, scale):
    q = q if q.stride(-1) == 1 else q.contiguous()
    out = torch.empty_like(q)
    return _launch(q, out, k_cache, v_cache, None, None, None, block_tables, query_start_loc, seq_lens, scale,
                   False)


@triton.jit
def write_kv_kernel(k_ptr, v_ptr, kc_ptr, vc_ptr, slot_ptr, stride_kt, stride_kh, stride_vt, stride_vh,
                    stride_kp, stride_kkh, stride_kb, stride_vp, stride_vkh, stride_vs,
                    D: tl.constexpr, PAGE: tl.constexpr, KW: tl.constexpr):
    t = tl.program_id(0)
    h = tl.program_id(1)
    slot = tl.load(slot_ptr + t)
    if slot >= 0:                      # a negative slot is a padding row (nothing to write)
        page = slot // PAGE
        off = slot % PAGE
        d = tl.arange(0, D)
        k = tl.load(k_ptr + t * stride_kt + h * stride_kh + d)
        v = tl.load(v_ptr + t * stride_vt + h * stride_vh + d)
        tl.store(kc_ptr + page * stride_kp + h * stride_kkh + (off // KW) * stride_kb + d * KW + off % KW, k)
        tl.store(vc_ptr + page * stride_vp + h * stride_vkh + off * stride_vs + d, v)


def write_kv(k, v, k_cache, v_cache, slot_mapping):
    t, kvh, d = k.shape
    if t == 0:
        return
    k = k.to(k_cache.dtype)
    v = v.to(v_cache.dtype)
    write_kv_kernel[(t, kvh)](k, v, k_cache, v_cache, slot_mapping, k.stride(0), k.stride(1), v.stride(0),
                              v.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), v_cache.stride(0),
                              v_cache.stride(1), v_cache.stride(2), D=d, PAGE=v_cache.shape[2], KW=k_cache.shape[-1])


# ----- TurboQuant -------------------------------------------------------------------------------------------

@triton.jit
def rotate_kernel(x_ptr, r_ptr, y_ptr, M, stride_xm, stride_ym, stride_r0, stride_r1,
                  D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, OUT: tl.constexpr,
                  INTERP: tl.constexpr):
    """y = x @ R (R read through strides: R^T is the same kernel), fp32 at full precision."""
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rk = tl.arange(0, BLOCK_K)
    cols = tl.arange(0, D)
    m_ok = rm < M
    acc = tl.zeros((BLOCK_M, D), tl.float32)
    for k0 in range(0, D, BLOCK_K):
        xt = tl.load(x_ptr + rm[:, None] * stride_xm + (k0 + rk)[None, :], mask=m_ok[:, None], other=0.0)
        rt = tl.load(r_ptr + (k0 + rk)[:, None] * stride_r0 + cols[None, :] * stride_r1)
        acc += fdot(xt, rt, INTERP, True)
    tl.store(y_ptr + rm[:, None] * stride_ym + cols[None, :], round_out(acc, OUT), mask=m_ok[:, None])


def rotate(x2: torch.Tensor, rotation: torch.Tensor, out_dtype: torch.dtype, transpose: bool = False):
    """Rows x2 [M, D] times R (or R^T) -> [M, D] in out_dtype. One tiling for every M (batch invariance)."""
    m, d = x2.shape
    y = torch.empty((m, d), dtype=out_dtype, device=x2.device)
    s0, s1 = (rotation.stride(1), rotation.stride(0)) if transpose else (rotation.stride(0), rotation.stride(1))
    if m:
        block_m = 16
        rotate_kernel[(triton.cdiv(m, block_m),)](x2, rotation, y, m, x2.stride(0), y.stride(0), s0, s1, D=d,
                                                  BLOCK_M=block_m, BLOCK_K=min(d, 32), OUT=out_code(out_dtype),
                                                  INTERP=INTERPRET)
    return y


def tq_paged_attention(q, k_codes, k_scales, v_codes, v_scales, block_tables, query_start_loc, seq_lens, rotation,
                       centroids, scale):
    t, h, d = q.shape
    q_rot = rotate(q.reshape(t * h, d), rotation, torch.float32).reshape(t, h, d)
    o_rot = torch.empty_like(q_rot)
    _launch(q_rot, o_rot, k_codes, v_codes, k_scales, v_scales, centroids, block_tables, query_start_loc, seq_lens,
            scale, True)
    return rotate(o_rot.reshape(t * h, d), rotation, q.dtype, transpose=True).reshape(t, h, d)


@triton.jit
def tq_write_kernel(x_ptr, codes_ptr, scales_ptr, slot_ptr, r_ptr, cent_ptr, bnd_ptr, stride_xt, stride_xh,
                    stride_cp, stride_ch, stride_cb, stride_sp, stride_sh,
                    HALF: tl.constexpr, PAGE: tl.constexpr, KW: tl.constexpr, CB: tl.constexpr):
    """Encode one row (token t, KV head h) like kv_cache/tq_codec.tq_encode and store it. CB: the codes' key
    block (KW for the blocked K codes; 1 for V codes, whose stride_cb is then the row stride)."""
    t = tl.program_id(0)
    h = tl.program_id(1)
    slot = tl.load(slot_ptr + t)
    if slot >= 0:
        page = slot // PAGE
        off = slot % PAGE
        i = tl.arange(0, HALF)
        xa = tl.load(x_ptr + t * stride_xt + h * stride_xh + i).to(tl.float32)
        xb = tl.load(x_ptr + t * stride_xt + h * stride_xh + HALF + i).to(tl.float32)
        n = tl.sqrt_rn(tl.sum(xa * xa, axis=0) + tl.sum(xb * xb, axis=0) + 1e-6)
        ua = tl.div_rn(xa, tl.zeros_like(xa) + n)
        ub = tl.div_rn(xb, tl.zeros_like(xb) + n)
        # y = u @ R, as two output halves; R [2 HALF, 2 HALF] row-major
        ra = r_ptr + i[:, None] * (2 * HALF) + i[None, :]
        rb = r_ptr + (i + HALF)[:, None] * (2 * HALF) + i[None, :]
        ya = tl.sum(ua[:, None] * tl.load(ra), axis=0) + tl.sum(ub[:, None] * tl.load(rb), axis=0)
        yb = tl.sum(ua[:, None] * tl.load(ra + HALF), axis=0) + tl.sum(ub[:, None] * tl.load(rb + HALF), axis=0)
        nb = tl.arange(0, 16)
        bnd = tl.load(bnd_ptr + nb, mask=nb < 15, other=float("inf"))
        ia = tl.sum((bnd[None, :] < ya[:, None]).to(tl.int32), axis=1)     # torch.bucketize (right=False)
        ib = tl.sum((bnd[None, :] < yb[:, None]).to(tl.int32), axis=1)
        ca = tl.load(cent_ptr + ia)
        cb = tl.load(cent_ptr + ib)
        norm_c = tl.sqrt_rn(tl.sum(ca * ca, axis=0) + tl.sum(cb * cb, axis=0))
        tl.store(codes_ptr + page * stride_cp + h * stride_ch + (off // CB) * stride_cb + i * CB + off % CB,
                 (ia | (ib << 4)).to(tl.uint8))
        tl.store(scales_ptr + page * stride_sp + h * stride_sh + off, tl.div_rn(n, norm_c))


def tq_write(k, v, k_codes, k_scales, v_codes, v_scales, slot_mapping, rotation, centroids, boundaries):
    t, kvh, d = k.shape
    if t == 0:
        return
    page = v_codes.shape[2]
    kw = k_codes.shape[-1]
    for x, codes, scales, cb, stride_cb in ((k, k_codes, k_scales, kw, k_codes.stride(2)),
                                            (v, v_codes, v_scales, 1, v_codes.stride(2))):
        tq_write_kernel[(t, kvh)](x, codes, scales, slot_mapping, rotation, centroids, boundaries, x.stride(0),
                                  x.stride(1), codes.stride(0), codes.stride(1), stride_cb, scales.stride(0),
                                  scales.stride(1), HALF=d // 2, PAGE=page, KW=kw, CB=cb)
