"""The Qwen3 architecture read from config.json (and generation_config.json), validated."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from .errors import CheckpointError
from .rope import RopeConfig, parse_rope

def read_json(path: Path, what: str) -> dict:
    if not path.is_file():
        raise CheckpointError(f"{what}: {path} not found")
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{what}: {path} is not valid JSON ({exc})") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{what}: {path} must hold a JSON object")
    return data


def _int_list(value) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value]


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: RopeConfig
    max_position_embeddings: int      # positions served: the rope scaling's (see rope.py), else config.json's
    tie_word_embeddings: bool
    torch_dtype: str
    quantization_config: dict | None
    eos_token_ids: tuple[int, ...]
    generation_defaults: dict

    @classmethod
    def from_dir(cls, folder: str | Path) -> "ModelConfig":
        folder = Path(folder)
        if not folder.is_dir():
            raise CheckpointError(f"checkpoint folder {folder} does not exist")
        cfg = read_json(folder / "config.json", "config.json")
        gen_path = folder / "generation_config.json"
        gen = read_json(gen_path, "generation_config.json") if gen_path.exists() else {}
        return cls.from_dicts(cfg, gen)

    @classmethod
    def from_dicts(cls, cfg: dict, gen: dict | None = None) -> "ModelConfig":
        gen = gen or {}
        model_type = cfg.get("model_type")
        archs = cfg.get("architectures") or []
        if model_type != "qwen3" and "Qwen3ForCausalLM" not in archs:
            raise CheckpointError(
                f"config.json: model_type {model_type!r} / architectures {archs} is not a dense Qwen3 model "
                "(expected model_type 'qwen3')")

        def need(key, typ=int):
            if key not in cfg:
                raise CheckpointError(f"config.json: missing field {key!r}")
            try:
                value = typ(cfg[key])
            except (TypeError, ValueError):
                raise CheckpointError(f"config.json: field {key!r} has invalid value {cfg[key]!r}") from None
            if typ is int and value <= 0:
                raise CheckpointError(f"config.json: field {key!r} must be positive, got {value}")
            return value

        hidden = need("hidden_size")
        heads = need("num_attention_heads")
        kv_heads = int(cfg.get("num_key_value_heads") or heads)
        head_dim = int(cfg.get("head_dim") or hidden // heads)
        if heads % kv_heads:
            raise CheckpointError(
                f"config.json: num_attention_heads {heads} is not a multiple of num_key_value_heads {kv_heads}")
        if head_dim % 2:
            raise CheckpointError(f"config.json: head_dim must be even for rotary embeddings, got {head_dim}")
        act = cfg.get("hidden_act", "silu")
        if act != "silu":
            raise CheckpointError(f"config.json: hidden_act {act!r} is not supported (Qwen3 uses 'silu')")
        if cfg.get("attention_bias"):
            raise CheckpointError("config.json: attention_bias true is not supported (Qwen3 has no attention bias)")
        if cfg.get("use_sliding_window"):
            raise CheckpointError("config.json: use_sliding_window true is not supported")

        rope = parse_rope(cfg)

        eos = _int_list(gen.get("eos_token_id")) or _int_list(cfg.get("eos_token_id"))
        defaults = {k: gen[k] for k in ("temperature", "top_p", "top_k", "repetition_penalty") if k in gen}
        if gen.get("do_sample") is False:
            defaults["temperature"] = 0.0
        return cls(
            vocab_size=need("vocab_size"),
            hidden_size=hidden,
            intermediate_size=need("intermediate_size"),
            num_layers=need("num_hidden_layers"),
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope=rope,
            max_position_embeddings=rope.max_positions,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            torch_dtype=str(cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16"),
            quantization_config=cfg.get("quantization_config"),
            eos_token_ids=tuple(eos),
            generation_defaults=defaults,
        )
