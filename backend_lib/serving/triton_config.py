"""EngineConfig from a Triton model's `initialize` args: config.pbtxt parameters, then the
$<MODEL>_<PARAMETER> environment overrides, then the instance kind and device. Every model of the
repository (the LLMs and the tokenizer) reads its configuration here, so one parsing and one set
of defaults (EngineConfig's) hold for all of them."""
from __future__ import annotations

import json
import os

from ..config import EngineConfig
from .log import get_logger

log = get_logger()


def model_parameters(args: dict) -> dict[str, str]:
    """config.pbtxt parameters with their environment overrides ($QWEN3_A8W8_MAX_NUM_SEQS=32)."""
    model_config = json.loads(args["model_config"])
    name = args["model_name"]
    params = {k: v.get("string_value", "") for k, v in (model_config.get("parameters") or {}).items()}
    for key in sorted(EngineConfig.field_names()):
        env = os.environ.get(f"{name.upper()}_{key.upper()}")
        if env:
            params[key] = env
            log.info("%s: %s from $%s_%s = %s", name, key, name.upper(), key.upper(), env)
    return params


def engine_config_from_args(args: dict, params: dict[str, str] | None = None) -> EngineConfig:
    params = dict(model_parameters(args) if params is None else params)
    kind = args.get("model_instance_kind", "CPU")
    device_id = args.get("model_instance_device_id", "0")
    if kind == "GPU":
        base = params.get("device", "cuda")
        params["device"] = f"{'npu' if base.startswith('npu') else 'cuda'}:{device_id}"
    elif kind == "CPU" and params.get("device", "") in ("", "auto"):
        params["device"] = "cpu"
    multi_lora(args, params)
    return EngineConfig.from_params(params, base_dir=args["model_repository"])


def multi_lora(args: dict, params: dict[str, str]) -> None:
    """vllm_backend's multi_lora.json ({"name": "path", ...}, in the model's version folder or its folder) joins the
    lora_modules parameter; a name in both with different paths is an error naming both."""
    from ..lora.registry import MULTI_LORA_FILE, parse_lora_modules, read_multi_lora

    folder = args["model_repository"]
    merged = parse_lora_modules(params.get("lora_modules") or None)
    for where in (os.path.join(folder, str(args.get("model_version") or "1")), folder):
        for name, path in read_multi_lora(where).items():
            if merged.get(name, path) != path:
                raise ValueError(f"lora_modules: adapter {name!r} is {merged[name]!r} there and {path!r} in "
                                 f"{os.path.join(where, MULTI_LORA_FILE)}; name it once")
            merged[name] = path
    if merged:
        params["lora_modules"] = json.dumps(merged)
