"""Kernel sets of the Qwen3 forward, one package each, all filling the contract in contract.py:

  reference/  pure PyTorch, any device: the yardstick every other set is tested against
  cpu/        C++ kernels compiled at load (cpu/build.py, cpu/csrc/), cached on disk
  triton/     OpenAI Triton kernels for CUDA GPUs (the `[cuda]` extra; TRITON_INTERPRET=1 runs them on the CPU)
  npu/        torch_npu fused ops for Ascend NPUs (planned: issue 21)

`get_kernels(device, backend)` picks one. Every set is batch invariant, so a sequence computes the same
numbers whatever else shares its batch.
"""
from __future__ import annotations

import logging

import torch

from . import reference
from .contract import Kernels

log = logging.getLogger(__name__)

REFERENCE = reference.KERNELS
KERNEL_BACKENDS = ("auto", "reference", "cpu", "triton")

__all__ = ["KERNEL_BACKENDS", "Kernels", "REFERENCE", "get_kernels", "reference"]


def get_kernels(device: torch.device | str, backend: str = "auto", cache_dir=None) -> Kernels:
    """backend: 'auto' (the device's best), 'reference' (pure PyTorch), 'cpu' (compiled, required) or 'triton'
    (required); validated by EngineConfig."""
    device = torch.device(device)
    if backend == "reference":
        return REFERENCE
    if backend == "triton":
        from . import triton

        return triton.load(device)
    if device.type == "cuda":
        from . import triton

        try:
            return triton.load(device)
        except RuntimeError as exc:
            log.warning("%s; using the pure-PyTorch reference kernels (slow)", exc)
            return REFERENCE
    if device.type != "cpu":
        return REFERENCE
    from . import cpu

    kernels = cpu.load(cache_dir)
    if kernels is not None:
        return kernels
    if backend == "cpu":
        raise RuntimeError("kernels: backend 'cpu' was asked for but the CPU kernels could not be built")
    return REFERENCE
