"""`quantization_config`: accept exactly the schemes the kernels implement, reject the rest.

Accepted:
- A8W8 (see shared spec a8w8.md): quant_method compressed-tensors, format int-quantized (or
  naive-quantized, the same layout), every config group with 8-bit symmetric int weights per
  channel (static) and 8-bit symmetric int input activations per token (dynamic).
- W4A16 (int4 weight-only, see int4.py for the layouts): compressed-tensors format pack-quantized with
  4-bit int weights per group or per channel, symmetric or not, no activation quantization; quant_method
  gptq (bits 4); quant_method awq (bits 4, version gemm).
Anything else is rejected with an error that names the field and the value.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field

from .errors import CheckpointError
from .int4 import Int4Args, parse_awq, parse_gptq

ACCEPTED_FORMATS = ("int-quantized", "naive-quantized", "pack-quantized")
INT4_WEIGHTS = {"num_bits": 4, "type": "int", "dynamic": False}
WEIGHTS = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel", "dynamic": False}
ACTIVATIONS = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "token", "dynamic": True}


@dataclass(frozen=True)
class QuantScheme:
    """Which Linear modules carry quantized weights, and how: kind "a8w8" (int8 `weight` + `weight_scale`) or
    "w4a16" (int4 weights in one of the layouts of int4.py, described by `int4`)."""

    targets: tuple[str, ...]
    ignore: tuple[str, ...] = field(default_factory=tuple)
    kind: str = "a8w8"
    int4: Int4Args | None = None

    def describe(self) -> str:
        return self.int4.describe() if self.int4 else "A8W8"

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
    if method in ("gptq", "awq"):
        args, not_converted = (parse_gptq if method == "gptq" else parse_awq)(qc)
        return QuantScheme(targets=("Linear",), ignore=("lm_head", *not_converted), kind="w4a16", int4=args)
    if method != "compressed-tensors":
        raise CheckpointError(f"quantization_config.quant_method: {method!r} is not supported "
                              "(accepted: compressed-tensors, gptq, awq)")
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
    schemes: list = []
    for name, group in groups.items():
        where = f"config_groups.{name}"
        if not isinstance(group, dict):
            raise CheckpointError(f"quantization_config.{where}: must be an object")
        fmt = group.get("format") or top_format
        if fmt not in ACCEPTED_FORMATS:
            raise CheckpointError(f"quantization_config.{where}.format: {fmt!r} is not supported "
                                  f"(accepted: {', '.join(ACCEPTED_FORMATS)})")
        if fmt == "pack-quantized":
            group_args = _int4_args(group, where)
        else:
            _check_args(group.get("weights"), WEIGHTS, f"{where}.weights")
            _check_args(group.get("input_activations"), ACTIVATIONS, f"{where}.input_activations")
            group_args = "a8w8"
        if schemes and group_args != schemes[0]:
            raise CheckpointError(f"quantization_config.{where}: its scheme differs from another group's "
                                  "(one scheme per checkpoint is supported)")
        schemes.append(group_args)
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
    if schemes[0] == "a8w8":
        return QuantScheme(targets=tuple(targets), ignore=tuple(str(i) for i in ignore))
    return QuantScheme(targets=tuple(targets), ignore=tuple(str(i) for i in ignore), kind="w4a16", int4=schemes[0])


def _int4_args(group: dict, where: str) -> Int4Args:
    """A pack-quantized group: 4-bit int weights per group or channel, no activation quantization."""
    args = group.get("weights")
    w = f"{where}.weights"
    if not isinstance(args, dict):
        raise CheckpointError(f"quantization_config.{w}: must be an object, got {args!r}")
    for key, want in INT4_WEIGHTS.items():
        if args.get(key) != want:
            raise CheckpointError(f"quantization_config.{w}.{key}: {args.get(key)!r} is not supported "
                                  f"(pack-quantized W4A16 needs {want!r})")
    strategy = args.get("strategy")
    if strategy == "group":
        size = args.get("group_size")
        if isinstance(size, bool) or not isinstance(size, int) or size <= 0 or size % 8:
            raise CheckpointError(f"quantization_config.{w}.group_size: {size!r} is not supported "
                                  "(a positive multiple of 8)")
    elif strategy == "channel":
        size = None
        if args.get("group_size") not in (None, -1):
            raise CheckpointError(f"quantization_config.{w}.group_size: {args['group_size']!r} with strategy "
                                  "'channel'")
    else:
        raise CheckpointError(f"quantization_config.{w}.strategy: {strategy!r} is not supported (group, channel)")
    if not isinstance(args.get("symmetric"), bool):
        raise CheckpointError(f"quantization_config.{w}.symmetric: {args.get('symmetric')!r} must be true or false")
    if args.get("block_structure") not in (None, []):
        raise CheckpointError(f"quantization_config.{w}.block_structure: {args['block_structure']!r} is not supported")
    # actorder changes only the order in which columns were quantized; `group` stores weight_g_idx, which the
    # loader reads (int4.read_int4), the others keep contiguous groups.
    if args.get("actorder") not in (None, False, "group", "weight", "static"):
        raise CheckpointError(f"quantization_config.{w}.actorder: {args['actorder']!r} is not supported")
    if group.get("input_activations") is not None:
        raise CheckpointError(f"quantization_config.{where}.input_activations: {group['input_activations']!r} "
                              "is not supported with pack-quantized (W4A16 keeps activations in float)")
    return Int4Args("pack-quantized", size, args["symmetric"])
