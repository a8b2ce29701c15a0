"""The Triton set's MoE slot: each layer's experts stacked once at load (`moe_weights`), and the fused path over
them (moe.py's align, gate/up + SwiGLU, down + router weight, combine: four launches per MoE layer, no host
read). Experts the fused kernels do not take (int4 weight-only: no packed-int4 variant of moe_gemm yet; an
expert-parallel rank's partial set) keep the composed path (kernels/moe.py over this set's linear slots: W4A16
experts each through w4a16.py's packed GEMM, one launch per touched expert and projection)."""
from __future__ import annotations

import torch
from torch import nn

from . import moe, ops


class PackedExperts(nn.Module):
    """Every expert's weights stacked once: gate/up [E, 2I, H], down [E, H, I], int8 with fp32 per-channel scales
    [E, N] or float (scales None). Each expert's own linear module keeps a view of its slice, so nothing is held
    twice and the composed path still runs over `pairs`."""

    def __init__(self, pairs, w13, s13, w2, s2):
        super().__init__()
        self.pairs = pairs
        self.w13, self.s13, self.w2, self.s2 = w13, s13, w2, s2
        self.quant = w13.dtype == torch.int8


def _is_a8w8(prepared) -> bool:
    return isinstance(prepared, tuple) and len(prepared) == 2 and prepared[0].dtype == torch.int8


def moe_weights(pairs):
    """The slot's form of a layer's experts: PackedExperts when every expert is present and all are A8W8 or all
    float of one dtype and shape; otherwise the pairs themselves."""
    if not pairs or any(p is None for p in pairs):
        return pairs
    gu = [p[0].prepared for p in pairs]
    dn = [p[1].prepared for p in pairs]
    if all(_is_a8w8(a) and _is_a8w8(b) for a, b in zip(gu, dn)):
        w13, s13 = torch.stack([a[0] for a in gu]), torch.stack([a[1] for a in gu])
        w2, s2 = torch.stack([b[0] for b in dn]), torch.stack([b[1] for b in dn])
        same = all(a[0].shape == gu[0][0].shape for a in gu) and all(b[0].shape == dn[0][0].shape for b in dn)
    elif all(isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) for a, b in zip(gu, dn)):
        same = len({(a.shape, a.dtype) for a in gu}) == 1 and len({(b.shape, b.dtype) for b in dn}) == 1
        if not same:
            return pairs
        w13, s13, w2, s2 = torch.stack(gu), None, torch.stack(dn), None
    else:
        return pairs
    if not same or w13.shape[1] != 2 * w2.shape[2] or w13.shape[2] != w2.shape[1]:
        return pairs
    for e, (g, d) in enumerate(pairs):      # the per-expert modules now view the stacks: one copy of the weights
        g.prepared = (w13[e], s13[e]) if s13 is not None else w13[e]
        d.prepared = (w2[e], s2[e]) if s2 is not None else w2[e]
    return PackedExperts(pairs, w13, s13, w2, s2)


def fused_moe(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, packed: PackedExperts):
    t, _ = x.shape
    k = topk_ids.shape[1]
    e = packed.w13.shape[0]
    x = x if x.stride(-1) == 1 else x.contiguous()
    cfg = moe.moe_config(packed.quant, t * k, e)
    sorted_pairs, block_expert, num_padded, perm = moe.align(topk_ids, e, cfg["BLOCK_M"])
    weights = topk_weights.gather(1, perm).reshape(-1).to(x.dtype).contiguous()
    mid = ops.moe_gemm(x, packed.w13, packed.s13, sorted_pairs, block_expert, num_padded, None, t * k, k, True,
                       x.dtype)
    contrib = ops.moe_gemm(mid, packed.w2, packed.s2, sorted_pairs, block_expert, num_padded, weights, t * k, 1,
                           False, x.dtype)
    return ops.moe_combine(contrib, k)
