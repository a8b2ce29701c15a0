"""Emulations of the torch_npu ops the npu kernel set calls, written from their documented semantics (torch_npu's
API reference and how vllm-ascend calls them): shapes, dtypes, layouts, scale conventions and argument
constraints are checked, the math is done in fp32 / exact integers. A stand-in for `torch_npu` in
kernels.npu.kernel_set(...), so that the day the set meets an NPU only the numerics remain to check."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from backend_lib.kernels import reference as ref


def npu_dynamic_quant(x: torch.Tensor, smooth_scales=None):
    """Per-token symmetric int8: scale = max|x| / 127 per row (fp32, shape x.shape[:-1]); y = round(x / scale).
    (The docs do not say what an all-zero row gives; here scale 1, as the reference.)"""
    assert smooth_scales is None
    assert x.dtype in (torch.float16, torch.bfloat16), f"npu_dynamic_quant: {x.dtype} input"
    xf = x.float()
    amax = xf.abs().amax(-1)
    scale = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax))
    y = torch.clamp(torch.round(xf / scale[..., None]), -128, 127).to(torch.int8)
    return y, scale


def npu_quant_matmul(x1, x2, scale, *, offset=None, pertoken_scale=None, bias=None, output_dtype=None):
    """x1 int8 [M, K] @ x2 int8 [K, N] with int32 accumulation; out = acc * scale[N] * pertoken_scale[M, 1] in
    fp32, cast to output_dtype (bf16 / fp16 with a per-token scale)."""
    assert x1.dtype == torch.int8 and x2.dtype == torch.int8 and x1.dim() == 2 and x2.dim() == 2
    assert x1.shape[1] == x2.shape[0], f"npu_quant_matmul: x1 {tuple(x1.shape)} x2 {tuple(x2.shape)}"
    assert scale.shape == (x2.shape[1],) and scale.dtype in (torch.float32, torch.bfloat16)
    assert offset is None and bias is None
    assert pertoken_scale is not None and pertoken_scale.shape == (x1.shape[0],)
    assert pertoken_scale.dtype == torch.float32
    assert output_dtype in (torch.bfloat16, torch.float16), "a per-token scale needs a bf16 / fp16 output"
    acc = ref.int8_matmul(x1, x2.t())
    return (acc.float() * scale.float()[None, :] * pertoken_scale[:, None]).to(output_dtype)


def npu_rms_norm(x, gamma, epsilon=1e-6):
    """(y, rstd): rstd = 1 / sqrt(mean(x^2) + eps) over the last dim (fp32, keepdim); y = x * rstd * gamma."""
    assert gamma.shape == x.shape[-1:]
    xf = x.float()
    rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + epsilon)
    return (xf * rstd * gamma.float()).to(x.dtype), rstd


def npu_add_rms_norm(x1, x2, gamma, epsilon=1e-6):
    """(y, rstd, x) with x = x1 + x2 (in their dtype) and y = npu_rms_norm(x)."""
    assert x1.shape == x2.shape and x1.dtype == x2.dtype
    x = x1 + x2
    y, rstd = npu_rms_norm(x, gamma, epsilon)
    return y, rstd, x


def npu_swiglu(x, dim=-1):
    """x split in two halves along dim: silu(a) * b (fp32 math)."""
    a, b = x.float().chunk(2, dim=dim)
    return (F.silu(a) * b).to(x.dtype)


def _npu_reshape_and_cache(*, key, value, key_cache, value_cache, slot_indices):
    """key / value [T, KVH, D] into the caches [blocks, block_size, KVH, D] at slot = block * block_size + offset."""
    assert slot_indices.dtype == torch.int32 and key.shape[1:] == key_cache.shape[2:]
    assert key_cache.shape == value_cache.shape and key.dtype == key_cache.dtype
    key_cache.view(-1, *key_cache.shape[2:])[slot_indices.long()] = key
    value_cache.view(-1, *value_cache.shape[2:])[slot_indices.long()] = value


def npu_fused_infer_attention_score(query, key, value, *, atten_mask, block_table, input_layout, block_size,
                                    actual_seq_lengths, actual_seq_lengths_kv, num_heads, num_key_value_heads,
                                    scale, sparse_mode):
    """Paged attention, TND queries [T, N, D]; key / value the paged caches as (blocks, block_size, KVH * D);
    actual_seq_lengths: cumulative query ends per sequence, actual_seq_lengths_kv: context lengths (host lists);
    sparse_mode 3 ("rightDownCausal") with the 2048 x 2048 upper-triangular mask: row i of a sequence's n
    queries sees keys <= L - n + i. Returns (attention_out [T, N, D] in the query dtype, softmax_lse)."""
    assert input_layout == "TND" and sparse_mode == 3
    assert isinstance(actual_seq_lengths, list) and isinstance(actual_seq_lengths_kv, list)
    assert atten_mask.shape == (2048, 2048) and atten_mask.dtype == torch.bool
    assert block_size % 16 == 0 and key.shape[1] == block_size and key.shape == value.shape
    t, n, d = query.shape
    assert n == num_heads and key.shape[2] == num_key_value_heads * d and block_table.dtype == torch.int32
    k_rows = key.view(key.shape[0], block_size, num_key_value_heads, d)
    v_rows = value.view_as(k_rows)
    out = torch.empty_like(query)
    lse = torch.empty(t, n, dtype=torch.float32)
    start = 0
    for b, (end, length) in enumerate(zip(actual_seq_lengths, actual_seq_lengths_kv)):
        pages = block_table[b, :-(-length // block_size)].long()
        k = k_rows[pages].reshape(-1, num_key_value_heads, d)[:length].permute(1, 0, 2)    # [KVH, L, D]
        v = v_rows[pages].reshape(-1, num_key_value_heads, d)[:length].permute(1, 0, 2)
        q = query[start:end]
        out[start:end] = ref.attend(q, k, v, length, scale).to(query.dtype)
        start = end
    return out, lse
