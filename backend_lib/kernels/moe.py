"""The mixture-of-experts slot composed from a kernel set's own linear slots (the default of `Kernels.moe`).

The step's (token, expert) pairs are grouped per expert; each touched expert runs its two GEMMs once over its
rows (batch 1 reads only the routed experts' weights, a batch reads each touched expert's weights once per
step), and every pair's output, scaled by its router weight in the model dtype, is added into its token's row
in ascending expert index (the order transformers' Qwen3MoeExperts visits them), in the model dtype. Every
linear slot is batch invariant (a row's result depends on that row only, whatever else shares the call), and
the combine of a token reads that token's pairs only, in an order fixed by its own expert ids: a token gets
the same bits alone or in any batch.
"""
from __future__ import annotations

import torch


def group_by_expert(topk_ids: torch.Tensor, num_experts: int):
    """The pairs of the step grouped by expert: (order, counts, weights' permutation).

    Pair p = t * k + j is token t's j-th expert in ascending expert index; `order` lists the pairs expert by
    expert (tokens ascending within one, a stable sort), `counts[e]` how many pairs expert e has (host ints),
    `perm` [T, k] where each token's j-th pair sits in topk_ids (to reorder its weights)."""
    sorted_ids, perm = topk_ids.sort(dim=1, stable=True)
    flat = sorted_ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts).tolist()
    return order, counts, perm


def grouped_moe(kernels, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                experts) -> torch.Tensor:
    """x [T, H]; topk_ids int64 [T, k] (distinct per row); topk_weights [T, k] in x.dtype; experts: per expert
    index its (gate_up, down) linear modules of this kernel set. Returns [T, H] in x.dtype."""
    t, h = x.shape
    k = topk_ids.shape[1]
    order, counts, perm = group_by_expert(topk_ids, len(experts))
    weights = topk_weights.gather(1, perm).reshape(-1)
    contrib = x.new_empty((t * k, h))
    start = 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        pairs = order[start:start + n]
        start += n
        gate_up, down = experts[e]
        rows = x.index_select(0, torch.div(pairs, k, rounding_mode="floor"))
        y = down.forward(kernels.silu_mul(gate_up.forward(rows)))
        contrib.index_copy_(0, pairs, y * weights.index_select(0, pairs)[:, None])
    contrib = contrib.view(t, k, h)
    out = contrib[:, 0].clone()
    for j in range(1, k):
        out += contrib[:, j]
    return out
