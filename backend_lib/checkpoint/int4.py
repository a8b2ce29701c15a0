"""Int4 weight-only checkpoints (W4A16): the three layouts, read into one canonical form.

Formats (the tensors of one quantized Linear `name`, weight W [N out, K in], G groups of `group_size`
input columns, or one group per row for channel-wise):

- compressed-tensors `pack-quantized` (llmcompressor's W4A16 / W4A16_ASYM):
  `weight_packed` int32 [N, K/8], eight 4-bit codes per word along K, code i at bits 4i, stored as
  q + 8 (signed q in [-8, 7]); `weight_scale` [N, G]; `weight_zero_point` int32 [N/8, G] (asymmetric only:
  packed along N the same way, zp + 8; int8 [N, G] unpacked in older compressed-tensors versions); `weight_shape` [2]; `weight_g_idx` [K] with activation
  ordering `group`. W = (q - zp) * scale.
- GPTQ (`quant_method: gptq`, AutoGPTQ / gptqmodel `checkpoint_format: gptq`): `qweight` int32 [K/8, N],
  packed along K (code i of word j is column 8j + i, bits 4i); `qzeros` int32 [G, N/8] packed along N;
  `scales` [G, N]; `g_idx` int32 [K] (the group of each input column; a permutation of the groups with
  `desc_act: true`). The stored zero is zero - 1 (the historical off-by-one of `gptq`; `gptq_v2` stores
  the zero itself). W[n, k] = (q - zero) * scales[g_idx[k], n].
- AWQ (`quant_method: awq`, `version: gemm`, AutoAWQ): `qweight` int32 [K, N/8] packed along N in the
  interleaved order [0, 2, 4, 6, 1, 3, 5, 7] (code i of a word is column AWQ_ORDER[i] of its 8); `qzeros`
  int32 [G, N/8] the same way; `scales` [G, N]. W = (q - zero) * scale.

Canonical form (`Int4Weight`): codes uint8 [N, K] in 0..15, scales fp32 [N, G], zeros fp32 [N, G] (exact
integers, 8 for symmetric; 1..16 for GPTQ v1) and, when the groups are not contiguous runs of columns
(GPTQ desc_act, compressed-tensors actorder group), `perm`: the columns sorted by group, so that
y = x[:, perm] @ W[:, perm]^T with groups contiguous again (the kernels gather x by perm).
"""
from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from .errors import CheckpointError

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

# GPTQ / AWQ config keys that describe how the checkpoint was made or which runtime kernel to pick, not the
# stored layout; every other key must be one this module reads, or the checkpoint is refused naming it.
GPTQ_INFO_KEYS = {"damp_percent", "damp_auto_increment", "true_sequential", "static_groups", "model_name_or_path",
                  "model_file_base_name", "quantizer", "meta", "tokenizer", "dataset", "use_cuda_fp16",
                  "use_exllama", "exllama_config", "max_input_length", "cache_block_outputs", "batch_size",
                  "pad_token_id", "backend", "mse", "module_name_preceding_first_block", "block_name_to_quantize",
                  "modules_in_block_to_quantize", "v2", "v2_alpha", "act_group_aware", "hyb_act", "fail_safe",
                  "offload_to_disk", "offload_to_disk_path", "rotation", "damp_percent_increment", "mock_quantization",
                  "buffered_fwd", "adapter"}
AWQ_INFO_KEYS = {"backend", "do_fuse", "fuse_max_seq_len", "modules_to_fuse", "exllama_config"}


@dataclass(frozen=True)
class Int4Args:
    format: str                 # "pack-quantized" | "gptq" | "awq"
    group_size: int | None      # None: one group per output row (channel-wise)
    symmetric: bool
    zero_offset: int = 0        # added to stored zeros (GPTQ v1: 1)

    def describe(self) -> str:
        group = f"group {self.group_size}" if self.group_size else "channel-wise"
        return f"W4A16 {self.format} ({group}, {'symmetric' if self.symmetric else 'asymmetric'})"


