"""The Triton set's MoE slot: each layer's experts stacked once at load (`moe_weights`), and the fused path over
them (moe.py's align, gate/up + SwiGLU, down + router weight, combine: four launches per MoE layer, no host
read). A8W8, float and W4A16 experts (packed int4, w4a16.py's form) are fused. Experts the fused kernels do not
take (W4A16 with an act-order perm; an expert-parallel rank's partial set; mixed forms or shapes) keep the
composed path (kernels/moe.py over this set's linear slots: W4A16 experts each through w4a16.py's GEMM)."""
from __future__ import annotations

import torch
from torch import nn

from . import moe, ops


class PackedExperts(nn.Module):
    """Every expert's weights stacked once: gate/up [E, 2I, H], down [E, H, I], int8 with fp32 per-channel scales
    [E, N], float (scales None), or packed int4 (uint8 [E, N, ceil(K / 2)], fp32 scales and zeros z13 / z2
    [E, N, G]). Each expert's own linear module keeps a view of its slice, so nothing is held twice and the
    composed path still runs over `pairs`."""

    def __init__(self, pairs, w13, s13, w2, s2, z13=None, z2=None):
        super().__init__()
        self.pairs = pairs
        self.w13, self.s13, self.w2, self.s2, self.z13, self.z2 = w13, s13, w2, s2, z13, z2
        self.quant = w13.dtype == torch.int8


def _is_a8w8(prepared) -> bool:
    return isinstance(prepared, tuple) and len(prepared) == 2 and prepared[0].dtype == torch.int8


def _is_w4a16(prepared) -> bool:
    """w4a16.py's prepared form without an act-order perm (the fused kernel gathers no columns)."""
    return isinstance(prepared, tuple) and len(prepared) == 4 and prepared[0].dtype == torch.uint8 and \
        prepared[3] is None


def _w4a16_weights(pairs, gu, dn):
    same = len({(a[0].shape, a[1].shape) for a in gu}) == 1 and len({(b[0].shape, b[1].shape) for b in dn}) == 1
    if not same:
        return pairs
    w13, s13, z13 = (torch.stack([a[i] for a in gu]) for i in range(3))
    w2, s2, z2 = (torch.stack([b[i] for b in dn]) for i in range(3))
    inter, hidden = w13.shape[1] // 2, w2.shape[1]      # packed widths: ceil(K / 2), groups dividing K
    if w13.shape[1] % 2 or w13.shape[2] != (hidden + 1) // 2 or hidden % s13.shape[2] or \
            w2.shape[2] != (inter + 1) // 2 or inter % s2.shape[2]:
        return pairs
    for e, (g, d) in enumerate(pairs):      # the per-expert modules now view the stacks: one copy of the weights
        g.prepared = (w13[e], s13[e], z13[e], None)
        d.prepared = (w2[e], s2[e], z2[e], None)
    return PackedExperts(pairs, w13, s13, w2, s2, z13, z2)


def moe_weights(pairs):
    """The slot's form of a layer's experts: PackedExperts when every expert is present and all are A8W8, all
    float of one dtype and shape, or all W4A16 without a perm of one shape; otherwise the pairs themselves."""
    if not pairs or any(p is None for p in pairs):
        return pairs
    gu = [p[0].prepared for p in pairs]
    dn = [p[1].prepared for p in pairs]
    if all(_is_w4a16(a) and _is_w4a16(b) for a, b in zip(gu, dn)):
        return _w4a16_weights(pairs, gu, dn)
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
    cfg = moe.moe_config(packed.quant, t * k, e, w4=packed.w13.dtype == torch.uint8)    # BLOCK_M for align
    sorted_pairs, block_expert, num_padded, perm = moe.align(topk_ids, e, cfg["BLOCK_M"])
    weights = topk_weights.gather(1, perm).reshape(-1).to(x.dtype).contiguous()
    mid = ops.moe_gemm(x, packed.w13, packed.s13, sorted_pairs, block_expert, num_padded, None, t * k, k, True,
                       x.dtype, packed.z13)
    contrib = ops.moe_gemm(mid, packed.w2, packed.s2, sorted_pairs, block_expert, num_padded, weights, t * k, 1,
                           False, x.dtype, packed.z2)
    return ops.moe_combine(contrib, k)
