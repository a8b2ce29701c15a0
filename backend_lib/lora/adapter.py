"""PEFT LoRA adapters: `adapter_config.json` + `adapter_model.safetensors`, read and validated against the base.

An adapter is accepted exactly as PEFT writes it for a Qwen3 causal LM: peft_type LORA, any subset of the
seven projections (q/k/v/o_proj, gate/up/down_proj) of any layers, one rank `r` up to `max_lora_rank`,
scaling lora_alpha / r (lora_alpha / sqrt(r) with use_rslora). What PEFT can express and this engine does not
compute (DoRA, LoRA biases, modules_to_save, per-module rank or alpha patterns, fan_in_fan_out, ...) is
refused with an error naming the file and field; so is an unknown config field with a value that is set, a
tensor the engine does not use, and a shape that does not match the base. Nothing is ignored silently.
On a Qwen3-MoE base the sparse layers' MLP is routed experts: adapters of the attention projections (and of
the dense MLPs of mlp_only_layers) apply; an adapter of an expert or of a sparse layer's MLP is refused naming
the tensor.

At load each layer's projections are laid out for the base's fused linears (qkv, gate_up): the A matrices of
the projections that read the same input stacked, the B matrices placed block-diagonally, both fp32 (bf16
adapters convert exactly). A projection the adapter lacks gets zero rows of B, which add exact zeros.
"""
from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..checkpoint.errors import CheckpointError

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# fused linear of the base -> the projections it concatenates along its output, in order
FUSED = {"qkv": ("q_proj", "k_proj", "v_proj"), "o": ("o_proj",), "gate_up": ("gate_proj", "up_proj"),
         "down": ("down_proj",)}
_PARENT = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
           "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}
_EXPERT = re.compile(r"^(?:base_model\.model\.)?model\.layers\.(\d+)\.mlp\.(experts|gate)\b")
_TENSOR = re.compile(r"^(?:base_model\.model\.)?model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.\w+)?"
                     r"\.weight$")

# adapter_config.json fields that only describe training or provenance: read by nobody at inference
INFORMATIONAL = {"base_model_name_or_path", "revision", "task_type", "inference_mode", "lora_dropout",
                 "init_lora_weights", "peft_version", "auto_mapping", "layers_pattern", "exclude_modules",
                 "megatron_core", "qalora_group_size"}   # the last two only matter with megatron_config / use_qalora
# fields whose only supported value is the neutral one (None / False / empty means "not used")
NEUTRAL = {"use_dora": "DoRA", "modules_to_save": "modules_to_save", "rank_pattern": "per-module ranks",
           "alpha_pattern": "per-module alphas", "fan_in_fan_out": "fan_in_fan_out", "lora_bias": "LoRA biases",
           "layer_replication": "layer replication", "target_parameters": "target_parameters",
           "trainable_token_indices": "trainable tokens", "use_qalora": "QA-LoRA",
           "alora_invocation_tokens": "aLoRA", "megatron_config": "Megatron", "loftq_config": None,
           "eva_config": None, "corda_config": None, "runtime_config": None}


class LoraError(CheckpointError):
    """An adapter that cannot be used; the message names the adapter, the file and the field."""


@dataclass(frozen=True)
class BaseShape:
    """What an adapter is checked against: the base's layers and projection sizes."""
    num_layers: int
    in_features: dict[str, int]
    out_features: dict[str, int]
    sparse_layers: frozenset[int] = frozenset()   # Qwen3-MoE: layers whose MLP is routed experts

    @classmethod
    def of(cls, mc) -> "BaseShape":
        hid, inter, q, kv = mc.hidden_size, mc.intermediate_size, mc.num_heads * mc.head_dim, mc.num_kv_heads * mc.head_dim
        ins = {"q_proj": hid, "k_proj": hid, "v_proj": hid, "o_proj": q, "gate_proj": hid, "up_proj": hid,
               "down_proj": inter}
        outs = {"q_proj": q, "k_proj": kv, "v_proj": kv, "o_proj": hid, "gate_proj": inter, "up_proj": inter,
                "down_proj": hid}
        sparse = frozenset(mc.moe.sparse_layers) if getattr(mc, "moe", None) is not None else frozenset()
        return cls(mc.num_layers, ins, outs, sparse)


@dataclass
class FusedDelta:
    """The update of one fused linear: delta(x) = ((x A^T) B^T) * scaling; A [R, in], B [out, R] fp32."""
    a: torch.Tensor | None            # until prepare()
    b: torch.Tensor | None
    a_prepared: object = None
    b_prepared: object = None


