"""The CPU set's `moe` slot: csrc/moe.cpp's one-parallel-region op over a table of the experts' prepared weights.

The table (per expert the data pointers of its gate_up and down weights in this set's packed form; W4A16: with each
weight's GPTQ act-order perm, or 0 for none) is built once per expert list and kept on it (`kernel_cache`, the list
layers/moe.py hands to the slot) together with the tensors it points into. Expert lists the op does not cover (an
expert missing on this rank, mixed kinds, gate and up int4 weights with their own perms (a ConcatLinear, not one
W4A16Linear), odd widths of float weights) take the composed slot (kernels/moe.py), whose bits the op gives.
"""
from __future__ import annotations

import torch

from ..moe import grouped_moe

FLOAT, A8W8, W4A16, W4A8 = 0, 1, 2, 3
_KINDS = {"FloatLinear": FLOAT, "A8W8Linear": A8W8, "W4A16Linear": W4A16, "W4A8Linear": W4A8}


class _Table:
    def __init__(self, table, lut, dims, keep):
        self.table, self.lut, self.dims, self.keep = table, lut, dims, keep


def _weight(module, kind, n, k):
    """The pointers and the aux size of one expert weight, or None where the op does not take it."""
    if type(module).__name__ not in _KINDS or _KINDS[type(module).__name__] != kind:
        return None
    if (module.out_features, module.in_features) != (n, k):
        return None
    p = module.prepared
    if kind == FLOAT:
        packed = p[0]
        if packed.dim() != 4 or packed.size(1) * packed.size(3) != k or not packed.is_contiguous():
            return None
        return [packed.data_ptr()], (packed,), 0, -1.0, packed.dtype
    if kind == A8W8:
        packed, scale, colsum = p
        return [packed.data_ptr(), scale.data_ptr(), colsum.data_ptr()], p, packed.size(1), -1.0, None
    if kind == W4A8:   # `moe_experts_quant: int4a8` (kernels/cpu/__init__.py _w4a8_prepare's form)
        packed, scales, n_out = p
        panels = -(-n // 64)   # the op reads these shapes through raw pointers: w4a8_linear's checks
        if (n_out != n or packed.dim() != 3 or tuple(packed.shape) != (panels, -(-k // 8), 64) or scales.dim() != 3
                or scales.shape[0] != panels or scales.shape[2] != 64 or k % scales.size(1)):
            return None
        return [packed.data_ptr(), scales.data_ptr()], (packed, scales), scales.size(1), -1.0, None
    packed, scales, zeros, perm, n_out, lut_zero = p
    if n_out != n or perm.numel() not in (0, k) or perm.dtype != torch.int64 or not perm.is_contiguous():
        return None
    perm_ptr = perm.data_ptr() if perm.numel() else 0   # the act-order gather (csrc/moe_parts.h); 0: none
    return [packed.data_ptr(), scales.data_ptr(), zeros.data_ptr(), perm_ptr], p, scales.size(1), float(lut_zero), None


def build_table(experts) -> _Table | None:
    pairs = list(experts)
    if not pairs or any(pair is None for pair in pairs):
        return None
    gu0 = pairs[0][0]
    kind = _KINDS.get(type(gu0).__name__)
    if kind is None or gu0.out_features % 2:
        return None
    inter, hidden = gu0.out_features // 2, gu0.in_features
    rows, luts, keep, aux, wdt = [], [], [], None, set()
    for gate_up, down in pairs:
        a = _weight(gate_up, kind, 2 * inter, hidden)
        b = _weight(down, kind, hidden, inter)
        if a is None or b is None:
            return None
        if aux is None:
            aux = (a[2], b[2])
        if (a[2], b[2]) != aux:
            return None
        rows.append(a[0] + b[0])
        luts.append([a[3], b[3]])
        keep.extend(a[1] + b[1])
        wdt.update(d for d in (a[4], b[4]) if d is not None)
    if kind == FLOAT and (len(wdt) != 1 or next(iter(wdt)) not in (torch.float32, torch.bfloat16)):
        return None
    if kind != A8W8 and (hidden % 2 or inter % 2):
        return None
    bf16 = int(kind == FLOAT and next(iter(wdt)) == torch.bfloat16)
    return _Table(torch.tensor(rows, dtype=torch.int64), torch.tensor(luts, dtype=torch.float32),
                  [kind, hidden, inter, aux[0], aux[1], bf16], keep)


def table_of(experts) -> _Table | None:
    """The experts' table (built once, kept in the list's kernel_cache), or None where the op does not take them:
    what the `moe` slot below runs, and what models/qwen3_layer_loop.py hands to the one-region decode step."""
    cache = getattr(experts, "kernel_cache", None)
    if cache is None:
        return build_table(experts)
    if "cpu" not in cache:
        cache["cpu"] = build_table(experts)
    return cache["cpu"]


def cpu_moe(kernels, x, topk_ids, topk_weights, experts):
    """The `moe` slot (kernels/contract.py) of the CPU set."""
    table = table_of(experts)
    if (table is None or x.dim() != 2 or x.dtype not in (torch.float32, torch.bfloat16) or x.device.type != "cpu"
            or topk_ids.dtype != torch.int64 or topk_weights.dtype != x.dtype):
        return grouped_moe(kernels, x, topk_ids, topk_weights, experts)
    return torch.ops.qwen3_cpu.moe_experts(x, topk_ids, topk_weights, table.table, table.lut, table.dims)
