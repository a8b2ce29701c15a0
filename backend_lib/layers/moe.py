"""Qwen3-MoE's sparse MLP: the router, the top-k routing, the experts through the kernel set's `moe` slot.

Routing as transformers' Qwen3MoeTopKRouter computes it: logits = x W_gate^T in the model dtype; softmax over
the experts in fp32; torch.topk (its tie-breaking); divided by their sum when norm_topk_prob; cast back to the
logits' dtype. Every step of it is row-wise, so routing is batch invariant like the kernels.
"""
from __future__ import annotations

import torch
from torch import nn

from ..checkpoint import CheckpointError, QuantScheme, WeightStore
from ..kernels import Kernels
from .linear import FLOAT_DTYPES, FloatLinear, int4a8_linear, load_int4a8, load_linear

# EngineConfig.moe_experts_quant: the experts as stored, or int4 codes on int8 activations (load_sparse_moe; the
# kernel sets of layers/linear.py INT4A8_KERNELS: the CPU set's native op, the reference's composed slot)
MOE_EXPERTS_QUANTS = ("checkpoint", "int4a8")


def route(logits: torch.Tensor, top_k: int, norm_topk_prob: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(expert ids int64 [T, k], weights [T, k] in logits.dtype) of router logits [T, E]."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return ids, weights.to(logits.dtype)


class ExpertPairs(list):
    """Per expert index its (gate_up, down) modules, or None (held by another expert-parallel rank): the `moe`
    slot's argument, with room for what a kernel set prepares once from it (`kernel_cache`)."""

    def __init__(self, pairs):
        super().__init__(pairs)
        self.kernel_cache: dict = {}


class Qwen3SparseMoe(nn.Module):
    def __init__(self, router: nn.Module, experts: list[tuple[nn.Module, nn.Module]], top_k: int,
                 norm_topk_prob: bool, kernels: Kernels):
        super().__init__()
        self.gate = router
        self.experts = nn.ModuleList(nn.ModuleList(pair or ()) for pair in experts)
        # the slot's argument: the pairs (ExpertPairs, with room for what a set prepares lazily), or the set's
        # packed form of them (its moe_weights, made once here)
        self.expert_pairs = ExpertPairs(None if pair is None else tuple(pair) for pair in experts)
        self.moe_weights = kernels.pack_experts(self.expert_pairs)
        self.top_k, self.norm_topk_prob, self.kernels = top_k, norm_topk_prob, kernels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ids, weights = (self.kernels.moe_route or route)(self.gate.forward(x), self.top_k, self.norm_topk_prob)
        return self.kernels.moe_experts(x, ids, weights, self.moe_weights)


def load_sparse_moe(store: WeightStore, prefix: str, hidden: int, moe, scheme: QuantScheme | None,
                    dtype: torch.dtype, device: torch.device, kernels: Kernels, owned=None,
                    experts_quant: str = "checkpoint") -> Qwen3SparseMoe:
    """The sparse MLP `prefix` (e.g. model.layers.3.mlp): router `prefix.gate`, experts either per expert as the
    published checkpoints store them (`prefix.experts.E.{gate,up,down}_proj`, in every format load_linear reads)
    or as the fused 3-D float tensors of transformers' in-memory layout (`prefix.experts.gate_up_proj`
    [E, 2I, H], `prefix.experts.down_proj` [E, H, I]). owned(e) False: expert e is not loaded (None in its place:
    another expert-parallel rank holds it). experts_quant (EngineConfig.moe_experts_quant): 'checkpoint' (the
    experts as stored) or 'int4a8' (int4 codes on int8 activations, layers/linear.py load_int4a8; the router
    stays as stored)."""
    if experts_quant not in MOE_EXPERTS_QUANTS:
        raise ValueError(f"moe_experts_quant: {experts_quant!r} is not one of {', '.join(MOE_EXPERTS_QUANTS)}")
    int4a8 = experts_quant == "int4a8"
    e_n, inter = moe.num_experts, moe.moe_intermediate_size
    gptq_like = scheme is not None and scheme.int4 is not None and scheme.int4.format in ("gptq", "awq")
    if gptq_like and store.has(f"{prefix}.gate.weight"):
        # GPTQ / AWQ configs list no ignored modules: their writers leave the routers in float, which the
        # tensor's presence says (a quantized router would store qweight instead)
        router = load_linear(store, [f"{prefix}.gate"], [e_n], hidden, None, dtype, device, kernels)
    else:
        router = load_linear(store, [f"{prefix}.gate"], [e_n], hidden, scheme, dtype, device, kernels)
    fused = next((n for n in (f"{prefix}.experts.gate_up_proj", f"{prefix}.experts.gate_up_proj.weight")
                  if store.has(n)), None)
    experts = []
    if fused is not None:
        down_name = fused.replace("gate_up_proj", "down_proj")
        gate_up = store.get(fused, (e_n, 2 * inter, hidden), FLOAT_DTYPES)
        down = store.get(down_name, (e_n, hidden, inter), FLOAT_DTYPES)
        for e in range(e_n):
            if owned is not None and not owned(e):
                experts.append(None)
                continue
            if int4a8:
                experts.append((int4a8_linear(gate_up[e], device, kernels), int4a8_linear(down[e], device, kernels)))
                continue
            experts.append((FloatLinear(gate_up[e].to(device=device, dtype=dtype).contiguous(), kernels),
                            FloatLinear(down[e].to(device=device, dtype=dtype).contiguous(), kernels)))
    else:
        if not store.has(f"{prefix}.experts.0.gate_proj.weight") and not any(
                n.startswith(f"{prefix}.experts.0.gate_proj.") for n in store.names()):
            raise CheckpointError(f"checkpoint is missing tensor '{prefix}.experts.0.gate_proj.weight' (nor does it "
                                  f"hold the fused '{prefix}.experts.gate_up_proj')")
        for e in range(e_n):
            if owned is not None and not owned(e):
                experts.append(None)
                continue
            p = f"{prefix}.experts.{e}"
            if int4a8:
                experts.append((load_int4a8(store, [f"{p}.gate_proj", f"{p}.up_proj"], [inter, inter], hidden, scheme,
                                            device, kernels),
                                load_int4a8(store, [f"{p}.down_proj"], [hidden], inter, scheme, device, kernels)))
                continue
            gate_up = load_linear(store, [f"{p}.gate_proj", f"{p}.up_proj"], [inter, inter], hidden, scheme, dtype,
                                  device, kernels)
            down = load_linear(store, [f"{p}.down_proj"], [hidden], inter, scheme, dtype, device, kernels)
            experts.append((gate_up, down))
    extra = sorted(n for n in store.names() if n.startswith(f"{prefix}.experts.") and
                   _expert_index(n, prefix) is not None and _expert_index(n, prefix) >= e_n)
    if extra:
        raise CheckpointError(f"tensor {extra[0]!r}: expert index beyond num_experts {e_n}")
    return Qwen3SparseMoe(router, experts, moe.num_experts_per_tok, moe.norm_topk_prob, kernels)


def _expert_index(name: str, prefix: str) -> int | None:
    head = name[len(prefix) + len(".experts."):].split(".", 1)[0]
    return int(head) if head.isdigit() else None