@dataclass
class LoraAdapter:
    name: str
    path: str
    rank: int
    scaling: float
    modules: tuple[str, ...]                  # the projections it adapts (in any layer)
    digest: str                               # content hash of config + weights: keys its KV pages
    deltas: dict[tuple[int, str], FusedDelta] = field(default_factory=dict)   # (layer, fused name) -> delta

    def delta(self, layer: int, fused: str) -> FusedDelta | None:
        return self.deltas.get((layer, fused))

    def prepare(self, kernels, device) -> "LoraAdapter":
        """A and B in the kernel set's form on the engine's device (batch invariant like the base)."""
        for d in self.deltas.values():
            d.a_prepared = kernels.float_prepare(d.a.to(device))
            d.b_prepared = kernels.float_prepare(d.b.to(device))
            d.a = d.b = None          # only the kernel set's form is kept
        return self


def _set(value) -> bool:
    return value not in (None, False, "", [], {}, "none")


def parse_config(cfg: dict, where: str, max_rank: int) -> tuple[int, float, set[str] | None, set[int] | None]:
    """(rank, scaling, target projections and layers, each None for 'whatever the tensors hold'), or LoraError."""
    if cfg.get("peft_type", "LORA") != "LORA":
        raise LoraError(f"{where}: peft_type {cfg.get('peft_type')!r} is not supported (only 'LORA')")
    known = INFORMATIONAL | set(NEUTRAL) | {"peft_type", "r", "lora_alpha", "use_rslora", "target_modules", "bias",
                                            "layers_to_transform"}
    for key, value in cfg.items():
        if key not in known and _set(value):
            raise LoraError(f"{where}: field {key!r} ({value!r}) is not supported")
    for key, what in NEUTRAL.items():
        if _set(cfg.get(key)):
            raise LoraError(f"{where}: {key} ({cfg[key]!r}) is not supported{f' ({what})' if what else ''}")
    if cfg.get("bias", "none") != "none":
        raise LoraError(f"{where}: bias {cfg['bias']!r} is not supported (only 'none': adapters without biases)")
    r = cfg.get("r")
    if isinstance(r, bool) or not isinstance(r, int) or r <= 0:
        raise LoraError(f"{where}: r must be a positive integer, got {r!r}")
    if r > max_rank:
        raise LoraError(f"{where}: r {r} exceeds max_lora_rank {max_rank}")
    alpha = cfg.get("lora_alpha", 8)
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not math.isfinite(alpha):
        raise LoraError(f"{where}: lora_alpha must be a finite number, got {alpha!r}")
    rslora = cfg.get("use_rslora", False)
    if not isinstance(rslora, bool):
        raise LoraError(f"{where}: use_rslora must be a boolean, got {rslora!r}")
    scaling = alpha / math.sqrt(r) if rslora else alpha / r
    layers = cfg.get("layers_to_transform")
    if isinstance(layers, int) and not isinstance(layers, bool):
        layers = [layers]
    if layers is not None and (not isinstance(layers, list) or not all(
            isinstance(i, int) and not isinstance(i, bool) for i in layers)):
        raise LoraError(f"{where}: layers_to_transform must be a list of layer indices, got {layers!r}")
    targets = cfg.get("target_modules")
    if targets is None or isinstance(targets, str):
        # a regex (or "all-linear"): the tensors say which modules are adapted; each is checked below
        return r, scaling, None, None if layers is None else set(layers)
    if not isinstance(targets, list) or not all(isinstance(t, str) for t in targets):
        raise LoraError(f"{where}: target_modules must be a list of module names or a string, got {targets!r}")
    names = {t.rsplit(".", 1)[-1] for t in targets}
    for t in sorted(names):
        if t not in PROJECTIONS:
            raise LoraError(f"{where}: target_modules names {t!r}, which the Qwen3 base does not have as a LoRA "
                            f"target (it has {', '.join(PROJECTIONS)})")
    return r, scaling, names, None if layers is None else set(layers)


def _read_config(folder: Path) -> tuple[dict, bytes]:
    path = folder / CONFIG_FILE
    if not path.is_file():
        raise LoraError(f"{path}: not found (a PEFT adapter folder holds {CONFIG_FILE} and {WEIGHTS_FILE})")
    from ..contract.json_input import loads
    from ..contract.errors import RequestError

    raw = path.read_bytes()
    try:
        cfg = loads(raw, CONFIG_FILE)
    except RequestError as exc:
        raise LoraError(f"{path}: {exc}") from None
    if not isinstance(cfg, dict):
        raise LoraError(f"{path}: must hold a JSON object")
    return cfg, raw


