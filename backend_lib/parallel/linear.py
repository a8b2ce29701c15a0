"""The parallel linear layers of a sharded model. Column-parallel layers are the ordinary ones (layers/linear.py)
built from the rank's output rows: every output element is computed whole on one rank, in TP = 1's order.
Row-parallel layers hold the rank's input columns and reduce across the group:

- A8W8: the per-token scale s = max|x| / 127 needs the whole row's maximum: each rank's partial maximum is
  all-reduced with MAX (exact), each rank quantizes its columns with that s (the same integers TP = 1 gets for
  them), multiplies them exactly into int32, and the int32 partial sums are all-reduced with SUM (exact and
  order-free), then y = acc * s * w_scale as the reference computes it: TP = N gives TP = 1's bits.
- float: the ranks' fp32 partial sums are gathered and added in rank order (TPGroup.sum_in_rank_order):
  deterministic and batch invariant, within fp32 rounding of TP = 1 (another summation order), not bit-equal.

The int8 products run through the kernel set's own A8W8 GEMM, read once per step (RowParallelA8W8).
"""
from __future__ import annotations

import torch
from torch import nn

from .group import TPGroup


# int8 products over at most SLAB columns sum to less than 2**24 in magnitude (|q| <= 127 on both sides, one
# column of each slab is the marker below), where fp32 holds every integer: a kernel set's A8W8 output over such a
# slab, with activation scale 1 and weight scale 1, is its int32 sum exactly.
SLAB = 1024


class RowParallelA8W8(nn.Module):
    def __init__(self, w_q: torch.Tensor, w_scale: torch.Tensor, group: TPGroup, kernels):
        """w_q int8 [N, K / size]: this rank's input columns; w_scale fp32 [N]: the whole rows' scales.

        The int32 partial sums come from the kernel set's own A8W8 GEMM (no slot of its own needed): the
        quantized activations q (integers in [-127, 127]) are given as floats with one marker column of 127
        meeting a zero weight, so the kernel's per-token scale is 127 / 127 = 1 and it quantizes q to itself;
        with unit weight scales its output is the integer sum, exact in fp32 over a slab of SLAB columns."""
        super().__init__()
        self.group, self.kernels = group, kernels
        self.out_features, k = w_q.shape
        self.w_scale = w_scale.float().contiguous()
        ones = torch.ones(self.out_features, dtype=torch.float32, device=w_q.device)
        self.slabs = []
        for k0 in range(0, k, SLAB - 1):
            part = w_q[:, k0:k0 + SLAB - 1]
            marked = torch.cat([part, torch.zeros((self.out_features, 1), dtype=torch.int8, device=w_q.device)], 1)
            self.slabs.append((k0, part.shape[1], kernels.a8w8_prepare(marked.contiguous(), ones)))

    def forward(self, x: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        shape = x.shape
        xf = x.reshape(-1, shape[-1]).float()
        amax = xf.abs().amax(dim=-1, keepdim=True)
        self.group.all_reduce_max_(amax)
        scale = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax))
        q = torch.clamp(torch.round(xf / scale), -128, 127)
        marker = torch.full((q.shape[0], 1), 127.0, device=q.device)
        acc = None
        for k0, n, prepared in self.slabs:
            part = self.kernels.a8w8_linear(torch.cat([q[:, k0:k0 + n], marker], 1), prepared).to(torch.int32)
            acc = part if acc is None else acc + part
        self.group.all_reduce_sum_(acc)
        y = acc.float() * scale * self.w_scale[None, :]
        return y.to(out_dtype or x.dtype).reshape(*shape[:-1], self.out_features)


class RowParallelFloat(nn.Module):
    def __init__(self, w: torch.Tensor, group: TPGroup, kernels):
        """w [N, K / size]: this rank's input columns in the model dtype."""
        super().__init__()
        self.kernels, self.group = kernels, group
        self.out_features = w.shape[0]
        prepared = kernels.float_prepare(w.contiguous())
        self.prepared = prepared.clone() if prepared is w else prepared

    def forward(self, x: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        partial = self.kernels.float_linear(x, self.prepared, torch.float32)
        return self.group.sum_in_rank_order(partial).to(out_dtype or x.dtype)
