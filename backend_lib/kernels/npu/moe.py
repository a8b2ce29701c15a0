"""The npu set's MoE slot over torch_npu's MoE ops (the sequence vllm-ascend's dropless all-gather path runs):

  routing   npu_moe_gating_top_k_softmax on the fp32 router logits (softmax, top-k), renormalized here in fp32
            when norm_topk_prob and cast to the model dtype, as transformers' router
  dispatch  npu_moe_init_routing_v2: the (token, expert) pairs sorted by expert (each token's experts first put
            in ascending order, the combine's order), the rows gathered (and, A8W8, quantized per token:
            quant_mode 1, the reference's rule), the pairs per expert (count mode), the gather index back
  experts   npu_grouped_matmul over one stacked weight [E, K, N] split along M by those counts: A8W8 to int32
            (exact), dequantized here as the reference does ((acc * s) * w_s, fp32, one rounding); SwiGLU by the
            set's silu_mul (npu_swiglu); the down projection's rows re-quantized by npu_dynamic_quant; float
            experts in their dtype
  combine   npu_moe_finalize_routing (dropless, row-ordered index: drop_pad_mode 2): each token's k rows times
            its router weights, summed in the token's ascending expert order

Exactness, as far as the documented semantics go (tests/test_moe_npu.py over tests/npu_emulation.py): the
routing ids, the int8 rows, the int32 GEMMs and their dequantization are the reference's bits; SwiGLU is
npu_swiglu (one rounding of fp32 math, the reference rounds silu first: the dense set's difference too), and
finalize_routing documents a sum of the k products without intermediate roundings (the reference rounds each
product and each add to the model dtype): so the bf16 output is within a rounding of the reference, not its bits.
Every op is row-wise, so a token's output does not depend on its batch (on an NPU: if its kernels are).
"""
from __future__ import annotations

import torch
from torch import nn


class NpuExperts(nn.Module):
    """A layer's experts stacked once in npu_grouped_matmul's weight layout [E, K, N]: gate/up [E, H, 2I], down
    [E, I, H] (int8 with fp32 per-channel scales [E, N], or float with scales None). The per-expert modules keep
    views of the stacks, so nothing is held twice."""

    def __init__(self, pairs, w13, s13, w2, s2):
        super().__init__()
        self.pairs = pairs
        self.w13, self.s13, self.w2, self.s2 = w13, s13, w2, s2
        self.quant = w13.dtype == torch.int8


def moe_weights(pairs):
    if not pairs or any(p is None for p in pairs):
        return pairs
    gu = [p[0].prepared for p in pairs]
    dn = [p[1].prepared for p in pairs]

    def a8w8(prep):       # the set's a8w8_prepare: (w^T int8 [K, N], w_scale fp32 [N])
        return isinstance(prep, tuple) and len(prep) == 2 and prep[0].dtype == torch.int8

    if all(a8w8(a) and a8w8(b) for a, b in zip(gu, dn)):
        if len({a[0].shape for a in gu}) != 1 or len({b[0].shape for b in dn}) != 1:
            return pairs
        w13, s13 = torch.stack([a[0] for a in gu]), torch.stack([a[1] for a in gu])
        w2, s2 = torch.stack([b[0] for b in dn]), torch.stack([b[1] for b in dn])
        views = lambda w, s, e: (w[e], s[e])                                   # noqa: E731
    elif all(isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) for a, b in zip(gu, dn)):
        if len({(a.shape, a.dtype) for a in gu}) != 1 or len({(b.shape, b.dtype) for b in dn}) != 1:
            return pairs
        w13, s13 = torch.stack([a.t() for a in gu]), None                     # float [N, K] -> [E, K, N]
        w2, s2 = torch.stack([b.t() for b in dn]), None
        views = lambda w, s, e: w[e].t()                                       # noqa: E731
    else:
        return pairs
    if w13.shape[2] != 2 * w2.shape[1] or w13.shape[1] != w2.shape[2]:
        return pairs
    for e, (g, d) in enumerate(pairs):
        g.prepared, d.prepared = views(w13, s13, e), views(w2, s2, e)
    return NpuExperts(pairs, w13, s13, w2, s2)


def route(tnpu, logits: torch.Tensor, top_k: int, norm_topk_prob: bool):
    """transformers' router over npu_moe_gating_top_k_softmax (fp32 logits: the softmax in fp32)."""
    weights, ids, _ = tnpu.npu_moe_gating_top_k_softmax(logits.float(), None, k=top_k)
    if norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return ids.long(), weights.to(logits.dtype)


def fused_moe(tnpu, silu_mul, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
              packed: NpuExperts) -> torch.Tensor:
    t, _ = x.shape
    k = topk_ids.shape[1]
    e = packed.w13.shape[0]
    ids, perm = topk_ids.sort(dim=1, stable=True)         # each token's experts ascending: the combine's order
    weights = topk_weights.gather(1, perm).to(x.dtype)
    ids32 = ids.to(torch.int32)
    expanded, src_to_dst, counts, row_scale = tnpu.npu_moe_init_routing_v2(
        x, ids32, active_num=t * k, expert_num=e, expert_tokens_num_type=1, expert_tokens_num_flag=True,
        quant_mode=1 if packed.quant else -1, active_expert_range=[0, e], row_idx_type=0)
    gmm = dict(group_list=counts, group_list_type=1, group_type=0, split_item=3)
    if packed.quant:
        expert_of = ids32.reshape(-1).sort(stable=True).values.long()     # each expanded row's expert
        acc = tnpu.npu_grouped_matmul([expanded], [packed.w13], output_dtype=torch.int32, **gmm)[0]
        gate_up = ((acc.float() * row_scale[:, None]) * packed.s13.index_select(0, expert_of)).to(x.dtype)
        q, s = tnpu.npu_dynamic_quant(silu_mul(gate_up))
        acc = tnpu.npu_grouped_matmul([q], [packed.w2], output_dtype=torch.int32, **gmm)[0]
        y = ((acc.float() * s[:, None]) * packed.s2.index_select(0, expert_of)).to(x.dtype)
    else:
        gate_up = tnpu.npu_grouped_matmul([expanded], [packed.w13], **gmm)[0]
        y = tnpu.npu_grouped_matmul([silu_mul(gate_up)], [packed.w2], **gmm)[0]
    return tnpu.npu_moe_finalize_routing(y, None, None, None, weights, src_to_dst, ids32, drop_pad_mode=2)
