"""Writes int4 weight-only checkpoints of a model: compressed-tensors pack-quantized (through compressed-tensors
itself), and the GPTQ and AWQ layouts (written here from their documented packing: see
backend_lib/checkpoint/int4.py, which reads all three).

GPTQ and AWQ are written by hand because their own tools (gptqmodel, autoawq) need calibration data and
native extensions that do not install here; the quantization is plain round-to-nearest per group, which is
what the stored layout holds whatever algorithm chose the values.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from ..checkpoint.int4 import AWQ_ORDER, rtn_quantize

QUANTIZED = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _pack_rows(codes: torch.Tensor, order=tuple(range(8))) -> torch.Tensor:
    """[R, 8C] codes -> int32 [R, C]: code of column 8j + order[i] at bits 4i of word j."""
    r, c = codes.shape
    grouped = codes.to(torch.int64).reshape(r, c // 8, 8)[..., list(order)]
    words = (grouped << torch.arange(0, 32, 4, dtype=torch.int64)).sum(-1)
    return torch.where(words >= 2 ** 31, words - 2 ** 32, words).to(torch.int32)


def gptq_tensors(w, group_size, symmetric, perm=None, v1=True):
    """The GPTQ tensors of one Linear: qweight [K/8, N], qzeros [G, N/8], scales fp16 [G, N], g_idx [K]; perm: the
    act-order (desc_act) order in which the columns were quantized."""
    n, k = w.shape
    gs = group_size or k
    codes, scales, zeros = rtn_quantize(w, group_size, symmetric, torch.float16, perm, min_zero=1 if v1 else 0)
    if perm is None:
        g_idx = torch.arange(k, dtype=torch.int32) // gs
    else:       # column perm[j] was quantized j-th: it belongs to group j // gs
        g_idx = torch.empty(k, dtype=torch.int32)
        g_idx[perm] = (torch.arange(k) // gs).to(torch.int32)
    stored_zeros = zeros - 1 if v1 else zeros
    return {"qweight": _pack_cols(codes),
            "qzeros": _pack_rows(stored_zeros.t().contiguous() & 0xF),
            "scales": scales.t().contiguous(), "g_idx": g_idx}


def _pack_cols(codes: torch.Tensor) -> torch.Tensor:
    """codes [N, K] -> int32 [K/8, N]: code of (n, 8j + i) at bits 4i of word (j, n) (GPTQ packs along K)."""
    return _pack_rows(codes).t().contiguous()


def awq_tensors(w, group_size):
    """The AWQ GEMM tensors of one Linear: qweight [K, N/8], qzeros [G, N/8] (interleaved), scales fp16 [G, N]."""
    codes, scales, zeros = rtn_quantize(w, group_size, False, torch.float16)
    return {"qweight": _pack_rows(codes.t().contiguous(), AWQ_ORDER),
            "qzeros": _pack_rows(zeros.t().contiguous(), AWQ_ORDER),
            "scales": scales.t().contiguous()}


def write_gptq_or_awq(folder: Path, fmt: str, group_size: int | None, symmetric: bool = True,
                      desc_act: bool = False, seed: int = 0, shared_perm: bool = True) -> None:
    """Rewrites a saved bf16 checkpoint folder (model.safetensors) in place as GPTQ or AWQ. desc_act: a random act
    order per input; shared_perm: q/k/v (and gate/up) share theirs, as GPTQ's (their inputs' Hessian is the same),
    else each module draws its own."""
    from safetensors.torch import load_file, save_file

    path = folder / "model.safetensors"
    tensors = load_file(str(path))
    gen = torch.Generator().manual_seed(seed)
    perms: dict[str, torch.Tensor] = {}
    for name in sorted(tensors):
        module = name.removesuffix(".weight")
        if not name.endswith(".weight") or module.rsplit(".", 1)[-1] not in QUANTIZED:
            continue
        w = tensors.pop(name)
        perm = None
        if desc_act:
            leaf = module.rsplit(".", 1)[-1]
            key = module.rsplit(".", 1)[0] + {"k_proj": ".q_proj", "v_proj": ".q_proj", "up_proj": ".gate_proj"
                                              }.get(leaf, "." + leaf) if shared_perm else module
            perm = perms.setdefault(key, torch.randperm(w.shape[1], generator=gen))
        parts = gptq_tensors(w, group_size, symmetric, perm) if fmt == "gptq" else awq_tensors(w, group_size)
        tensors.update({f"{module}.{k}": v for k, v in parts.items()})
    save_file(tensors, str(path), metadata={"format": "pt"})
    cfg = json.loads((folder / "config.json").read_text())
    if fmt == "gptq":
        cfg["quantization_config"] = {"quant_method": "gptq", "bits": 4, "group_size": group_size or -1,
                                      "desc_act": desc_act, "sym": symmetric, "damp_percent": 0.01,
                                      "true_sequential": True, "static_groups": False, "checkpoint_format": "gptq",
                                      "model_name_or_path": None, "model_file_base_name": "model"}
    else:
        cfg["quantization_config"] = {"quant_method": "awq", "bits": 4, "group_size": group_size, "zero_point": True,
                                      "version": "gemm", "modules_to_not_convert": None}
    (folder / "config.json").write_text(json.dumps(cfg, indent=2))


def quantize_pack_quantized(model, group_size: int | None, symmetric: bool):
    """Applies a compressed-tensors W4A16 scheme (pack-quantized, lm_head ignored) with round-to-nearest scales
    and zero points, as llmcompressor's output holds; returns the compressor (compress_model, update_config)."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (QuantizationArgs, QuantizationConfig, QuantizationScheme,
                                                 QuantizationStatus, apply_quantization_config)

    args = QuantizationArgs(num_bits=4, type="int", symmetric=symmetric, dynamic=False,
                            strategy="group" if group_size else "channel", group_size=group_size)
    qc = QuantizationConfig(config_groups={"group_0": QuantizationScheme(targets=["Linear"], weights=args)},
                            ignore=["lm_head"])
    apply_quantization_config(model, qc)
    with torch.no_grad():
        for _, module in model.named_modules():
            if hasattr(module, "weight_scale"):
                _, scales, zeros = rtn_quantize(module.weight, group_size, symmetric, module.weight_scale.dtype)
                module.weight_scale.copy_(scales.reshape(module.weight_scale.shape))
                if not symmetric:      # compressed-tensors' zero point is signed: code = q + 8
                    module.weight_zero_point.copy_((zeros - 8).reshape(module.weight_zero_point.shape)
                                                   .to(module.weight_zero_point.dtype))
                module.quantization_status = QuantizationStatus.FROZEN
    compressor = ModelCompressor.from_pretrained_model(model, quantization_format="pack-quantized")
    compressor.compress_model(model)
    return compressor
