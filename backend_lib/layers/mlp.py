"""Qwen3 SwiGLU MLP: fused gate/up projection, silu(gate) * up, down projection."""
from __future__ import annotations

import torch
from torch import nn

from ..kernels import Kernels


class Qwen3MLP(nn.Module):
    def __init__(self, gate_up_proj: nn.Module, down_proj: nn.Module, kernels: Kernels):
        super().__init__()
        self.gate_up_proj, self.down_proj = gate_up_proj, down_proj
        self.kernels = kernels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj.forward(self.kernels.silu_mul(self.gate_up_proj.forward(x)))
