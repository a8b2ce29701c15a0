"""The OpenAI Triton kernel set, for CUDA GPUs (`kernels: triton`; `auto` picks it on CUDA).

  common.py     the interpreter switch and the rounding helpers shared by the kernels
  linear.py     A8W8 (fused per-token int8 quantization + int8 GEMM, bit-exact) and float linear
  w4a16.py      int4 weight-only (W4A16): the weight packed two codes a byte, dequantized in registers
  norm.py       RMSNorm, add + RMSNorm, q/k-norm + RoPE, SiLU-mul
  attention.py  paged attention (prefill and decode), KV write, TurboQuant write / rotated-space attention
  moe.py        the fused MoE: pairs sorted by expert and padded to the block, grouped GEMMs, the combine
  experts.py    the MoE slot: each layer's experts stacked once, the fused path's glue
  ops.py        the kernels as torch custom ops with fake implementations
  kernel_set.py the `Kernels` set
  aot.py        ahead-of-time compilation of every launched variant for a GPU target (no GPU needed)

Needs the `triton` package (the `[cuda]` extra). With `TRITON_INTERPRET=1` (set before the first import) the
same kernels run on CPU tensors through Triton's interpreter: how the CPU-only CI proves them.
"""
from __future__ import annotations

import os

import torch


def load(device: torch.device):
    """The Triton set for `device`; raises RuntimeError where it cannot run there."""
    interpret = os.environ.get("TRITON_INTERPRET", "0") == "1"
    if device.type != "cuda" and not (device.type == "cpu" and interpret):
        raise RuntimeError(f"kernels: 'triton' runs on CUDA devices (or on the CPU with TRITON_INTERPRET=1), "
                           f"not on {device.type}")
    try:
        from .kernel_set import KERNELS
    except ImportError as exc:
        raise RuntimeError(f"kernels: 'triton' needs the triton package (pip install 'qwen3-triton[cuda]'): "
                           f"{exc}") from exc
    return KERNELS
