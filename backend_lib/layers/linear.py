"""Linear layers: float weights, A8W8 (int8 per-channel weights, dynamic int8 per-token activations), or
W4A16 (int4 weights per group or channel, float activations; checkpoint/int4.py reads the layouts).

Projections that read the same input (q/k/v, gate/up) are fused into one matrix at load; this is
exact for the quantized kinds as well, since every output row keeps its own scales (and zeros). Int4
projections whose columns are permuted differently (GPTQ desc_act, each with its own g_idx) cannot share
one activation gather: they stay separate matrices, concatenated after the matmuls.
"""
from __future__ import annotations

import torch
from torch import nn

from ..checkpoint import CheckpointError, QuantScheme, WeightStore
from ..checkpoint.int4 import Int4Weight, read_int4, rtn_quantize
from ..kernels import Kernels

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


# EngineConfig.int4_activations: an int4 checkpoint's linears on the W4A16 kernel's float activations as the
# checkpoint's scheme says, or on per-token int8 ones (load_linear); the kernel sets with a w4a8 path of their own
# or the reference's (kernels/reference/w4a8.py), and whose decode region takes it (the CPU set's)
INT4_ACTIVATIONS = ("checkpoint", "int8")
INT4A8_KERNELS = ("cpu", "reference")

class FloatLinear(nn.Module):
    """Holds the weight only in the kernel set's own form (packed tiles on the CPU)."""

    def __init__(self, weight: torch.Tensor, kernels: Kernels):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.dtype = weight.dtype
        self.kernels = kernels
        prepared = kernels.float_prepare(weight)
        # a kernel set that keeps the weight as given must not keep a view of the checkpoint's mapping
        self.prepared = prepared.clone() if prepared is weight else prepared

    def forward(self, x: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        return self.kernels.float_linear(x, self.prepared, out_dtype)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows of the weight (for an embedding tied to this lm_head)."""
        return self.kernels.float_rows(self.prepared, ids)


class A8W8Linear(nn.Module):
    """Holds the weight only in the kernel set's own form (e.g. packed tiles on the CPU), never twice."""

    def __init__(self, weight: torch.Tensor, weight_scale: torch.Tensor, kernels: Kernels):
        super().__init__()
        self.out_features, self.in_features = weight.shape   # weight: int8 [N, K], weight_scale: fp32 [N]
        self.kernels = kernels
        self.prepared = kernels.a8w8_prepare(weight, weight_scale)

    def forward(self, x: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        """out_dtype: y in that dtype (the kernel's output is x's: x is converted first, which for bf16 x and
        fp32 out is exact and leaves the activation quantization unchanged)."""
        if out_dtype is not None and out_dtype != x.dtype:
            x = x.to(out_dtype)
        return self.kernels.a8w8_linear(x, self.prepared)


class W4A16Linear(nn.Module):
    """Holds the int4 weight only in the kernel set's form (codes packed 8 to a word on the CPU)."""

    def __init__(self, weight: Int4Weight, kernels: Kernels):
        super().__init__()
        self.out_features, self.in_features = weight.codes.shape
        self.kernels = kernels
        self.prepared = kernels.w4a16_prepare(weight.codes, weight.scales, weight.zeros, weight.perm)

    def forward(self, x: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        """out_dtype: y in that dtype (x converted first: bf16 -> fp32 is exact, and the kernels compute in fp32)."""
        if out_dtype is not None and out_dtype != x.dtype:
            x = x.to(out_dtype)
        return self.kernels.w4a16_linear(x, self.prepared)


class W4A8Linear(nn.Module):
    """Int4 codes on int8 activations: the head (`lm_head_quant: int4a8`: int4_head_weight's codes) and the MoE
    experts (`moe_experts_quant: int4a8`: load_int4a8), codes and scales (zero point 8) in the kernel set's form, y
    as kernels/reference/w4a8.py computes it (llama.cpp's Q4_0 x Q8_0 in kind)."""

    def __init__(self, weight: Int4Weight, kernels: Kernels):
        super().__init__()
        if weight.perm is not None or not bool((weight.zeros == 8).all()):
            raise ValueError("int4a8: the codes must be symmetric (zero point 8) and in column order")
        self.out_features, self.in_features = weight.codes.shape
        self.kernels = kernels
        self.prepared = kernels.w4a8_prepared(weight.codes, weight.scales)

    def forward(self, x: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        """out_dtype: as A8W8Linear's (x converted first: exact for bf16 -> fp32, the quantized row unchanged)."""
        if out_dtype is not None and out_dtype != x.dtype:
            x = x.to(out_dtype)
        return self.kernels.w4a8(x, self.prepared)


class ConcatLinear(nn.Module):
    """Several Linear modules on one input, outputs concatenated (projections that cannot be fused)."""

    def __init__(self, parts: list[nn.Module]):
        super().__init__()
        self.parts = nn.ModuleList(parts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([p(x) for p in self.parts], dim=-1)


def _load_int4(store: WeightStore, names, out_features, in_features, scheme, device, kernels) -> nn.Module:
    parts = [read_int4(store, name, n_out, in_features, scheme.int4) for name, n_out in zip(names, out_features)]
    perms = [p.perm for p in parts]
    same = all((a is None and b is None) or (a is not None and b is not None and torch.equal(a, b))
               for a, b in zip(perms, perms[1:]))
    if not same:
        return ConcatLinear([W4A16Linear(_to(p, device), kernels) for p in parts])
    return W4A16Linear(_to(_fused(parts), device), kernels)


def _fused(parts: list[Int4Weight]) -> Int4Weight:
    """One Int4Weight of several read with the same arguments (the same group size) and the same perm, stacked
    along the output dimension."""
    return Int4Weight(torch.cat([p.codes for p in parts]), torch.cat([p.scales for p in parts]),
                      torch.cat([p.zeros for p in parts]), parts[0].group_size, parts[0].perm)


def _to(w: Int4Weight, device) -> Int4Weight:
    return Int4Weight(w.codes.to(device), w.scales.to(device), w.zeros.to(device), w.group_size,
                      None if w.perm is None else w.perm.to(device))


def int8_rows(weight: torch.Tensor, rows_per_chunk: int = 8192) -> tuple[torch.Tensor, torch.Tensor]:
    """(q int8 [N, K], s fp32 [N]) of a float weight: symmetric per-channel int8, s_n = max|w_n| / 127,
    q = round_half_even(w / s_n) (the activations' rule, per output row), in chunks of rows so the fp32
    transient stays small."""
    from ..kernels.reference import quantize_per_token

    q = torch.empty(weight.shape, dtype=torch.int8, device=weight.device)
    scale = torch.empty(weight.shape[0], dtype=torch.float32, device=weight.device)
    for r in range(0, weight.shape[0], rows_per_chunk):
        q[r:r + rows_per_chunk], s = quantize_per_token(weight[r:r + rows_per_chunk])
        scale[r:r + rows_per_chunk] = s.reshape(-1)
    return q, scale


def quantize_linear(weight: torch.Tensor, kernels: Kernels, rows_per_chunk: int = 8192) -> A8W8Linear:
    """A8W8Linear of a float weight [N, K] in int8_rows' form (`lm_head_quant: int8`)."""
    return A8W8Linear(*int8_rows(weight, rows_per_chunk), kernels)


INT4_HEAD_GROUP = 128


def int4_head_weight(weight: torch.Tensor, rows_per_chunk: int = 8192) -> Int4Weight:
    """The int4 form of a float head [N, K] (`lm_head_quant: int4`): compressed-tensors' symmetric W4A16 rule
    (checkpoint/int4.py rtn_quantize: s = max|w| / 7.5 per group, rounded to bf16 as llmcompressor stores it,
    q = clamp(round(w / s), -8, 7) stored + 8) per group of 128 columns, or of the whole row where K is not
    a multiple of 128. Chunks of rows keep the fp32 transient small. Bf16 scales and the one zero point keep
    the CPU set's batch-1 table lookup exact (kernels/cpu/__init__.py _lut_zero)."""
    n, k = weight.shape
    group = INT4_HEAD_GROUP if k % INT4_HEAD_GROUP == 0 else k
    codes = torch.empty((n, k), dtype=torch.uint8, device=weight.device)
    scales = torch.empty((n, k // group), dtype=torch.float32, device=weight.device)
    for r in range(0, n, rows_per_chunk):
        c, s, _ = rtn_quantize(weight[r:r + rows_per_chunk], group, True, torch.bfloat16)
        codes[r:r + rows_per_chunk], scales[r:r + rows_per_chunk] = c, s.float()
    return Int4Weight(codes, scales, torch.full_like(scales, 8), group, None)


def load_int4a8(store: WeightStore, names: list[str], out_features: list[int], in_features: int,
                scheme: QuantScheme | None, device: torch.device, kernels: Kernels,
                field: str = "moe_experts_quant: int4a8") -> W4A8Linear:
    """The Linear modules `names` fused as load_linear fuses them, as int4 codes on int8 activations (the setting
    `field`: `moe_experts_quant: int4a8` or `int4_activations: int8`): an int4 checkpoint's own codes and scales
    (W4A16 / GPTQ / AWQ, symmetric: zero point 8, in column order: no act-order perm), or a float weight quantized
    by int4_head_weight's rule (group 128). Errors name the field and the tensor; an int8 (W8A8) checkpoint's
    weights are refused: int4 codes from int8 ones would round twice (they run A8W8 as stored)."""
    quantized = [scheme is not None and scheme.is_quantized(n) for n in names]
    if any(quantized) != all(quantized):
        raise CheckpointError(f"modules {names} must all be quantized or all unquantized to be fused")
    key = field.split(":")[0]
    if quantized[0] and scheme.kind != "w4a16":
        raise ValueError(f"{field} takes int4 (W4A16, GPTQ, AWQ) or float weights; '{names[0]}' "
                         f"is {scheme.kind} (set {key}: checkpoint)")
    if quantized[0]:
        parts = [read_int4(store, name, n_out, in_features, scheme.int4) for name, n_out in zip(names, out_features)]
        for name, p in zip(names, parts):
            if p.perm is not None:
                raise ValueError(f"{field} takes int4 codes in column order; '{name}' has an act-order perm (g_idx) "
                                 f"(set {key}: checkpoint)")
            if not bool((p.zeros == 8).all()):
                raise ValueError(f"{field} takes symmetric int4 codes (zero point 8); '{name}' has zero points of "
                                 f"its own (set {key}: checkpoint)")
        return W4A8Linear(_to(_fused(parts), device), kernels)
    weights = [store.get(f"{name}.weight", (n_out, in_features), FLOAT_DTYPES)
               for name, n_out in zip(names, out_features)]
    return int4a8_linear(torch.cat(weights, 0), device, kernels)


def int4a8_linear(weight: torch.Tensor, device: torch.device, kernels: Kernels) -> W4A8Linear:
    """W4A8Linear of a float weight [N, K]: int4_head_weight's codes (group 128, zero point 8, bf16 scales)."""
    return W4A8Linear(int4_head_weight(weight.to(device)), kernels)


def make_head(weight: torch.Tensor, kernels: Kernels, lm_head_quant: str, greedy_head: str = "off") -> nn.Module:
    """The lm_head module of a float weight [vocab rows, hidden] for EngineConfig.lm_head_quant: 'checkpoint'
    (the weight as stored: FloatLinear, which also serves a tied embedding's rows), 'int8' (per channel, the
    A8W8 kernel), 'int4' (per group of 128, the W4A16 kernel) or 'int4a8' (int4's codes on int8 activations, the
    w4a8 slot). The quantized ones quantize each row on its
    own, so a tensor-parallel rank's rows quantize as they do at TP = 1. greedy_head 'int8' (with the checkpoint's
    head): a ScreenedHead, the same FloatLinear plus an int8 screen of its greedy rows (layers/greedy_head.py)."""
    if lm_head_quant == "int8":
        return quantize_linear(weight, kernels)
    if lm_head_quant == "int4":
        return W4A16Linear(int4_head_weight(weight), kernels)
    if lm_head_quant == "int4a8":
        return W4A8Linear(int4_head_weight(weight), kernels)
    if lm_head_quant != "checkpoint":
        raise ValueError(f"lm_head_quant: {lm_head_quant!r} is not supported")
    if greedy_head == "int8":
        from .greedy_head import ScreenedHead

        return ScreenedHead(weight, kernels)
    return FloatLinear(weight, kernels)


def load_linear(store: WeightStore, names: list[str], out_features: list[int], in_features: int,
                scheme: QuantScheme | None, dtype: torch.dtype, device: torch.device, kernels: Kernels,
                int4_activations: str = "checkpoint") -> nn.Module:
    """Loads the Linear modules `names` (HF module names) fused along the output dimension. int4_activations
    (EngineConfig.int4_activations): 'checkpoint' (an int4 weight on the W4A16 kernel's float activations) or
    'int8' (an int4 weight's own codes on per-token int8 activations: load_int4a8); float and int8 weights are
    loaded as stored either way."""
    if int4_activations not in INT4_ACTIVATIONS:
        raise ValueError(f"int4_activations: {int4_activations!r} is not one of {', '.join(INT4_ACTIVATIONS)}")
    quantized = [scheme is not None and scheme.is_quantized(n) for n in names]
    if any(quantized) != all(quantized):
        raise CheckpointError(f"modules {names} must all be quantized or all unquantized to be fused")
    if quantized[0] and scheme.kind == "w4a16" and int4_activations == "int8":
        return load_int4a8(store, names, out_features, in_features, scheme, device, kernels, "int4_activations: int8")
    if quantized[0] and scheme.kind == "w4a16":
        return _load_int4(store, names, out_features, in_features, scheme, device, kernels)
    if quantized[0]:
        weights, scales = [], []
        for name, n_out in zip(names, out_features):
            weights.append(store.get(f"{name}.weight", (n_out, in_features), (torch.int8,)))
            scale = store.get(f"{name}.weight_scale", None, FLOAT_DTYPES)
            if tuple(scale.shape) not in ((n_out, 1), (n_out,)):
                raise CheckpointError(
                    f"tensor '{name}.weight_scale' has shape {list(scale.shape)}, expected [{n_out}, 1]")
            if store.has(f"{name}.weight_zero_point") and bool(store.get(f"{name}.weight_zero_point").any()):
                raise CheckpointError(f"tensor '{name}.weight_zero_point' is non-zero: asymmetric weights "
                                      "are not supported")
            scales.append(scale.reshape(n_out).float())
        w = torch.cat(weights, 0).contiguous().to(device)
        s = torch.cat(scales, 0).contiguous().to(device)
        return A8W8Linear(w, s, kernels)
    weights = [store.get(f"{name}.weight", (n_out, in_features), FLOAT_DTYPES)
               for name, n_out in zip(names, out_features)]
    return FloatLinear(torch.cat(weights, 0).to(device=device, dtype=dtype).contiguous(), kernels)
