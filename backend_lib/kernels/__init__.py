"""Kernel interface of the Qwen3 forward.

`get_kernels(device)` returns one `Kernels` set: the pure-PyTorch reference (any device) with the
optimized implementations of that device swapped in where they exist. On the CPU those are C++
kernels compiled at load (see build.py); they are batch invariant, so a sequence computes the
same numbers whatever else shares its batch.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import Callable

import torch

from . import reference

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Kernels:
    name: str
    rms_norm: Callable
    add_rms_norm: Callable
    rotary: Callable
    silu_mul: Callable
    quantize_per_token: Callable
    a8w8_linear: Callable
    float_linear: Callable
    write_kv: Callable
    paged_attention: Callable
    tq_write: Callable
    tq_paged_attention: Callable


REFERENCE = Kernels(
    name="reference",
    rms_norm=reference.rms_norm,
    add_rms_norm=reference.add_rms_norm,
    rotary=reference.rotary,
    silu_mul=reference.silu_mul,
    quantize_per_token=reference.quantize_per_token,
    a8w8_linear=reference.a8w8_linear,
    float_linear=reference.float_linear,
    write_kv=reference.write_kv,
    paged_attention=reference.paged_attention,
    tq_write=reference.tq_write,
    tq_paged_attention=reference.tq_paged_attention,
)


def _cpu_kernels() -> Kernels:
    ops = torch.ops.qwen3_cpu
    return replace(
        REFERENCE,
        name="cpu",
        rms_norm=ops.rms_norm,
        add_rms_norm=ops.add_rms_norm,
        float_linear=ops.float_linear,
        paged_attention=ops.paged_attention,
        tq_write=ops.tq_write,
        tq_paged_attention=ops.tq_paged_attention,
    )


def get_kernels(device: torch.device | str, backend: str = "auto", cache_dir=None) -> Kernels:
    """backend: 'auto' (the device's best), 'reference' (pure PyTorch) or 'cpu' (compiled, required)."""
    device = torch.device(device)
    if backend not in ("auto", "reference", "cpu"):
        raise ValueError(f"kernels: unknown backend {backend!r} (auto, reference, cpu)")
    if backend == "reference" or device.type != "cpu":
        return REFERENCE
    from .build import load_cpu_extension

    if load_cpu_extension(cache_dir):
        return _cpu_kernels()
    if backend == "cpu":
        raise RuntimeError("kernels: backend 'cpu' was asked for but the CPU kernels could not be built")
    return REFERENCE
