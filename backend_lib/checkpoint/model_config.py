"""The Qwen3 architecture read from config.json (and generation_config.json), validated: the dense model
(model_type qwen3) and the mixture of experts (model_type qwen3_moe, see MoeConfig)."""
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
class MoeConfig:
    """Qwen3-MoE's sparse MLP (transformers' Qwen3MoeSparseMoeBlock): `num_experts` experts of width
    `moe_intermediate_size`, `num_experts_per_tok` of them per token, their router weights renormalized to sum 1
    when `norm_topk_prob`. A layer is sparse when it is not in mlp_only_layers and (layer + 1) is a multiple of
    decoder_sparse_step; the others keep the dense MLP of intermediate_size."""
    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    norm_topk_prob: bool
    sparse_layers: tuple[int, ...]


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
    moe: MoeConfig | None = None      # None: the dense model

    def is_moe_layer(self, layer: int) -> bool:
        return self.moe is not None and layer in self.moe.sparse_layers

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
        is_moe = model_type == "qwen3_moe" or (model_type is None and "Qwen3MoeForCausalLM" in archs)
        if not is_moe and model_type != "qwen3" and "Qwen3ForCausalLM" not in archs:
            raise CheckpointError(
                f"config.json: model_type {model_type!r} / architectures {archs} is not a Qwen3 model "
                "(expected model_type 'qwen3' or 'qwen3_moe')")
        if is_moe and "num_experts" not in cfg and "num_local_experts" in cfg:
            # transformers 5's save_pretrained writes num_experts under this name
            cfg = {**cfg, "num_experts": cfg["num_local_experts"]}

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
        layers = need("num_hidden_layers")
        moe = _parse_moe(cfg, layers, need) if is_moe else None
        # a mixture of experts whose every layer is sparse needs no dense width
        dense_inter = need("intermediate_size") if moe is None or len(moe.sparse_layers) < layers \
            else int(cfg.get("intermediate_size") or 0)

        eos = _int_list(gen.get("eos_token_id")) or _int_list(cfg.get("eos_token_id"))
        defaults = {k: gen[k] for k in ("temperature", "top_p", "top_k", "repetition_penalty") if k in gen}
        if gen.get("do_sample") is False:
            defaults["temperature"] = 0.0
        return cls(
            vocab_size=need("vocab_size"),
            hidden_size=hidden,
            intermediate_size=dense_inter,
            num_layers=layers,
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
            moe=moe,
        )


def _parse_moe(cfg: dict, num_layers: int, need) -> MoeConfig:
    """The sparse MLP's fields of a qwen3_moe config.json."""
    experts = need("num_experts")
    per_tok = need("num_experts_per_tok")
    if per_tok > experts:
        raise CheckpointError(f"config.json: field 'num_experts_per_tok' ({per_tok}) exceeds num_experts ({experts})")
    width = need("moe_intermediate_size")
    step = cfg.get("decoder_sparse_step", 1)
    if isinstance(step, bool) or not isinstance(step, int) or step <= 0:
        raise CheckpointError(f"config.json: field 'decoder_sparse_step' must be a positive integer, got {step!r}")
    only = cfg.get("mlp_only_layers") or []
    if not isinstance(only, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in only):
        raise CheckpointError(f"config.json: field 'mlp_only_layers' must be a list of layer indices, got {only!r}")
    bad = [i for i in only if not 0 <= i < num_layers]
    if bad:
        raise CheckpointError(f"config.json: field 'mlp_only_layers' names layers {bad} outside 0..{num_layers - 1}")
    norm = cfg.get("norm_topk_prob", False)     # the config class's default; the released checkpoints set true
    if not isinstance(norm, bool):
        raise CheckpointError(f"config.json: field 'norm_topk_prob' must be true or false, got {norm!r}")
    if cfg.get("shared_expert_intermediate_size"):
        raise CheckpointError("config.json: field 'shared_expert_intermediate_size' is set: shared experts are not "
                              "part of Qwen3-MoE (a Qwen2-MoE checkpoint?)")
    sparse = tuple(i for i in range(num_layers) if i not in only and (i + 1) % step == 0)
    return MoeConfig(experts, per_tok, width, norm, sparse)
