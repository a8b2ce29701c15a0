"""RoPE of a Qwen3 config.json: `rope_theta` and `rope_scaling` / `rope_parameters`, validated.

Implemented rope types, each as transformers computes it (modeling_rope_utils, transformers 5.x):

- `default`: inv_freq_i = theta^(-2i/D).
- `linear`: inv_freq / factor.
- `yarn`: per-frequency blend of the interpolated (inv_freq / factor) and the original frequencies with a
  linear ramp between the correction dims of `beta_fast` (default 32) and `beta_slow` (default 1) over
  `original_max_position_embeddings`, floor/ceil of the range unless `truncate` is false; cos and sin are
  scaled by `attention_factor` (default 0.1 ln(factor) + 1, or the mscale / mscale_all_dim ratio when both
  are given; 1 when factor <= 1).

Refused with an error naming the field: `dynamic` (transformers recomputes its frequencies from the length
of the longest sequence in the running batch, so a token's rotation would depend on its batch and on when
its keys were cached; no static table reproduces it), the other types, `partial_rotary_factor` != 1 and any
key of the scaling object this module does not read.

Positions served (`max_positions`, the default and the ceiling of max_model_len) follow vLLM:
`original_max_position_embeddings * factor` for yarn, `max_position_embeddings * factor` for linear,
`max_position_embeddings` otherwise.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .errors import CheckpointError

SUPPORTED_ROPE_TYPES = ("default", "linear", "yarn")
# The keys each type reads; `type` is the legacy spelling of `rope_type`.
_COMMON = {"rope_type", "type", "rope_theta", "partial_rotary_factor"}
_KEYS = {
    "default": _COMMON,
    "linear": _COMMON | {"factor"},
    "yarn": _COMMON | {"factor", "original_max_position_embeddings", "attention_factor", "beta_fast", "beta_slow",
                       "mscale", "mscale_all_dim", "truncate"},
}


@dataclass(frozen=True)
class RopeConfig:
    rope_type: str = "default"
    theta: float = 1_000_000.0
    factor: float = 1.0
    original_max_position_embeddings: int | None = None
    attention_factor: float = 1.0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True
    max_positions: int = 40960

    def inv_freq(self, head_dim: int) -> torch.Tensor:
        """fp32 [head_dim / 2] inverse frequencies, computed with transformers' operations in its order."""
        base, dim = self.theta, head_dim
        if self.rope_type in ("default", "linear"):
            inv = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).to(dtype=torch.float) / dim))
            return inv / self.factor if self.rope_type == "linear" else inv
        # yarn: _compute_yarn_parameters
        pos_freqs = base ** (torch.arange(0, dim, 2).to(dtype=torch.float) / dim)
        extrapolation = 1.0 / pos_freqs
        interpolation = 1.0 / (self.factor * pos_freqs)
        orig = self.original_max_position_embeddings

        def correction_dim(rotations):
            return (dim * math.log(orig / (rotations * 2 * math.pi))) / (2 * math.log(base))

        low, high = correction_dim(self.beta_fast), correction_dim(self.beta_slow)
        if self.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        if low == high:
            high += 0.001      # transformers' guard against a zero-width ramp
        ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
        extrapolation_factor = 1 - ramp
        return interpolation * (1 - extrapolation_factor) + extrapolation * extrapolation_factor

    def cos_sin(self, head_dim: int, max_positions: int, device=None) -> torch.Tensor:
        """The kernels' rotary table [max_positions, head_dim] fp32: cos of the half frequencies, then sin, each
        times attention_factor (transformers scales cos and sin, not the scores)."""
        inv = self.inv_freq(head_dim).to(device)
        t = torch.arange(max_positions, dtype=torch.int64, device=device).float()
        freqs = torch.outer(t, inv)
        cos, sin = freqs.cos(), freqs.sin()
        if self.attention_factor != 1.0:
            cos, sin = cos * self.attention_factor, sin * self.attention_factor
        return torch.cat([cos, sin], dim=-1)


