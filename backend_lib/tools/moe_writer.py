"""Quantizes a saved bf16 Qwen3-MoE checkpoint folder in place, tensor by tensor, in compressed-tensors' layouts.

compressed-tensors quantizes nn.Linear modules, and transformers 5 holds a MoE's experts as fused 3-D
parameters, so it would leave the experts (almost all of the weights) in bf16. The published MoE releases
quantize every expert; this writes what they hold: every projection of the attention, the dense MLPs and each
expert (`..._proj.weight`) quantized, the routers (`model.layers.N.mlp.gate`), embeddings, norms and lm_head
kept in bf16 and listed in `ignore` (lm_head and each router, as the RedHatAI releases list them).

  a8w8:  `weight` int8 [N, K] = clamp(round(w / s), -128, 127), `weight_scale` bf16 [N, 1] = absmax / 127.5
  w4a16: pack-quantized: `weight_packed` int32 [N, K / 8] (code q + 8 at bits 4i), `weight_scale` bf16 [N, G],
         `weight_shape` int64 [2], asymmetric: `weight_zero_point` int32 [N / 8, G] packed along N
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import torch

from ..checkpoint.int4 import rtn_quantize
from .int4_writers import _pack_rows

PROJECTION = re.compile(r"^model\.layers\.\d+\.(self_attn\.[qkvo]_proj|mlp\.(experts\.\d+\.)?(gate|up|down)_proj)"
                        r"\.weight$")


def _a8w8(w: torch.Tensor) -> dict[str, torch.Tensor]:
    wf = w.float()
    scale = (wf.abs().amax(dim=1, keepdim=True).clamp_min(1e-8) / 127.5).to(torch.bfloat16)
    q = torch.clamp(torch.round(wf / scale.float()), -128, 127).to(torch.int8)
    return {"weight": q, "weight_scale": scale}


def _w4a16(w: torch.Tensor, group_size: int | None, symmetric: bool) -> dict[str, torch.Tensor]:
    codes, scales, zeros = rtn_quantize(w, group_size, symmetric, torch.bfloat16)
    out = {"weight_packed": _pack_rows(codes), "weight_scale": scales,
           "weight_shape": torch.tensor(list(w.shape), dtype=torch.int64)}
    if not symmetric:
        out["weight_zero_point"] = _pack_rows(zeros.t().contiguous()).t().contiguous()
    return out


def quantization_config(fmt: str, num_layers: int, group_size: int | None, symmetric: bool) -> dict:
    if fmt == "a8w8":
        group = {"format": "int-quantized", "targets": ["Linear"], "output_activations": None,
                 "weights": {"dynamic": False, "group_size": None, "num_bits": 8, "strategy": "channel",
                             "symmetric": True, "type": "int"},
                 "input_activations": {"dynamic": True, "group_size": None, "num_bits": 8, "strategy": "token",
                                       "symmetric": True, "type": "int"}}
    else:
        group = {"format": "pack-quantized", "targets": ["Linear"], "input_activations": None,
                 "output_activations": None,
                 "weights": {"dynamic": False, "group_size": group_size, "num_bits": 4,
                             "strategy": "group" if group_size else "channel", "symmetric": symmetric,
                             "type": "int"}}
    return {"config_groups": {"group_0": group}, "format": group["format"], "global_compression_ratio": None,
            "ignore": ["lm_head", *(f"model.layers.{i}.mlp.gate" for i in range(num_layers))],
            "kv_cache_scheme": None, "quant_method": "compressed-tensors", "quantization_status": "compressed",
            "sparsity_config": {}, "transform_config": {}}


def quantize_moe_checkpoint(folder: Path, fmt: str, group_size: int | None = 32, symmetric: bool = True) -> None:
    from safetensors import safe_open
    from safetensors.torch import save_file

    folder = Path(folder)
    index_path = folder / "model.safetensors.index.json"
    index = json.loads(index_path.read_text()) if index_path.is_file() else None
    for path in sorted(folder.glob("*.safetensors")):
        out: dict[str, torch.Tensor] = {}
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                t = f.get_tensor(name)
                if not PROJECTION.match(name):
                    out[name] = t
                    continue
                module = name.removesuffix(".weight")
                parts = _a8w8(t) if fmt == "a8w8" else _w4a16(t, group_size, symmetric)
                for k, v in parts.items():
                    out[f"{module}.{k}"] = v.contiguous()
                    if index is not None:
                        index["weight_map"][f"{module}.{k}"] = path.name
                if index is not None and fmt != "a8w8":
                    index["weight_map"].pop(name, None)
        tmp = path.with_name(path.name + ".tmp")   # beside, then renamed: the read tensors may map the old file
        save_file(out, str(tmp), metadata={"format": "pt"})
        tmp.replace(path)
    if index is not None:
        index_path.write_text(json.dumps(index, indent=2))
    cfg = json.loads((folder / "config.json").read_text())
    cfg["quantization_config"] = quantization_config(fmt, cfg["num_hidden_layers"], group_size, symmetric)
    (folder / "config.json").write_text(json.dumps(cfg, indent=2))
