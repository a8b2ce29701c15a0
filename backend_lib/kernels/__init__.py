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
    qk_norm_rope: Callable      # (qkv, q_w, k_w, positions, cos_sin, H, KVH, eps) -> (q, k, v)
    silu_mul: Callable
    a8w8_prepare: Callable      # (w_q int8 [N, K], w_scale fp32 [N]) -> the weight in this kernel set's form
    a8w8_linear: Callable       # (x, prepared) -> y
    float_prepare: Callable     # w [N, K] -> the weight in this kernel set's form
    float_linear: Callable      # (x, prepared, out_dtype=None) -> y
    float_rows: Callable        # (prepared, ids) -> rows of w (a tied embedding reads the lm_head's weight)
    write_kv: Callable
    paged_attention: Callable
    tq_write: Callable
    tq_paged_attention: Callable


REFERENCE = Kernels(
    name="reference",
    rms_norm=reference.rms_norm,
    add_rms_norm=reference.add_rms_norm,
    qk_norm_rope=reference.qk_norm_rope,
    silu_mul=reference.silu_mul,
    a8w8_prepare=lambda w_q, w_scale: (w_q, w_scale),
    a8w8_linear=lambda x, prepared: reference.a8w8_linear(x, *prepared),
    float_prepare=lambda w: w,
    float_linear=reference.float_linear,
    float_rows=lambda w, ids: w.index_select(0, ids),
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
        a8w8_prepare=lambda w_q, w_scale: (ops.a8w8_pack(w_q), w_scale.float().contiguous(), ops.a8w8_colsum(w_q)),
        a8w8_linear=lambda x, prepared: ops.a8w8_linear(x, *prepared),
        rms_norm=ops.rms_norm,
        qk_norm_rope=ops.qk_norm_rope,
        silu_mul=ops.silu_mul,
        add_rms_norm=ops.add_rms_norm,
        float_prepare=lambda w: (ops.float_pack(w), w.shape[0], w.shape[1]),
        float_linear=lambda x, p, out_dtype=None: ops.float_linear(x, p[0], p[1], out_dtype),
        float_rows=lambda p, ids: ops.float_packed_rows(p[0], ids, p[2]),
        paged_attention=ops.paged_attention,
        write_kv=ops.write_kv,
        tq_write=ops.tq_write,
        tq_paged_attention=ops.tq_paged_attention,
    )


KERNEL_BACKENDS = ("auto", "reference", "cpu")


def get_kernels(device: torch.device | str, backend: str = "auto", cache_dir=None) -> Kernels:
    """backend: 'auto' (the device's best), 'reference' (pure PyTorch) or 'cpu' (compiled, required);
    validated by EngineConfig."""
    device = torch.device(device)
    if backend == "reference" or device.type != "cpu":
        return REFERENCE
    from .build import load_cpu_extension

    if load_cpu_extension(cache_dir):
        return _cpu_kernels()
    if backend == "cpu":
        raise RuntimeError("kernels: backend 'cpu' was asked for but the CPU kernels could not be built")
    return REFERENCE
