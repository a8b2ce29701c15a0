"""The parallel linear layers of a sharded model. Column-parallel layers are the ordinary ones (layers/linear.py)
built from the rank's output rows: every output element is computed whole on one rank, in TP = 1's order.
Row-parallel layers hold the rank's input columns and reduce across the group:

- A8W8: the per-token scale s = max|x| / 127 needs the whole row's maximum: each rank's partial maximum is
  all-reduced with MAX (exact), each rank quantizes its columns with that s (the same integers TP = 1 gets for
  them), multiplies them exactly into int32, and the int32 partial sums are all-reduced with SUM (exact and
  order-free), then y = acc * s * w_scale as the reference computes it: TP = N gives TP = 1's bits.
- float: the ranks' fp32 partial sums are gathered and added in rank order (TPGroup.sum_in_rank_order):
  deterministic and batch invariant, within fp32 rounding of TP = 1 (another summation order), not bit-equal.

The int8 products run through the reference's exact fp32-chunk matmul (kernels/reference/ops.py): correct on
every device; a kernel-set slot returning the int32 partial sums is the step that makes it fast.
"""
from __future__ import annotations

import torch
from torch import nn

from ..kernels.reference.ops import int8_matmul
from .group import TPGroup


class RowParallelA8W8(nn.Module):
    def __init__(self, w_q: torch.Tensor, w_scale: torch.Tensor, group: TPGroup):
        """w_q int8 [N, K / size]: this rank's input columns; w_scale fp32 [N]: the whole rows' scales."""
        super().__init__()
        self.w_q = w_q.contiguous()
        self.w_scale = w_scale.float().contiguous()
        self.group = group
        self.out_features = w_q.shape[0]

    def forward(self, x: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        shape = x.shape
        xf = x.reshape(-1, shape[-1]).float()
        amax = xf.abs().amax(dim=-1, keepdim=True)
        self.group.all_reduce_max_(amax)
        scale = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax))
        q = torch.clamp(torch.round(xf / scale), -128, 127).to(torch.int8)
        acc = self.group.all_reduce_sum_(int8_matmul(q, self.w_q))
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
