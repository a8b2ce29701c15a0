"""Pure-PyTorch reference kernels: correct on any device, the yardstick for every optimized kernel.

Shapes and slot semantics: kernels/contract.py.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ...kv_cache.layout import key_blocks_to_rows
from ...kv_cache.tq_codec import tq_encode, tq_unpack


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm as Qwen3 computes it: normalize in fp32, round to x.dtype, then scale by weight."""
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float):
    """h = x + residual (in x.dtype); returns (rms_norm(h), h)."""
    h = x + residual
    return rms_norm(h, weight, eps), h


def rotary_cos_sin(head_dim: int, max_positions: int, theta: float, device=None) -> torch.Tensor:
    """[max_positions, head_dim] fp32 table of unscaled RoPE: cos of the half frequencies, then sin (rotate-half
    RoPE). The table of every rope type is built by backend_lib.checkpoint.rope.RopeConfig.cos_sin."""
    from ...checkpoint.rope import RopeConfig

    return RopeConfig(theta=theta).cos_sin(head_dim, max_positions, device)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    xf = x.float()
    x1, x2 = xf[..., :half], xf[..., half:]
    out = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
    return out.to(x.dtype)


def rotary(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor):
    """Rotate-half RoPE on q [T, H, D] and k [T, KVH, D] at the given positions (fp32 math)."""
    half = q.shape[-1] // 2
    cs = cos_sin.index_select(0, positions.long())
    cos, sin = cs[:, None, :half], cs[:, None, half:]
    return _rotate(q, cos, sin), _rotate(k, cos, sin)


def silu_mul(x: torch.Tensor) -> torch.Tensor:
    """SwiGLU on a fused [gate | up] projection: silu(gate) * up."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def quantize_per_token(x: torch.Tensor):
    """Dynamic symmetric int8 per row: s = max|x| / 127, q = clamp(round_half_even(x / s), -128, 127)."""
    xf = x.float()
    amax = xf.abs().amax(dim=-1, keepdim=True)
    scale = amax / 127.0
    scale = torch.where(amax > 0, scale, torch.ones_like(scale))
    q = torch.clamp(torch.round(xf / scale), -128, 127).to(torch.int8)
    return q, scale


# Every int8 product is at most 128 * 128 = 2**14 in magnitude, so a sum of 1024 of them stays within 2**24,
# where fp32 holds every integer: an fp32 matmul over K-chunks of 1024 is exact in any summation order (and
# with TF32 / bf16 / fp16 operands too, which hold every int8 exactly), and the chunks add up in int32.
# Hand-written because no accelerator has an integer matmul in PyTorch (addmm_cuda is not implemented for
# Int, torch._int_mm refuses M <= 16 on CUDA), and torch._int_mm on the CPU returns garbage at K = 1.
EXACT_FP32_CHUNK = 1024


def int8_matmul(q: torch.Tensor, w_q: torch.Tensor) -> torch.Tensor:
    """int8 [M, K] x int8 [N, K]^T -> int32 [M, N], exact, with no integer matmul (runs on any device)."""
    k = q.shape[-1]
    acc = torch.zeros((q.shape[0], w_q.shape[0]), dtype=torch.int32, device=q.device)
    for k0 in range(0, k, EXACT_FP32_CHUNK):
        part = q[:, k0:k0 + EXACT_FP32_CHUNK].float() @ w_q[:, k0:k0 + EXACT_FP32_CHUNK].float().t()
        acc += part.to(torch.int32)
    return acc


def a8w8_linear(x: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor) -> torch.Tensor:
    """y = x W^T with int8 per-token activations and int8 per-channel weights (w_scale fp32 [N])."""
    shape = x.shape
    q, s = quantize_per_token(x.reshape(-1, shape[-1]))
    acc = int8_matmul(q, w_q)
    y = acc.float() * s * w_scale.float()[None, :]
    return y.to(x.dtype).reshape(*shape[:-1], w_q.shape[0])


def float_linear(x: torch.Tensor, w: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """y = x W^T accumulated in fp32; output in out_dtype (default x.dtype)."""
    y = F.linear(x.float(), w.float())
    return y.to(out_dtype or x.dtype)


def write_kv(k, v, k_cache, v_cache, slot_mapping):
    """Scatter new K/V rows [T, KVH, D] into the paged caches at slot_mapping (K blocked and transposed)."""
    page_size = v_cache.shape[2]
    kw = k_cache.shape[-1]
    pages = slot_mapping // page_size
    offs = slot_mapping % page_size
    k_cache[pages, :, offs // kw, :, offs % kw] = k.to(k_cache.dtype)
    v_cache[pages, :, offs] = v.to(v_cache.dtype)


def gather_context(cache: torch.Tensor, block_table: torch.Tensor, length: int, blocked: bool = False):
    """The first `length` rows of one sequence from a paged cache, as [KVH, length, X].

    cache: [P, KVH, S, X], or the blocked key layout [P, KVH, S/KW, X, KW] with blocked=True.
    """
    if blocked:
        cache = key_blocks_to_rows(cache)
    page_size = cache.shape[2]
    n_pages = (length + page_size - 1) // page_size
    pages = cache[block_table[:n_pages].long()]            # [n, KVH, S, X]
    ctx = pages.permute(1, 0, 2, 3).reshape(cache.shape[1], n_pages * page_size, cache.shape[3])
    return ctx[:, :length]


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seq_len: int, scale: float) -> torch.Tensor:
    """Causal GQA attention for the last q.shape[0] positions of a sequence of seq_len tokens.

    q [Q, H, D]; k, v [KVH, seq_len, D] (any float dtype). Returns [Q, H, D] in fp32.
    """
    nq, h, d = q.shape
    kvh = k.shape[0]
    group = h // kvh
    qf = q.float().permute(1, 0, 2)                        # [H, Q, D]
    kf = k.float().repeat_interleave(group, dim=0)         # [H, L, D]
    vf = v.float().repeat_interleave(group, dim=0)
    scores = torch.matmul(qf, kf.transpose(1, 2)) * scale  # [H, Q, L]
    q_pos = torch.arange(seq_len - nq, seq_len, device=q.device)[:, None]
    k_pos = torch.arange(seq_len, device=q.device)[None, :]
    scores = scores.masked_fill(k_pos > q_pos, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return torch.matmul(probs, vf).permute(1, 0, 2)        # [Q, H, D]


def paged_attention(q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, scale):
    """Causal attention of each sequence's new queries over its whole paged context (prefill and decode)."""
    out = torch.empty_like(q)
    qsl = query_start_loc.tolist()
    lens = seq_lens.tolist()
    for b, seq_len in enumerate(lens):
        lo, hi = qsl[b], qsl[b + 1]
        if hi == lo:
            continue
        k = gather_context(k_cache, block_tables[b], seq_len, blocked=True)
        v = gather_context(v_cache, block_tables[b], seq_len)
        out[lo:hi] = attend(q[lo:hi], k, v, seq_len, scale).to(q.dtype)
    return out


