"""Writes a Qwen3-MoE demo checkpoint tensor by tensor into sharded safetensors, never holding the model: the
full 30B-A3B shape (61 GB in bf16, ~16 GB in W4A16) on a machine that could not hold it (`make_demo_checkpoint
--size 30b-a3b --stream`).

The tensors are the published layouts moe_writer.py writes (the same names, shapes and dtypes, per expert,
routers / embeddings / norms / lm_head in bf16 and in `ignore`), but random in their stored form instead of
quantized from random bf16 weights (quantizing 30B weights takes longer than writing them): bf16 normal
(std: the config's initializer_range, as transformers initializes), a8w8 uniform int8 codes with a per-row scale of the same std,
w4a16 uniform int4 codes (random int32 words) with per-group scales of the same std (asymmetric: random zero
points); norms are ones. Each tensor draws from its own generator (seed, tensor index), so a shard's content does
not depend on what was written before it. Shards of at most `shard_bytes`, model.safetensors.index.json as
save_pretrained writes it.
"""
from __future__ import annotations

import json
import logging
from pathlib import Path

import torch

from .moe_writer import quantization_config

log = logging.getLogger(__name__)

UNIFORM4_STD = 4.61    # std of (q - 8) for q uniform in 0..15
UNIFORM8_STD = 73.6    # std of q uniform in -127..127


def _experts(cfg: dict) -> int:
    return cfg["num_experts"] if "num_experts" in cfg else cfg["num_local_experts"]   # transformers 5's name


def tensor_specs(cfg: dict):
    """(name, shape, kind) of every tensor of a Qwen3-MoE checkpoint, in save order; kind: 'norm', 'float' (kept
    in bf16: embeddings, routers, lm_head) or 'proj' (quantized in a8w8 / w4a16)."""
    h, layers = cfg["hidden_size"], cfg["num_hidden_layers"]
    d = cfg.get("head_dim") or h // cfg["num_attention_heads"]
    nh, kvh, inter, e = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["moe_intermediate_size"], _experts(cfg)
    sparse = set(i for i in range(layers) if i not in cfg.get("mlp_only_layers", [])
                 and (i + 1) % cfg.get("decoder_sparse_step", 1) == 0)
    yield "model.embed_tokens.weight", (cfg["vocab_size"], h), "float"
    for i in range(layers):
        p = f"model.layers.{i}"
        yield f"{p}.input_layernorm.weight", (h,), "norm"
        yield f"{p}.post_attention_layernorm.weight", (h,), "norm"
        yield f"{p}.self_attn.q_proj.weight", (nh * d, h), "proj"
        yield f"{p}.self_attn.k_proj.weight", (kvh * d, h), "proj"
        yield f"{p}.self_attn.v_proj.weight", (kvh * d, h), "proj"
        yield f"{p}.self_attn.o_proj.weight", (h, nh * d), "proj"
        yield f"{p}.self_attn.q_norm.weight", (d,), "norm"
        yield f"{p}.self_attn.k_norm.weight", (d,), "norm"
        if i in sparse:
            yield f"{p}.mlp.gate.weight", (e, h), "float"
            for x in range(e):
                yield f"{p}.mlp.experts.{x}.gate_proj.weight", (inter, h), "proj"
                yield f"{p}.mlp.experts.{x}.up_proj.weight", (inter, h), "proj"
                yield f"{p}.mlp.experts.{x}.down_proj.weight", (h, inter), "proj"
        else:
            w = cfg["intermediate_size"]
            yield f"{p}.mlp.gate_proj.weight", (w, h), "proj"
            yield f"{p}.mlp.up_proj.weight", (w, h), "proj"
            yield f"{p}.mlp.down_proj.weight", (h, w), "proj"
    yield "model.norm.weight", (h,), "norm"
    if not cfg.get("tie_word_embeddings", False):
        yield "lm_head.weight", (cfg["vocab_size"], h), "float"


