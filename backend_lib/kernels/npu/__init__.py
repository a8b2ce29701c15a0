"""The Ascend NPU kernel set: torch_npu's fused ops where one covers a slot, the reference elsewhere.

  W4A16           npu_convert_weight_to_int4pack (codes - 8 as int4 [-8, 7], [K, N] -> int32 [K, N / 8]) +
                  npu_weight_quant_batchmatmul (W = (q + antiquant_offset) * antiquant_scale, offset = 8 - zero,
                  per group of antiquant_group_size = K / G columns, per channel when G = 1); GPTQ act-order:
                  x gathered by perm before the op (the op has no activation permutation argument)
  A8W8            npu_dynamic_quant (per-token int8 + fp32 scale) + npu_quant_matmul (int8 x int8 [K, N],
                  per-channel scale, pertoken_scale), the pair vllm-ascend's W8A8 dynamic scheme uses
  RMSNorm         npu_rms_norm / npu_add_rms_norm
  SiLU-mul        npu_swiglu
  KV write        _npu_reshape_and_cache, into this set's own layout: K and V [pages, page_size, KVH, D]
  attention       npu_fused_infer_attention_score over the block table (TND queries, paged BSH keys and
                  values, sparse_mode 3: causal aligned to the end of each sequence's context)
  MoE             npu_moe_gating_top_k_softmax, npu_moe_init_routing_v2, npu_grouped_matmul,
                  npu_moe_finalize_routing over each layer's experts stacked once (moe.py): A8W8, float and
                  W4A16 (npu_grouped_matmul's antiquant form over the int4pack words); act-order W4A16 experts:
                  the grouped default (kernels/moe.py) over this set's W4A16 linear (the op permutes no x)
  q/k-norm + RoPE, float linear, TurboQuant: the reference set (pure PyTorch, runs on an NPU)

It has NOT run on an NPU. tests/test_kernels_npu.py runs it against emulations of each op written from
torch_npu's documented semantics (tests/npu_emulation.py), so on an NPU only the numerics remain to check
(the rounding of npu_dynamic_quant, the order of the two scale products: A8W8 is then within one rounding of
the reference, not bit-exact as on the CPU and CUDA sets). Its attention takes host lists of lengths (the
op's signature), so an NPU decode step syncs once per layer.
"""
from __future__ import annotations

import torch

from ..contract import Kernels
from ..moe import grouped_moe
from ..reference import KERNELS as REFERENCE
from . import moe

__all__ = ["kernel_set", "load"]

# npu_fused_infer_attention_score with sparse_mode 3 takes this fixed upper-triangular mask (vllm-ascend's)
MASK_SIZE = 2048


def kv_shapes(num_pages: int, page_size: int, num_kv_heads: int, head_dim: int):
    if page_size % 16:
        raise ValueError(f"kernels npu: page_size must be a multiple of 16 (paged attention), got {page_size}")
    shape = (num_pages, page_size, num_kv_heads, head_dim)
    return shape, shape


