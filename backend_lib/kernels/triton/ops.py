"""The Triton kernels as torch custom ops (`torch.ops.qwen3_triton.*`) with fake implementations.

As custom ops they are opaque to torch.compile and CUDA-graph capture, and under FakeTensorMode their fakes
give the output shapes without running anything: that is how the no-host-sync test runs a decode step's glue
on `device="cuda"` tensors on a CPU-only machine. Outputs never alias inputs (a custom op's rule), so v of
qk_norm_rope is sliced outside (kernel_set.py).
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor
from torch.library import custom_op

from . import attention, linear, moe, norm, w4a16


@custom_op("qwen3_triton::a8w8_linear", mutates_args=())
def a8w8_linear(x: Tensor, w_q: Tensor, w_scale: Tensor) -> Tensor:
    return linear.a8w8_linear(x, w_q, w_scale)


@a8w8_linear.register_fake
def _(x, w_q, w_scale):
    return x.new_empty((*x.shape[:-1], w_q.shape[0]))


@custom_op("qwen3_triton::w4a16_linear", mutates_args=())
def w4a16_linear(x: Tensor, packed: Tensor, scales: Tensor, zeros: Tensor, perm: Optional[Tensor]) -> Tensor:
    return w4a16.w4a16_linear(x, packed, scales, zeros, perm)


@w4a16_linear.register_fake
def _(x, packed, scales, zeros, perm):
    return x.new_empty((*x.shape[:-1], packed.shape[0]))


@custom_op("qwen3_triton::float_linear", mutates_args=())
def float_linear(x: Tensor, w: Tensor, out_dtype: Optional[torch.dtype] = None) -> Tensor:
    return linear.float_linear(x, w, out_dtype)


@float_linear.register_fake
def _(x, w, out_dtype=None):
    return x.new_empty((*x.shape[:-1], w.shape[0]), dtype=out_dtype or x.dtype)


@custom_op("qwen3_triton::rms_norm", mutates_args=())
def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    return norm.rms_norm(x, weight, eps)


@rms_norm.register_fake
def _(x, weight, eps):
    return x.new_empty(x.shape, dtype=torch.promote_types(weight.dtype, x.dtype))


@custom_op("qwen3_triton::add_rms_norm", mutates_args=())
def add_rms_norm(x: Tensor, residual: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    return norm.add_rms_norm(x, residual, weight, eps)


@add_rms_norm.register_fake
def _(x, residual, weight, eps):
    return x.new_empty(x.shape, dtype=torch.promote_types(weight.dtype, x.dtype)), x.new_empty(x.shape)


@custom_op("qwen3_triton::qk_norm_rope", mutates_args=())
def qk_norm_rope(qkv: Tensor, q_w: Tensor, k_w: Tensor, positions: Tensor, cos_sin: Tensor, num_heads: int,
                 num_kv_heads: int, eps: float) -> tuple[Tensor, Tensor]:
    q, k, _ = norm.qk_norm_rope(qkv, q_w, k_w, positions, cos_sin, num_heads, num_kv_heads, eps)
    return q, k


@qk_norm_rope.register_fake
def _(qkv, q_w, k_w, positions, cos_sin, num_heads, num_kv_heads, eps):
    t, d = qkv.shape[0], cos_sin.shape[1]
    return qkv.new_empty((t, num_heads, d)), qkv.new_empty((t, num_kv_heads, d))


@custom_op("qwen3_triton::silu_mul", mutates_args=())
def silu_mul(x: Tensor) -> Tensor:
    return norm.silu_mul(x)


@silu_mul.register_fake
def _(x):
    return x.new_empty((*x.shape[:-1], x.shape[-1] // 2))


@custom_op("qwen3_triton::write_kv", mutates_args=("k_cache", "v_cache"))
def write_kv(k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor) -> None:
    attention.write_kv(k, v, k_cache, v_cache, slot_mapping)


@write_kv.register_fake
def _(k, v, k_cache, v_cache, slot_mapping):
    return None


@custom_op("qwen3_triton::paged_attention", mutates_args=())
def paged_attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, block_tables: Tensor, query_start_loc: Tensor,
                    seq_lens: Tensor, scale: float) -> Tensor:
    return attention.paged_attention(q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, scale)


@paged_attention.register_fake
def _(q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, scale):
    return torch.empty_like(q)


@custom_op("qwen3_triton::tq_write", mutates_args=("k_codes", "k_scales", "v_codes", "v_scales"))
def tq_write(k: Tensor, v: Tensor, k_codes: Tensor, k_scales: Tensor, v_codes: Tensor, v_scales: Tensor,
             slot_mapping: Tensor, rotation: Tensor, centroids: Tensor, boundaries: Tensor) -> None:
    attention.tq_write(k, v, k_codes, k_scales, v_codes, v_scales, slot_mapping, rotation, centroids, boundaries)


@tq_write.register_fake
def _(k, v, k_codes, k_scales, v_codes, v_scales, slot_mapping, rotation, centroids, boundaries):
    return None


@custom_op("qwen3_triton::tq_paged_attention", mutates_args=())
def tq_paged_attention(q: Tensor, k_codes: Tensor, k_scales: Tensor, v_codes: Tensor, v_scales: Tensor,
                       block_tables: Tensor, query_start_loc: Tensor, seq_lens: Tensor, rotation: Tensor,
                       centroids: Tensor, scale: float) -> Tensor:
    return attention.tq_paged_attention(q, k_codes, k_scales, v_codes, v_scales, block_tables, query_start_loc,
                                        seq_lens, rotation, centroids, scale)


@tq_paged_attention.register_fake
def _(q, k_codes, k_scales, v_codes, v_scales, block_tables, query_start_loc, seq_lens, rotation, centroids, scale):
    return torch.empty_like(q)


@custom_op("qwen3_triton::moe_gemm", mutates_args=())
def moe_gemm(a: Tensor, w: Tensor, w_scale: Optional[Tensor], sorted_pairs: Tensor, block_expert: Tensor,
             num_padded: Tensor, pair_weights: Optional[Tensor], num_pairs: int, a_div: int, gated: bool,
             out_dtype: torch.dtype, w_zero: Optional[Tensor] = None, perm: Optional[Tensor] = None) -> Tensor:
    cfg = moe.moe_config(w.dtype == torch.int8, num_pairs, w.shape[0], gated, w.dtype == torch.uint8)
    return moe.moe_gemm(a, w, w_scale, sorted_pairs, block_expert, num_padded, pair_weights, num_pairs, a_div,
                        gated, out_dtype, cfg, w_zero, perm)


@moe_gemm.register_fake
def _(a, w, w_scale, sorted_pairs, block_expert, num_padded, pair_weights, num_pairs, a_div, gated, out_dtype,
      w_zero=None, perm=None):
    return a.new_empty((num_pairs, w.shape[1] // 2 if gated else w.shape[1]), dtype=out_dtype)


@custom_op("qwen3_triton::moe_combine", mutates_args=())
def moe_combine(contrib: Tensor, topk: int) -> Tensor:
    return moe.moe_combine(contrib, topk)


@moe_combine.register_fake
def _(contrib, topk):
    return contrib.new_empty((contrib.shape[0] // topk, contrib.shape[1]))
