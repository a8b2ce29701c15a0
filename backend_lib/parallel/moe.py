"""Expert parallel: a Qwen3-MoE sparse layer whose experts are split whole across the tensor-parallel ranks (expert
e on rank e % size, as vLLM's enable_expert_parallel splits them over the TP ranks). The router is replicated and
its input is (every layer's hidden state is whole on every rank), so every rank routes the same pairs; each rank
computes the pairs of its experts with kernels/moe.py's grouping; the pairs' outputs are all-gathered and each
taken from the rank that owns its expert, then combined in ascending expert index exactly as TP = 1 combines
them. Every pair's output is computed whole, by the same kernels, on one rank: the layer gives TP = 1's bits,
for float and quantized experts alike."""
from __future__ import annotations

import torch

from ..kernels.moe import group_by_expert
from ..layers.moe import Qwen3SparseMoe, route
from .group import TPGroup


class ExpertParallelMoe(Qwen3SparseMoe):
    def __init__(self, inner: Qwen3SparseMoe, group: TPGroup):
        super().__init__(inner.gate, list(inner.expert_pairs), inner.top_k, inner.norm_topk_prob, inner.kernels)
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ids, weights = (self.kernels.moe_route or route)(self.gate.forward(x), self.top_k, self.norm_topk_prob)
        t, h = x.shape
        k = ids.shape[1]
        order, counts, perm = group_by_expert(ids, len(self.expert_pairs))
        w = weights.gather(1, perm).reshape(-1)
        contrib = x.new_zeros((t * k, h))
        start = 0
        for e, n in enumerate(counts):
            pairs = order[start:start + n]
            start += n
            if n == 0 or self.expert_pairs[e] is None:
                continue
            gate_up, down = self.expert_pairs[e]
            rows = x.index_select(0, torch.div(pairs, k, rounding_mode="floor"))
            y = down.forward(self.kernels.silu_mul(gate_up.forward(rows)))
            contrib.index_copy_(0, pairs, y * w.index_select(0, pairs)[:, None])
        owner = ids.gather(1, perm).reshape(-1) % self.group.size      # pair p's expert's rank
        parts = torch.stack(self.group.all_gather(contrib))            # [size, T * k, H]
        contrib = parts[owner, torch.arange(t * k, device=x.device)].view(t, k, h)
        out = contrib[:, 0].clone()
        for j in range(1, k):
            out += contrib[:, j]
        return out