def _number(obj: dict, key: str, field: str, positive: bool = True) -> float:
    value = obj[key]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (positive and value <= 0):
        raise CheckpointError(f"config.json: {field}.{key} must be a positive number, got {value!r}")
    return float(value)


def parse_rope(cfg: dict) -> RopeConfig:
    """The RoPE of a config.json dict (old `rope_scaling` + `rope_theta`, or transformers 5 `rope_parameters`)."""
    params = cfg.get("rope_parameters")
    scaling = cfg.get("rope_scaling")
    for name, value in (("rope_parameters", params), ("rope_scaling", scaling)):
        if value is not None and not isinstance(value, dict):
            raise CheckpointError(f"config.json: {name} must be an object or null, got {value!r}")
    if scaling:
        field, obj = "rope_scaling", dict(scaling)
    else:
        field, obj = "rope_parameters", dict(params or {})
    theta = cfg.get("rope_theta", obj.get("rope_theta", (params or {}).get("rope_theta", 1_000_000.0)))
    if isinstance(theta, bool) or not isinstance(theta, (int, float)) or theta <= 0:
        raise CheckpointError(f"config.json: rope_theta must be a positive number, got {theta!r}")
    max_pos = cfg.get("max_position_embeddings", 40960)
    if isinstance(max_pos, bool) or not isinstance(max_pos, int) or max_pos <= 0:
        raise CheckpointError(f"config.json: max_position_embeddings must be a positive integer, got {max_pos!r}")
    rope_type = obj.get("rope_type", obj.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        why = (" (transformers derives its frequencies from the longest sequence in the batch, which no "
               "batch-invariant table reproduces)") if rope_type == "dynamic" else ""
        raise CheckpointError(f"config.json: {field}.rope_type {rope_type!r} is not implemented{why} "
                              f"(supported: {', '.join(SUPPORTED_ROPE_TYPES)})")
    unknown = sorted(set(obj) - _KEYS[rope_type])
    if unknown:
        raise CheckpointError(f"config.json: {field}.{unknown[0]} is not supported for rope_type {rope_type!r}")
    if obj.get("partial_rotary_factor", 1.0) != 1.0 or cfg.get("partial_rotary_factor", 1.0) != 1.0:
        raise CheckpointError("config.json: partial_rotary_factor other than 1.0 is not supported")
    if rope_type == "default":
        return RopeConfig(theta=float(theta), max_positions=max_pos)
    if rope_type == "linear":
        if obj.get("factor") is None:
            raise CheckpointError(f"config.json: {field}.factor is required for rope_type 'linear'")
        factor = _number(obj, "factor", field)
        return RopeConfig("linear", float(theta), factor, max_positions=int(max_pos * factor))
    # yarn. A top-level original_max_position_embeddings wins, as in transformers (standardize_rope_params).
    orig = cfg.get("original_max_position_embeddings", obj.get("original_max_position_embeddings", max_pos))
    if isinstance(orig, bool) or not isinstance(orig, int) or orig <= 0:
        raise CheckpointError(
            f"config.json: {field}.original_max_position_embeddings must be a positive integer, got {orig!r}")
    if obj.get("factor") is None:       # transformers' validation requires it too
        raise CheckpointError(f"config.json: {field}.factor is required for rope_type 'yarn'")
    factor = _number(obj, "factor", field)
    for key in ("attention_factor", "mscale", "mscale_all_dim", "beta_fast", "beta_slow"):
        if obj.get(key) is not None:
            _number(obj, key, field)
    if not isinstance(obj.get("truncate", True), bool):
        raise CheckpointError(f"config.json: {field}.truncate must be true or false, got {obj['truncate']!r}")

    def mscale(scale, m=1.0):
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = obj.get("attention_factor")
    if attention_factor is None:
        m, m_all = obj.get("mscale"), obj.get("mscale_all_dim")
        attention_factor = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)
    return RopeConfig("yarn", float(theta), float(factor), orig, float(attention_factor),
                      # transformers: `get("beta_fast") or 32` (a 0 means the default too)
                      float(obj.get("beta_fast") or 32), float(obj.get("beta_slow") or 1),
                      bool(obj.get("truncate", True)), max_positions=int(orig * factor))
