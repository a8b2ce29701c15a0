"""compressed-tensors `quantization_config`: accept exactly the W8A8 int scheme, reject the rest.

Accepted (see shared spec a8w8.md): quant_method compressed-tensors, format int-quantized (or
naive-quantized, the same layout), every config group with 8-bit symmetric int weights per
channel (static) and 8-bit symmetric int input activations per token (dynamic). Anything else
is rejected with an error that names the field and the value.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field

from .errors import CheckpointError

ACCEPTED_FORMATS = ("int-quantized", "naive-quantized")
WEIGHTS = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel", "dynamic": False}
ACTIVATIONS = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "token", "dynamic": True}


@dataclass(frozen=True)
class QuantScheme:
    """Which Linear modules carry A8W8 weights (int8 `weight` + `weight_scale`)."""

    targets: tuple[str, ...]
    ignore: tuple[str, ...] = field(default_factory=tuple)
    kind: str = "a8w8"

    def is_quantized(self, module_name: str) -> bool:
        """module_name: the HF name of a Linear, e.g. model.layers.0.self_attn.q_proj."""
        if any(_matches(pattern, module_name) for pattern in self.ignore):
            return False
        return any(t == "Linear" or _matches(t, module_name) for t in self.targets)


def _matches(pattern: str, name: str) -> bool:
    if pattern.startswith("re:"):
        return re.match(pattern[3:], name) is not None
    return name == pattern or name.endswith("." + pattern)


def _check_args(args, expected: dict, where: str) -> None:
    if not isinstance(args, dict):
        raise CheckpointError(f"quantization_config.{where}: must be an object, got {args!r}")
    for key, want in expected.items():
        got = args.get(key)
        if got != want:
            raise CheckpointError(
                f"quantization_config.{where}.{key}: {got!r} is not supported (A8W8 needs {want!r})")
    if args.get("group_size") not in (None, 0, -1):
        raise CheckpointError(f"quantization_config.{where}.group_size: {args['group_size']!r} is not supported")
    if args.get("block_structure") not in (None, []):
        raise CheckpointError(
            f"quantization_config.{where}.block_structure: {args['block_structure']!r} is not supported")


def parse_quantization_config(qc: dict | None) -> QuantScheme | None:
    """None for an unquantized checkpoint; a QuantScheme for a valid A8W8 one; else CheckpointError."""
    if qc is None:
        return None
    if not isinstance(qc, dict):
        raise CheckpointError(f"quantization_config: must be an object, got {qc!r}")
    method = qc.get("quant_method")
    if method != "compressed-tensors":
        raise CheckpointError(
            f"quantization_config.quant_method: {method!r} is not supported (only 'compressed-tensors' A8W8)")
    top_format = qc.get("format")
    if top_format is not None and top_format not in ACCEPTED_FORMATS:
        raise CheckpointError(f"quantization_config.format: {top_format!r} is not supported "
                              f"(accepted: {', '.join(ACCEPTED_FORMATS)})")
    sparsity = qc.get("sparsity_config") or {}
    if sparsity and sparsity.get("format", "dense") != "dense":
        raise CheckpointError(
            f"quantization_config.sparsity_config.format: {sparsity.get('format')!r} is not supported")
    if qc.get("kv_cache_scheme"):
        raise CheckpointError(
            f"quantization_config.kv_cache_scheme: {qc['kv_cache_scheme']!r} is not supported")
    transform = qc.get("transform_config") or {}
    if transform:
        raise CheckpointError("quantization_config.transform_config: transforms are not supported")
    groups = qc.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise CheckpointError("quantization_config.config_groups: missing or empty")
    targets: list[str] = []
    for name, group in groups.items():
        where = f"config_groups.{name}"
        if not isinstance(group, dict):
            raise CheckpointError(f"quantization_config.{where}: must be an object")
        fmt = group.get("format") or top_format
        if fmt not in ACCEPTED_FORMATS:
            raise CheckpointError(f"quantization_config.{where}.format: {fmt!r} is not supported "
                                  f"(accepted: {', '.join(ACCEPTED_FORMATS)})")
        _check_args(group.get("weights"), WEIGHTS, f"{where}.weights")
        _check_args(group.get("input_activations"), ACTIVATIONS, f"{where}.input_activations")
        if group.get("output_activations") is not None:
            raise CheckpointError(f"quantization_config.{where}.output_activations: "
                                  f"{group['output_activations']!r} is not supported")
        group_targets = group.get("targets")
        if not isinstance(group_targets, list) or not group_targets:
            raise CheckpointError(f"quantization_config.{where}.targets: missing or empty")
        targets.extend(str(t) for t in group_targets)
    ignore = qc.get("ignore") or []
    if not isinstance(ignore, list):
        raise CheckpointError(f"quantization_config.ignore: must be a list, got {ignore!r}")
    return QuantScheme(targets=tuple(targets), ignore=tuple(str(i) for i in ignore))
