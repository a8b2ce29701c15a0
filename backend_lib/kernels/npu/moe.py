"""The npu set's MoE slot over torch_npu's MoE ops (the sequence vllm-ascend's dropless all-gather path runs):

  routing   npu_moe_gating_top_k_softmax on the fp32 router logits (softmax, top-k), renormalized here in fp32
            when norm_topk_prob and cast to the model dtype, as transformers' router
  dispatch  npu_moe_init_routing_v2: the (token, expert) pairs sorted by expert (each token's experts first put
            in ascending order, the combine's order), the rows gathered (and, A8W8, quantized per token:
            quant_mode 1, the reference's rule), the pairs per expert (count mode), the gather index back
  experts   npu_grouped_matmul over one stacked weight [E, K, N] split along M by those counts (group_list_type
            1): A8W8 to int32 (exact), dequantized here as the reference does ((acc * s) * w_s, fp32, one
            rounding); SwiGLU by the set's silu_mul (npu_swiglu); the down projection's rows re-quantized by
            npu_dynamic_quant; float experts in their dtype; W4A16 experts in the op's weight-only form (its
            formula 4, y = x @ ((w + antiquant_offset) * antiquant_scale)): w the codes - 8 as int4, each expert's
            [K, N] packed by npu_convert_weight_to_int4pack (int32 [E, K, N / 8], the dense W4A16 slot's words,
            stacked), offset = 8 - zero, both [E, G, N] per group ([E, N] per channel), cast to the model dtype
            as the op takes them. Act-order (GPTQ desc_act) W4A16 experts are not stacked: the op has no
            permutation of x (see _w4a16); they run the composed path, x gathered by each expert's perm
  combine   npu_moe_finalize_routing (dropless, row-ordered index: drop_pad_mode 2): each token's k rows times
            its router weights, summed in the token's ascending expert order

Exactness, as far as the documented semantics go (tests/test_moe_npu.py over tests/npu_emulation.py): the
routing ids, the int8 rows, the int32 GEMMs and their dequantization are the reference's bits; SwiGLU is
npu_swiglu (one rounding of fp32 math, the reference rounds silu first: the dense set's difference too), and
finalize_routing documents a sum of the k products without intermediate roundings (the reference rounds each
product and each add to the model dtype): so the bf16 output is within a rounding of the reference, not its bits.
W4A16: each expert's GEMM rows are the reference's W4A16 bits where the checkpoint's scales are representable in
the model dtype (bf16 scales in bf16, and in fp16 above its subnormals; GPTQ's fp16 scales in fp16; in bf16 they
are rounded once), and the output is then the documented composition of the reference GEMMs bit for bit.
Every op is row-wise, so a token's output does not depend on its batch (on an NPU: if its kernels are).
"""
from __future__ import annotations

import torch
from torch import nn


class NpuExperts(nn.Module):
    """A layer's experts stacked once in npu_grouped_matmul's weight layout [E, K, N]: gate/up [E, H, 2I], down
    [E, I, H]. kind "a8w8": int8 with fp32 per-channel scales [E, N]; "float": scales None; "w4a16": int4 as
    npu_convert_weight_to_int4pack packs each expert's [K, N] (int32 [E, K, N / 8]), antiquant scales and offsets
    (8 - zero) fp32 [E, G, N] per group, [E, N] per channel (G = 1). The per-expert modules keep views of the
    stacks, so nothing is held twice and the composed path still runs over `pairs`."""

    def __init__(self, pairs, kind, w13, s13, w2, s2, o13=None, o2=None):
        super().__init__()
        self.pairs, self.kind = pairs, kind
        self.w13, self.s13, self.w2, self.s2, self.o13, self.o2 = w13, s13, w2, s2, o13, o2
        self.quant = kind == "a8w8"


def _a8w8(prep) -> bool:       # the set's a8w8_prepare: (w^T int8 [K, N], w_scale fp32 [N])
    return isinstance(prep, tuple) and len(prep) == 2 and prep[0].dtype == torch.int8


def _w4a16(prep) -> bool:
    """The set's w4a16_prepare: (int4pack int32 [K, N / 8], scale fp32 [G, N] | [N], offset, group, perm), without
    an act-order perm: npu_grouped_matmul takes no permutation of x, and gathering each expanded row by its
    expert's perm before it would need an int64 index of the rows' shape (4x the bf16 activations), so
    act-order experts keep the composed path (the dense op per touched expert, x gathered by its perm)."""
    return isinstance(prep, tuple) and len(prep) == 5 and prep[0].dtype == torch.int32 and prep[4] is None


