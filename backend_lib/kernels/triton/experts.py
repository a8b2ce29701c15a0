"""The Triton set's MoE slot: each layer's experts stacked once at load (`moe_weights`), and the fused path over
them (moe.py's align, gate/up + SwiGLU, down + router weight, combine: four launches per MoE layer, no host
read). A8W8, float and W4A16 experts (packed int4, w4a16.py's form) are fused, W4A16 with GPTQ act order too:
each expert's gate_up and down perms stacked ([E, H] when gate and up share theirs, as GPTQ writes them, and as
the loader fuses them into one linear; [E, 2, H] when each has its own, the loader's ConcatLinear of the two), an
expert without a perm among experts with one given the identity (the same bits: the gather reads the same
columns). Experts the fused kernels do not take (an expert-parallel rank's partial set; mixed forms or shapes)
keep the composed path (kernels/moe.py over this set's linear slots: W4A16 experts each through w4a16.py's
GEMM)."""
from __future__ import annotations

import torch
from torch import nn

from . import moe, ops


class PackedExperts(nn.Module):
    """Every expert's weights stacked once: gate/up [E, 2I, H], down [E, H, I], int8 with fp32 per-channel scales
    [E, N], float (scales None), or packed int4 (uint8 [E, N, ceil(K / 2)], fp32 scales and zeros z13 / z2
    [E, N, G]; act order: int32 perms p13 [E, H] or [E, 2, H] (gate's, up's), p2 [E, I], or None). Each expert's own
    linear module keeps a view of its slice, so nothing is held twice and the composed path still runs over
    `pairs`."""

    def __init__(self, pairs, w13, s13, w2, s2, z13=None, z2=None, p13=None, p2=None):
        super().__init__()
        self.pairs = pairs
        self.w13, self.s13, self.w2, self.s2, self.z13, self.z2 = w13, s13, w2, s2, z13, z2
        self.p13, self.p2 = p13, p2
        self.quant = w13.dtype == torch.int8


def _is_a8w8(prepared) -> bool:
    return isinstance(prepared, tuple) and len(prepared) == 2 and prepared[0].dtype == torch.int8


def _is_w4a16(prepared) -> bool:
    """w4a16.py's prepared form (packed, scales, zeros, perm or None)."""
    return isinstance(prepared, tuple) and len(prepared) == 4 and prepared[0].dtype == torch.uint8


def _w4a16_parts(module):
    """The W4A16 linears of a projection: [module] for one, its parts for a ConcatLinear of them (gate and up with
    different act orders: layers/linear.py keeps those apart); None for anything else."""
    if _is_w4a16(getattr(module, "prepared", None)):
        return [module]
    parts = list(getattr(module, "parts", None) or ())
    return parts if parts and all(_is_w4a16(getattr(p, "prepared", None)) for p in parts) else None


def _perms(experts, k: int):
    """[E, parts, K] int32 act orders of the experts' projections (identity where a part has none), or None when
    no part has one (the kernel gathers no columns)."""
    if all(m.prepared[3] is None for parts in experts for m in parts):
        return None
    ident = torch.arange(k, dtype=torch.int32, device=experts[0][0].prepared[0].device)
    return torch.stack([torch.stack([ident if m.prepared[3] is None else m.prepared[3] for m in parts])
                        for parts in experts])


def _w4a16_weights(pairs, gu, dn):
    """gu / dn: per expert its gate_up's W4A16 linears (one of 2I rows, or gate and up of I rows each) and its
    down's (one)."""
    forms = {tuple((m.prepared[0].shape, m.prepared[1].shape) for m in parts) for parts in gu}
    if len(forms) != 1 or len(next(iter(forms))) not in (1, 2) or len(set(next(iter(forms)))) != 1 or \
            any(len(d) != 1 for d in dn) or len({(d[0].prepared[0].shape, d[0].prepared[1].shape) for d in dn}) != 1:
        return pairs
    w13, s13, z13 = (torch.stack([torch.cat([m.prepared[i] for m in parts]) for parts in gu]) for i in range(3))
    w2, s2, z2 = (torch.stack([d[0].prepared[i] for d in dn]) for i in range(3))
    inter, hidden = w13.shape[1] // 2, w2.shape[1]      # packed widths: ceil(K / 2), groups dividing K
    if w13.shape[1] % 2 or w13.shape[2] != (hidden + 1) // 2 or hidden % s13.shape[2] or \
            w2.shape[2] != (inter + 1) // 2 or inter % s2.shape[2]:
        return pairs
    p13, p2 = _perms(gu, hidden), _perms(dn, inter)
    p2 = None if p2 is None else p2[:, 0]
    if p13 is not None and p13.shape[1] == 1:
        p13 = p13[:, 0]                                 # gate and up share each expert's perm: [E, H]
    split = len(gu[0]) == 2                             # gate and up each their own linear (of I rows)
    for e, (parts, d) in enumerate(zip(gu, dn)):        # the modules now view the stacks: one copy of the weights
        for j, m in enumerate(parts):
            rows = slice(j * inter, (j + 1) * inter) if split else slice(None)
            perm = None if m.prepared[3] is None else (p13[e, j] if p13.dim() == 3 else p13[e])
            m.prepared = (w13[e, rows], s13[e, rows], z13[e, rows], perm)
        d[0].prepared = (w2[e], s2[e], z2[e], None if d[0].prepared[3] is None else p2[e])
    return PackedExperts(pairs, w13, s13, w2, s2, z13, z2, p13, p2)


def moe_weights(pairs):
    """The slot's form of a layer's experts: PackedExperts when every expert is present and all are A8W8, all
    float of one dtype and shape, or all W4A16 of one shape (with or without act-order perms); otherwise the
    pairs themselves."""
    if not pairs or any(p is None for p in pairs):
        return pairs
    gu4 = [_w4a16_parts(p[0]) for p in pairs]
    dn4 = [_w4a16_parts(p[1]) for p in pairs]
    if all(a is not None and b is not None for a, b in zip(gu4, dn4)):
        return _w4a16_weights(pairs, gu4, dn4)
    gu = [getattr(p[0], "prepared", None) for p in pairs]     # a ConcatLinear of other parts: none (composed)
    dn = [getattr(p[1], "prepared", None) for p in pairs]
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
                       x.dtype, packed.z13, packed.p13)
    contrib = ops.moe_gemm(mid, packed.w2, packed.s2, sorted_pairs, block_expert, num_padded, weights, t * k, 1,
                           False, x.dtype, packed.z2, packed.p2)
    return ops.moe_combine(contrib, k)