def load_adapter(name: str, folder: str | Path, base: BaseShape, max_rank: int) -> LoraAdapter:
    """The adapter in `folder`, validated against `base` (LoraError naming file and field otherwise)."""
    from safetensors import safe_open

    folder = Path(folder)
    if not folder.is_dir():
        raise LoraError(f"adapter {name!r}: {folder} is not a folder")
    cfg, raw_cfg = _read_config(folder)
    where = f"adapter {name!r}: {folder / CONFIG_FILE}"
    rank, scaling, targets, layers = parse_config(cfg, where, max_rank)
    wpath = folder / WEIGHTS_FILE
    if not wpath.is_file():
        bins = [p.name for p in folder.glob("*.bin")]
        hint = f" (found {bins}; pickle weights are never loaded, save with safe_serialization)" if bins else ""
        raise LoraError(f"adapter {name!r}: {wpath} not found{hint}")
    wwhere = f"adapter {name!r}: {wpath}"
    digest = hashlib.sha256(raw_cfg)
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    try:
        f = safe_open(str(wpath), framework="pt", device="cpu")
        keys = sorted(f.keys())
    except Exception as exc:
        raise LoraError(f"{wwhere}: not a readable safetensors file ({exc})") from None
    for key in keys:
        if _EXPERT.match(key):
            raise LoraError(f"{wwhere}: tensor {key!r} adapts a mixture-of-experts module (an expert or the "
                            "router): expert adapters are not supported (LoRA on a MoE base applies to the "
                            "attention projections and dense MLPs)")
        m = _TENSOR.match(key)
        if m is None:
            raise LoraError(f"{wwhere}: tensor {key!r} is not a LoRA A/B matrix of a Qwen3 projection "
                            "(embeddings, lm_head, DoRA magnitudes and biases are not supported)")
        layer, parent, proj, ab = int(m[1]), m[2], m[3], m[4]
        if proj not in PROJECTIONS or _PARENT[proj] != parent:
            raise LoraError(f"{wwhere}: tensor {key!r} adapts {parent}.{proj}, which the Qwen3 base does not have "
                            f"(LoRA targets: {', '.join(PROJECTIONS)})")
        if layer >= base.num_layers:
            raise LoraError(f"{wwhere}: tensor {key!r} adapts layer {layer}; the base has {base.num_layers} layers")
        if parent == "mlp" and layer in base.sparse_layers:
            raise LoraError(f"{wwhere}: tensor {key!r} adapts mlp.{proj} of layer {layer}, a mixture-of-experts "
                            "layer of the base (no dense MLP there; expert adapters are not supported)")
        if targets is not None and proj not in targets:
            raise LoraError(f"{wwhere}: tensor {key!r} adapts {proj}, which target_modules does not list")
        if layers is not None and layer not in layers:
            raise LoraError(f"{wwhere}: tensor {key!r} adapts layer {layer}, which layers_to_transform does not list")
        try:
            t = f.get_tensor(key)
        except Exception as exc:
            raise LoraError(f"{wwhere}: tensor {key!r} could not be read ({exc})") from None
        if t.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise LoraError(f"{wwhere}: tensor {key!r} has dtype {t.dtype}, expected a float dtype")
        want = (rank, base.in_features[proj]) if ab == "A" else (base.out_features[proj], rank)
        if tuple(t.shape) != want:
            raise LoraError(f"{wwhere}: tensor {key!r} has shape {list(t.shape)}, expected {list(want)} "
                            f"(r {rank}, {proj} of the base)")
        t = t.float()
        if not bool(torch.isfinite(t).all()):
            raise LoraError(f"{wwhere}: tensor {key!r} holds NaN or infinite values")
        digest.update(key.encode() + b"\0" + t.numpy().tobytes())
        pairs.setdefault((layer, proj), {})[ab] = t
    if not pairs:
        raise LoraError(f"{wwhere}: holds no LoRA tensors")
    for (layer, proj), ab in sorted(pairs.items()):
        for missing in {"A", "B"} - set(ab):
            raise LoraError(f"{wwhere}: layer {layer} {proj} has lora_{sorted(ab)[0]} but no lora_{missing}")
    adapter = LoraAdapter(name, str(folder), rank, scaling, tuple(p for p in PROJECTIONS
                                                                  if any(q == p for _, q in pairs)),
                          digest.hexdigest())
    for layer in range(base.num_layers):
        for fused, projs in FUSED.items():
            present = [p for p in projs if (layer, p) in pairs]
            if not present:
                continue
            a = torch.cat([pairs[(layer, p)]["A"] for p in present], 0)
            b = torch.zeros(sum(base.out_features[p] for p in projs), rank * len(present))
            row = 0
            for p in projs:
                n = base.out_features[p]
                if p in present:
                    j = present.index(p)
                    b[row:row + n, j * rank:(j + 1) * rank] = pairs[(layer, p)]["B"]
                row += n
            adapter.deltas[(layer, fused)] = FusedDelta(a.contiguous(), b.contiguous())
    return adapter