def _stack_w4a16(pairs, gu, dn):
    if len({(a[0].shape, a[1].shape, a[3]) for a in gu}) != 1 or len({(b[0].shape, b[1].shape, b[3]) for b in dn}) != 1:
        return pairs
    w13, s13, o13 = (torch.stack([a[i] for a in gu]) for i in range(3))
    w2, s2, o2 = (torch.stack([b[i] for b in dn]) for i in range(3))
    # [E, H, 2I / 8] and [E, I, H / 8]: the int4pack words hold 8 output features each
    if w13.shape[2] * 8 != 2 * w2.shape[1] or w13.shape[1] != w2.shape[2] * 8:
        return pairs
    g13, g2 = gu[0][3], dn[0][3]
    for e, (g, d) in enumerate(pairs):      # the per-expert modules now view the stacks: one copy of the weights
        g.prepared = (w13[e], s13[e], o13[e], g13, None)
        d.prepared = (w2[e], s2[e], o2[e], g2, None)
    return NpuExperts(pairs, "w4a16", w13, s13, w2, s2, o13, o2)


def moe_weights(pairs):
    """The slot's form of a layer's experts: NpuExperts when every expert is present and all are A8W8, all float
    of one dtype and shape, or all W4A16 without an act-order perm of one shape and group; otherwise the pairs
    (the composed path: kernels/moe.py over the set's linear slots)."""
    if not pairs or any(p is None for p in pairs):
        return pairs
    gu = [getattr(p[0], "prepared", None) for p in pairs]     # ConcatLinear (own perms per projection): none
    dn = [getattr(p[1], "prepared", None) for p in pairs]
    if all(_w4a16(a) and _w4a16(b) for a, b in zip(gu, dn)):
        return _stack_w4a16(pairs, gu, dn)
    if all(_a8w8(a) and _a8w8(b) for a, b in zip(gu, dn)):
        if len({a[0].shape for a in gu}) != 1 or len({b[0].shape for b in dn}) != 1:
            return pairs
        kind = "a8w8"
        w13, s13 = torch.stack([a[0] for a in gu]), torch.stack([a[1] for a in gu])
        w2, s2 = torch.stack([b[0] for b in dn]), torch.stack([b[1] for b in dn])
        views = lambda w, s, e: (w[e], s[e])                                   # noqa: E731
    elif all(isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) for a, b in zip(gu, dn)):
        if len({(a.shape, a.dtype) for a in gu}) != 1 or len({(b.shape, b.dtype) for b in dn}) != 1:
            return pairs
        kind = "float"
        w13, s13 = torch.stack([a.t() for a in gu]), None                     # float [N, K] -> [E, K, N]
        w2, s2 = torch.stack([b.t() for b in dn]), None
        views = lambda w, s, e: w[e].t()                                       # noqa: E731
    else:
        return pairs
    if w13.shape[2] != 2 * w2.shape[1] or w13.shape[1] != w2.shape[2]:
        return pairs
    for e, (g, d) in enumerate(pairs):
        g.prepared, d.prepared = views(w13, s13, e), views(w2, s2, e)
    return NpuExperts(pairs, kind, w13, s13, w2, s2)


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
    if packed.kind == "w4a16" and x.dtype not in (torch.bfloat16, torch.float16):    # the op's documented x dtypes
        raise ValueError(f"kernels npu: w4a16 experts run in bfloat16 or float16 (npu_grouped_matmul's antiquant "
                         f"form), not {x.dtype}: set dtype")
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
    elif packed.kind == "w4a16":
        # the op takes antiquant_scale / offset in x's dtype: exact when the checkpoint's scales are
        # representable in it, otherwise rounded once to it (the dense W4A16 slot's condition)
        dt = x.dtype
        gate_up = tnpu.npu_grouped_matmul([expanded], [packed.w13], antiquant_scale=[packed.s13.to(dt)],
                                          antiquant_offset=[packed.o13.to(dt)], output_dtype=dt, **gmm)[0]
        y = tnpu.npu_grouped_matmul([silu_mul(gate_up)], [packed.w2], antiquant_scale=[packed.s2.to(dt)],
                                    antiquant_offset=[packed.o2.to(dt)], output_dtype=dt, **gmm)[0]
    else:
        gate_up = tnpu.npu_grouped_matmul([expanded], [packed.w13], **gmm)[0]
        y = tnpu.npu_grouped_matmul([silu_mul(gate_up)], [packed.w2], **gmm)[0]
    return tnpu.npu_moe_finalize_routing(y, None, None, None, weights, src_to_dst, ids32, drop_pad_mode=2)