@dataclass
class Int4Weight:
    codes: torch.Tensor         # uint8 [N, K], 0..15
    scales: torch.Tensor        # fp32 [N, G]
    zeros: torch.Tensor         # fp32 [N, G]
    group_size: int             # K for channel-wise
    perm: torch.Tensor | None   # int64 [K] or None

    def dequantize(self) -> torch.Tensor:
        """fp32 [N, K] in the checkpoint's column order: (q - zero) * scale, each rounded once in fp32."""
        w = self.sorted_dequantize()
        if self.perm is None:
            return w
        out = torch.empty_like(w)
        out[:, self.perm] = w
        return out

    def sorted_dequantize(self) -> torch.Tensor:
        """fp32 [N, K] with the columns in perm order (groups contiguous)."""
        zeros = self.zeros.repeat_interleave(self.group_size, dim=1)
        scales = self.scales.repeat_interleave(self.group_size, dim=1)
        return (self.codes.float() - zeros) * scales


def rtn_quantize(w: torch.Tensor, group_size: int | None, symmetric: bool, scale_dtype: torch.dtype,
                 perm: torch.Tensor | None = None, min_zero: int = 0):
    """Round-to-nearest int4 of w [N, K] per group of columns (of perm's order when given): codes uint8 [N, K] in
    the checkpoint's column order, scales [N, G] (rounded to scale_dtype first, so codes match the stored
    scale), zeros int [N, G] (8 when symmetric)."""
    n, k = w.shape
    gs = group_size or k
    wf = w.float() if perm is None else w.float()[:, perm]
    grouped = wf.reshape(n, k // gs, gs)
    if symmetric:
        scales = (grouped.abs().amax(-1) / 7.5).clamp_min(1e-6).to(scale_dtype).float()
        zeros = torch.full_like(scales, 8)
    else:
        lo, hi = grouped.amin(-1).clamp(max=0), grouped.amax(-1).clamp(min=0)
        scales = ((hi - lo) / 15).clamp_min(1e-6).to(scale_dtype).float()
        zeros = torch.clamp(torch.round(-lo / scales), min_zero, 15)
    codes = torch.clamp(torch.round(grouped / scales[..., None]) + zeros[..., None], 0, 15).reshape(n, k)
    if perm is not None:
        out = torch.empty_like(codes)
        out[:, perm] = codes
        codes = out
    return codes.to(torch.uint8), scales.to(scale_dtype), zeros.to(torch.int32)


def _flag(qc: dict, key: str, default):
    value = qc.get(key, default)
    if not isinstance(value, bool):
        raise CheckpointError(f"quantization_config.{key}: {value!r} must be true or false")
    return value


def _bits(qc: dict) -> None:
    bits = qc.get("bits")
    if bits != 4:
        raise CheckpointError(f"quantization_config.bits: {bits!r} is not supported (weight-only checkpoints: 4)")


def _group_size(value, where: str) -> int | None:
    """GPTQ / AWQ group_size: -1 (or null) is channel-wise, else a positive multiple of 8."""
    if value in (-1, None):
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0 or value % 8:
        raise CheckpointError(f"quantization_config.{where}: {value!r} is not supported "
                              "(a positive multiple of 8, or -1 for channel-wise)")
    return value


def _no_unknown(qc: dict, known: set[str], method: str) -> None:
    unknown = sorted(set(qc) - known)
    if unknown:
        raise CheckpointError(f"quantization_config.{unknown[0]}: {qc[unknown[0]]!r} is not supported for "
                              f"quant_method {method!r}")


def parse_gptq(qc: dict) -> tuple[Int4Args, tuple[str, ...]]:
    """(args, ignored module patterns) of a GPTQ quantization_config."""
    _no_unknown(qc, GPTQ_INFO_KEYS | {"quant_method", "bits", "group_size", "desc_act", "sym", "checkpoint_format",
                                      "format", "pack_dtype", "lm_head", "dynamic", "modules_to_not_convert"}, "gptq")
    _bits(qc)
    group = _group_size(qc.get("group_size", 128), "group_size")
    _flag(qc, "desc_act", False)           # read from g_idx: both orders load the same way
    sym = _flag(qc, "sym", True)
    fmt = qc.get("checkpoint_format", qc.get("format", "gptq"))
    if fmt not in ("gptq", "gptq_v2"):
        key = "checkpoint_format" if "checkpoint_format" in qc else "format"
        raise CheckpointError(f"quantization_config.{key}: {fmt!r} is not supported (accepted: gptq, gptq_v2)")
    if qc.get("pack_dtype", "int32") not in ("int32", "torch.int32"):
        raise CheckpointError(f"quantization_config.pack_dtype: {qc['pack_dtype']!r} is not supported (int32)")
    if qc.get("lm_head"):
        raise CheckpointError("quantization_config.lm_head: true is not supported (a quantized lm_head)")
    if qc.get("dynamic"):
        raise CheckpointError(f"quantization_config.dynamic: per-module overrides {qc['dynamic']!r} are not supported")
    return Int4Args("gptq", group, sym, 1 if fmt == "gptq" else 0), _not_converted(qc)


def parse_awq(qc: dict) -> tuple[Int4Args, tuple[str, ...]]:
    _no_unknown(qc, AWQ_INFO_KEYS | {"quant_method", "bits", "group_size", "zero_point", "version",
                                     "modules_to_not_convert"}, "awq")
    _bits(qc)
    group = _group_size(qc.get("group_size", 128), "group_size")
    version = str(qc.get("version", "gemm")).lower()
    if version != "gemm":
        raise CheckpointError(f"quantization_config.version: {qc.get('version')!r} is not supported (AWQ packing: gemm)")
    if not _flag(qc, "zero_point", True):
        raise CheckpointError("quantization_config.zero_point: false is not supported (AWQ GEMM checkpoints "
                              "carry qzeros)")
    return Int4Args("awq", group, False), _not_converted(qc)


def _not_converted(qc: dict) -> tuple[str, ...]:
    """modules_to_not_convert: names matched as substrings of module names (as transformers does)."""
    names = qc.get("modules_to_not_convert") or []
    if not isinstance(names, list):
        raise CheckpointError(f"quantization_config.modules_to_not_convert: must be a list, got {names!r}")
    return tuple(f"re:.*{re.escape(str(n))}.*" for n in names)


# ----- reading one Linear ------------------------------------------------------------------------------------

def _unpack_rows(packed: torch.Tensor) -> torch.Tensor:
    """int32 [R, C] -> uint8 [R, 8C]: the 8 codes of each word, code i at bits 4i, along the last dim."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32)
    return ((packed[..., None] >> shifts) & 0xF).to(torch.uint8).reshape(*packed.shape[:-1], -1)


def _groups_from_g_idx(g_idx: torch.Tensor, n_groups: int, group_size: int, name: str) -> torch.Tensor | None:
    """The permutation that sorts columns by group, or None when groups already are contiguous runs."""
    g_idx = g_idx.to(torch.int64)
    if bool((g_idx < 0).any()) or bool((g_idx >= n_groups).any()):
        raise CheckpointError(f"tensor '{name}' has group indices outside [0, {n_groups})")
    if torch.equal(g_idx, torch.arange(g_idx.numel()) // group_size):
        return None
    if bool((torch.bincount(g_idx, minlength=n_groups) != group_size).any()):
        raise CheckpointError(f"tensor '{name}': every group must hold group_size={group_size} columns")
    return torch.argsort(g_idx, stable=True)


def read_int4(store, name: str, n_out: int, k_in: int, args: Int4Args) -> Int4Weight:
    """The canonical form of Linear `name` (HF module name) of an int4 checkpoint; shapes checked."""
    group = args.group_size or k_in
    if k_in % group:
        raise CheckpointError(f"quantization_config group_size {group} does not divide {name}'s {k_in} input features")
    if n_out % 8 or k_in % 8:
        raise CheckpointError(f"module {name}: int4 weights need multiples of 8 features, got [{n_out}, {k_in}]")
    g = k_in // group
    g_idx_name = None
    if args.format == "pack-quantized":
        shape = store.get(f"{name}.weight_shape")
        if [int(v) for v in shape.reshape(-1)] != [n_out, k_in]:
            raise CheckpointError(f"tensor '{name}.weight_shape' is {shape.tolist()}, expected [{n_out}, {k_in}]")
        codes = _unpack_rows(store.get(f"{name}.weight_packed", (n_out, k_in // 8), (torch.int32,)))
        scales = store.get(f"{name}.weight_scale", (n_out, g), FLOAT_DTYPES).float()
        if args.symmetric:
            if store.has(f"{name}.weight_zero_point"):
                zp = store.get(f"{name}.weight_zero_point")
                if bool(zp.any()):
                    raise CheckpointError(f"tensor '{name}.weight_zero_point' is non-zero in a symmetric scheme")
            zeros = torch.full((n_out, g), 8.0)
        else:
            zp = store.get(f"{name}.weight_zero_point", None, (torch.int32, torch.int8))
            if zp.dtype == torch.int8 and tuple(zp.shape) == (n_out, g):
                zeros = zp.float() + 8        # older compressed-tensors versions stored signed zero points unpacked
            elif zp.dtype == torch.int32 and tuple(zp.shape) == (n_out // 8, g):
                zeros = _unpack_rows(zp.t().contiguous()).t().float()      # packed along N
            else:
                raise CheckpointError(f"tensor '{name}.weight_zero_point' has shape {list(zp.shape)} ({zp.dtype}), "
                                      f"expected int32 [{n_out // 8}, {g}] (packed) or int8 [{n_out}, {g}]")
        if store.has(f"{name}.weight_g_idx"):
            g_idx_name = f"{name}.weight_g_idx"
    elif args.format == "gptq":
        codes = _unpack_rows(store.get(f"{name}.qweight", (k_in // 8, n_out), (torch.int32,)).t().contiguous())
        scales = store.get(f"{name}.scales", (g, n_out), FLOAT_DTYPES).float().t().contiguous()
        zeros = _unpack_rows(store.get(f"{name}.qzeros", (g, n_out // 8), (torch.int32,))).float()
        zeros = (zeros + args.zero_offset).t().contiguous()
        if store.has(f"{name}.g_idx"):
            g_idx_name = f"{name}.g_idx"
    elif args.format == "awq":
        def awq_unpack(t):     # [R, N/8] -> [R, N] in column order
            u = _unpack_rows(t).reshape(t.shape[0], -1, 8)
            return u[..., list(_inverse(AWQ_ORDER))].reshape(t.shape[0], -1)
        codes = awq_unpack(store.get(f"{name}.qweight", (k_in, n_out // 8), (torch.int32,))).t().contiguous()
        scales = store.get(f"{name}.scales", (g, n_out), FLOAT_DTYPES).float().t().contiguous()
        zeros = awq_unpack(store.get(f"{name}.qzeros", (g, n_out // 8), (torch.int32,))).float().t().contiguous()
    else:  # parse_quantization_config admits no other
        raise AssertionError(args.format)
    perm = None
    if g_idx_name is not None:
        g_idx = store.get(g_idx_name, (k_in,), (torch.int32, torch.int64))
        perm = _groups_from_g_idx(g_idx, g, group, g_idx_name)
        if perm is not None:
            codes = codes[:, perm].contiguous()
    return Int4Weight(codes.contiguous(), scales.contiguous(), zeros.contiguous(), group, perm)


def _inverse(order) -> list[int]:
    inv = [0] * len(order)
    for i, o in enumerate(order):
        inv[o] = i
    return inv