def _random_tensors(name: str, shape, kind: str, fmt: str, group_size: int | None, symmetric: bool,
                    g: torch.Generator, std: float) -> dict[str, torch.Tensor]:
    if kind == "norm":
        return {name: torch.ones(shape, dtype=torch.bfloat16)}
    if kind == "float" or fmt == "bf16":
        return {name: (torch.randn(shape, generator=g) * std).to(torch.bfloat16)}
    module = name.removesuffix(".weight")
    n, k = shape
    if fmt == "a8w8":
        q = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
        scale = (torch.rand(n, 1, generator=g) * 0.5 + 0.75) * (std / UNIFORM8_STD)
        return {f"{module}.weight": q, f"{module}.weight_scale": scale.to(torch.bfloat16)}
    gs = group_size or k
    words = torch.randint(-2 ** 31, 2 ** 31, (n, k // 8), generator=g, dtype=torch.int64).to(torch.int32)
    scale = (torch.rand(n, k // gs, generator=g) * 0.5 + 0.75) * (std / UNIFORM4_STD)
    out = {f"{module}.weight_packed": words, f"{module}.weight_scale": scale.to(torch.bfloat16),
           f"{module}.weight_shape": torch.tensor([n, k], dtype=torch.int64)}
    if not symmetric:
        out[f"{module}.weight_zero_point"] = torch.randint(-2 ** 31, 2 ** 31, (n // 8, k // gs), generator=g,
                                                           dtype=torch.int64).to(torch.int32)
    return out


def write_streamed(out: Path, config, fmt: str, group_size: int | None = 128, symmetric: bool = True, seed: int = 0,
                   shard_bytes: int = 2 * 2 ** 30) -> None:
    """config: a transformers Qwen3MoeConfig. Writes config.json, the shards and their index into `out`."""
    from safetensors.torch import save_file

    if fmt not in ("bf16", "a8w8", "w4a16"):
        raise ValueError(f"--stream: --format {fmt} is not offered (bf16, a8w8 or w4a16)")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    cfg = config.to_dict()
    specs = list(tensor_specs(cfg))
    shards: list[list[str]] = []
    weight_map: dict[str, str] = {}
    total = 0
    pending: dict[str, torch.Tensor] = {}
    pending_bytes = 0
    tmp_names: list[Path] = []

    def flush():
        nonlocal pending, pending_bytes
        if not pending:
            return
        path = out / f"shard-{len(tmp_names):05d}.tmp"
        save_file(pending, str(path), metadata={"format": "pt"})
        tmp_names.append(path)
        shards.append(list(pending))
        log.info("wrote %s (%.2f GB, %d tensors)", path.name, pending_bytes / 1e9, len(pending))
        pending, pending_bytes = {}, 0

    for idx, (name, shape, kind) in enumerate(specs):
        g = torch.Generator().manual_seed(seed * 1_000_003 + idx)
        for tname, t in _random_tensors(name, shape, kind, fmt, group_size, symmetric, g,
                                                cfg.get("initializer_range", 0.02)).items():
            nbytes = t.numel() * t.element_size()
            if pending and pending_bytes + nbytes > shard_bytes:
                flush()
            pending[tname] = t.contiguous()
            pending_bytes += nbytes
            total += nbytes
    flush()
    n = len(tmp_names)
    for i, (path, names) in enumerate(zip(tmp_names, shards)):
        final = out / f"model-{i + 1:05d}-of-{n:05d}.safetensors"
        path.rename(final)
        weight_map.update({t: final.name for t in names})
    (out / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    cfg_json = json.loads(config.to_json_string())
    cfg_json["architectures"] = ["Qwen3MoeForCausalLM"]
    cfg_json["dtype"] = "bfloat16"
    if fmt != "bf16":
        cfg_json["quantization_config"] = quantization_config(fmt, cfg["num_hidden_layers"], group_size, symmetric)
    (out / "config.json").write_text(json.dumps(cfg_json, indent=2))