def kernel_set(tnpu) -> Kernels:
    """The set over a torch_npu-like module `tnpu` (torch_npu itself, or the tests' emulation)."""
    masks: dict = {}

    def a8w8_prepare(w_q, w_scale):
        # x2 of npu_quant_matmul is [K, N]; on an NPU torch_npu.npu_format_cast(w, 29) (FRACTAL_NZ) is the
        # faster form vllm-ascend uses, a layout change only
        return w_q.t().contiguous(), w_scale.float().contiguous()

    def a8w8_linear(x, prepared):
        w_t, w_scale = prepared
        shape = x.shape
        q, s = tnpu.npu_dynamic_quant(x.reshape(-1, shape[-1]))
        out_dtype = x.dtype if x.dtype in (torch.bfloat16, torch.float16) else torch.bfloat16
        y = tnpu.npu_quant_matmul(q, w_t, w_scale, pertoken_scale=s, output_dtype=out_dtype)
        return y.to(x.dtype).reshape(*shape[:-1], w_t.shape[1])

    def w4a16_prepare(codes, scales, zeros, perm=None):
        # npu_weight_quant_batchmatmul's weight is signed int4 [K, N] packed 8 per int32 along N (N % 8 == 0,
        # npu_convert_weight_to_int4pack's constraint); the contract's codes are 0..15 with zeros, so q = code - 8
        # and the documented antiquant W = (q + offset) * scale gives (code - zero) * scale with offset = 8 - zero
        n, k = codes.shape
        g = scales.shape[1]
        if n % 8:
            raise ValueError(f"kernels npu: w4a16 needs output features N % 8 == 0 (int4pack), got N={n}")
        if k % g:
            raise ValueError(f"kernels npu: w4a16 groups must split K={k} evenly, got {g} groups")
        q = (codes.to(torch.int32) - 8).t().contiguous()                     # [K, N] in [-8, 7]
        packed = tnpu.npu_convert_weight_to_int4pack(q)
        scale = scales.float().t().contiguous()                              # [G, N]
        offset = (8.0 - zeros.float()).t().contiguous()
        if g == 1:
            scale, offset = scale[0], offset[0]                              # per channel: (N,)
        return packed, scale, offset, (k // g if g > 1 else 0), perm

    def w4a16_linear(x, prepared):
        packed, scale, offset, group, perm = prepared
        if x.dtype not in (torch.bfloat16, torch.float16):     # the op's documented x dtypes
            raise ValueError(f"kernels npu: w4a16 runs in bfloat16 or float16 (npu_weight_quant_batchmatmul), "
                             f"not {x.dtype}: set dtype")
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        if perm is not None:
            x2 = x2.index_select(1, perm)            # GPTQ act-order: the op takes no permutation of x
        # antiquant_scale / offset must be in x's dtype (the docs): exact when the checkpoint's scales are
        # representable in it (fp16 scales of an fp16 model), otherwise rounded once to it
        y = tnpu.npu_weight_quant_batchmatmul(x2, packed, scale.to(x.dtype), antiquant_offset=offset.to(x.dtype),
                                              antiquant_group_size=group)
        return y.reshape(*shape[:-1], y.shape[-1])

    def rms_norm(x, weight, eps):
        return tnpu.npu_rms_norm(x, weight, epsilon=eps)[0]

    def add_rms_norm(x, residual, weight, eps):
        y, _, h = tnpu.npu_add_rms_norm(x, residual, weight, epsilon=eps)
        return y, h

    def silu_mul(x):
        return tnpu.npu_swiglu(x, dim=-1)

    def write_kv(k, v, k_cache, v_cache, slot_mapping):
        tnpu._npu_reshape_and_cache(key=k.to(k_cache.dtype), value=v.to(v_cache.dtype), key_cache=k_cache,
                                    value_cache=v_cache, slot_indices=slot_mapping.to(torch.int32))

    def paged_attention(q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, scale):
        t, h, d = q.shape
        pages, page_size, kvh, _ = k_cache.shape
        if q.device not in masks:
            masks[q.device] = torch.triu(torch.ones(MASK_SIZE, MASK_SIZE, dtype=torch.int8, device=q.device),
                                         diagonal=1).bool()
        out, _ = tnpu.npu_fused_infer_attention_score(
            q, k_cache.view(pages, page_size, kvh * d), v_cache.view(pages, page_size, kvh * d),
            atten_mask=masks[q.device], block_table=block_tables, input_layout="TND", block_size=page_size,
            actual_seq_lengths=query_start_loc[1:].tolist(), actual_seq_lengths_kv=seq_lens.tolist(),
            num_heads=h, num_key_value_heads=kvh, scale=float(scale), sparse_mode=3)
        return out

    def moe_experts(x, topk_ids, topk_weights, experts):
        if isinstance(experts, moe.NpuExperts):
            return moe.fused_moe(tnpu, silu_mul, x, topk_ids, topk_weights, experts)
        return grouped_moe(kernels, x, topk_ids, topk_weights, experts)

    kernels = Kernels(
        name="npu",
        rms_norm=rms_norm,
        add_rms_norm=add_rms_norm,
        qk_norm_rope=REFERENCE.qk_norm_rope,
        silu_mul=silu_mul,
        a8w8_prepare=a8w8_prepare,
        a8w8_linear=a8w8_linear,
        w4a16_prepare=w4a16_prepare,
        w4a16_linear=w4a16_linear,
        float_prepare=REFERENCE.float_prepare,
        float_linear=REFERENCE.float_linear,
        float_rows=REFERENCE.float_rows,
        write_kv=write_kv,
        paged_attention=paged_attention,
        tq_write=REFERENCE.tq_write,
        tq_paged_attention=REFERENCE.tq_paged_attention,
        kv_shapes=kv_shapes,
        moe=moe_experts,
        moe_weights=moe.moe_weights,
        moe_route=lambda logits, top_k, norm: moe.route(tnpu, logits, top_k, norm),
    )
    return kernels


def load(device: torch.device) -> Kernels:
    if device.type != "npu":
        raise RuntimeError(f"kernels: 'npu' runs on Ascend NPUs, not on {device.type}")
    import torch_npu

    return kernel_set(torch_npu)
