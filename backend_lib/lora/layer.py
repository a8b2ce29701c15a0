"""The per-row LoRA update inside the forward: each fused linear of the base, wrapped, adds to the rows of
every adapter in the step delta = ((x A^T) B^T) * scaling, computed in fp32 and added to the base's output.

Rows are grouped by adapter; each group's two products go through the kernel set's float_linear, which is
batch invariant (a row's result depends on that row only, whatever M is and whichever rows share the call),
so a row gets the same bits alone, beside other adapters' rows, or beside base rows. Base rows are never
touched: their output is the base linear's, bit for bit. The A8W8 base works the same way: the adapter
stays float and reads the un-quantized input; its delta is added to the int8 linear's output.
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn

from .adapter import LoraAdapter


@dataclass(frozen=True)
class LoraBatch:
    """The step's rows by adapter: (adapter, row indices [n] int64 on the device)."""
    groups: tuple[tuple[LoraAdapter, torch.Tensor], ...]

    @classmethod
    def of(cls, row_adapters: list[LoraAdapter | None], device) -> "LoraBatch | None":
        """From the adapter of every row (None: the base); None when no row has one."""
        order: dict[int, tuple[LoraAdapter, list[int]]] = {}
        for i, a in enumerate(row_adapters):
            if a is not None:
                order.setdefault(id(a), (a, []))[1].append(i)
        if not order:
            return None
        return cls(tuple((a, torch.tensor(rows, dtype=torch.int64, device=device)) for a, rows in order.values()))


class LoraContext:
    """The batch the current forward runs (set by the model runner around the forward)."""

    def __init__(self):
        self.batch: LoraBatch | None = None

    @contextmanager
    def use(self, batch: LoraBatch | None):
        self.batch = batch
        try:
            yield
        finally:
            self.batch = None


class LoraLinear(nn.Module):
    """A base linear (float or A8W8) plus the update of the adapters in the step."""

    def __init__(self, base: nn.Module, layer: int, fused: str, ctx: LoraContext, kernels):
        super().__init__()
        self.base, self.layer, self.fused, self.ctx, self.kernels = base, layer, fused, ctx, kernels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base.forward(x)
        batch = self.ctx.batch
        if batch is None:
            return y
        for adapter, rows in batch.groups:
            d = adapter.delta(self.layer, self.fused)
            if d is None:
                continue
            y.index_copy_(0, rows, apply_delta(self.kernels, x.index_select(0, rows), y.index_select(0, rows), d,
                                               adapter.scaling))
        return y


def apply_delta(kernels, x: torch.Tensor, y: torch.Tensor, d, scaling: float) -> torch.Tensor:
    """y + ((x A^T) B^T) * scaling, in fp32, rounded once to y's dtype."""
    h = kernels.float_linear(x, d.a_prepared, torch.float32)
    delta = kernels.float_linear(h, d.b_prepared, torch.float32)
    return (y.float() + delta * scaling).to(y.dtype)


def attach(model, ctx: LoraContext, kernels) -> None:
    """Wraps the four fused linears of every decoder layer (the model's code is not changed); a Qwen3-MoE
    sparse layer has no dense MLP: its experts are not wrapped (adapter.py refuses expert adapters)."""
    for i, layer in enumerate(model.layers):
        attn, mlp = layer.self_attn, layer.mlp
        attn.qkv_proj = LoraLinear(attn.qkv_proj, i, "qkv", ctx, kernels)
        attn.o_proj = LoraLinear(attn.o_proj, i, "o", ctx, kernels)
        if not hasattr(mlp, "gate_up_proj"):
            continue
        mlp.gate_up_proj = LoraLinear(mlp.gate_up_proj, i, "gate_up", ctx, kernels)
        mlp.down_proj = LoraLinear(mlp.down_proj, i, "down", ctx, kernels)