# ----- TurboQuant 4-bit KV cache (MSE variant), see shared spec turboquant.md ---------------------------

def tq_write(k, v, k_codes, k_scales, v_codes, v_scales, slot_mapping, rotation, centroids, boundaries):
    """Encode K/V rows into the pages: K codes [P, KVH, S/KW, D/2, KW] (blocked), V codes [P, KVH, S, D/2]."""
    page_size = v_codes.shape[2]
    kw = k_codes.shape[-1]
    pages, offs = slot_mapping // page_size, slot_mapping % page_size
    c, s = tq_encode(k, rotation, centroids, boundaries)
    k_codes[pages, :, offs // kw, :, offs % kw] = c
    k_scales[pages, :, offs] = s
    c, s = tq_encode(v, rotation, centroids, boundaries)
    v_codes[pages, :, offs] = c
    v_scales[pages, :, offs] = s


def tq_paged_attention(q, k_codes, k_scales, v_codes, v_scales, block_tables, query_start_loc, seq_lens, rotation,
                       centroids, scale):
    """Attention in the rotated space: q_rot = q R; scores from centroids * scales; o = o_rot R^T."""
    out = torch.empty_like(q)
    qsl, lens = query_start_loc.tolist(), seq_lens.tolist()
    for b, seq_len in enumerate(lens):
        lo, hi = qsl[b], qsl[b + 1]
        if hi == lo:
            continue
        k_rot = centroids[tq_unpack(gather_context(k_codes, block_tables[b], seq_len, blocked=True))] \
            * gather_context(k_scales[..., None], block_tables[b], seq_len)
        v_rot = centroids[tq_unpack(gather_context(v_codes, block_tables[b], seq_len))] \
            * gather_context(v_scales[..., None], block_tables[b], seq_len)
        q_rot = q[lo:hi].float() @ rotation
        o_rot = attend(q_rot, k_rot, v_rot, seq_len, scale)
        out[lo:hi] = (o_rot @ rotation.t()).to(q.dtype)
    return out


def qk_norm_rope(qkv, q_w, k_w, positions, cos_sin, num_heads: int, num_kv_heads: int, eps: float):
    """Qwen3 attention prologue on the fused qkv projection: per-head q/k RMSNorm, RoPE; returns q, k, v."""
    t = qkv.shape[0]
    d = cos_sin.shape[1]
    q, k, v = qkv.split([num_heads * d, num_kv_heads * d, num_kv_heads * d], dim=-1)
    q = rms_norm(q.reshape(t, num_heads, d), q_w, eps)
    k = rms_norm(k.reshape(t, num_kv_heads, d), k_w, eps)
    q, k = rotary(q, k, positions, cos_sin)
    return q, k, v.reshape(t, num_kv_heads, d)
