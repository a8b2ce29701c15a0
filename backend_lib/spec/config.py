"""`speculative_config`: the model parameter that turns speculative decoding on, with vLLM's
--speculative-config keys, validated once at load with errors naming the key.

    parameters: { key: "speculative_config"
                  value: { string_value: '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}' } }

    '{"method": "draft_model", "model": "/models/qwen3-0.6b", "num_speculative_tokens": 4}'

Methods: `ngram` (prompt lookup) and `draft_model` (a smaller Qwen3 checkpoint with the target's vocabulary,
in any format the engine loads: `model` is its local folder, relative to the model's folder in a served
config; as in vLLM, a `model` without a `method` means draft_model), and `eagle3` (an EAGLE-3 head: `model` is
its folder, spec/eagle3.py). The other methods vLLM knows (eagle, medusa, mtp, suffix) are refused by name. Our own keys, beside vLLM's: min_acceptance and
acceptance_window (the per-request auto-disable), auto_disable_from_batch (the batch gate, spec/gate.py: from
that many decoding sequences up, drafting only while it is measured to pay; null turns it off) and vLLM's
disable_by_batch_size. What needs the target
(the draft's vocabulary against the target's, its positions) is checked when the engine loads the draft
(spec/draft_model.py), with errors naming speculative_config.model too.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass

METHODS = ("ngram", "draft_model", "eagle3")
MODEL_METHODS = ("draft_model", "eagle3")      # the methods that load a `model`
NGRAM_KEYS = ("prompt_lookup_min", "prompt_lookup_max")
# vLLM methods that exist there but not here: refused with their name
NOT_IMPLEMENTED = ("eagle", "medusa", "mlp_speculator", "mtp", "suffix",
                   "deepseek_mtp", "ernie_mtp", "qwen3_next_mtp")
MAX_SPECULATIVE_TOKENS = 16


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 4
    # per-request auto-disable: over each window of `acceptance_window` drafted tokens, an acceptance rate
    # below `min_acceptance` pauses that request's speculation (for 2x longer each time it happens again)
    min_acceptance: float = 0.25
    acceptance_window: int = 16
    disable_by_batch_size: int | None = None   # vLLM's: no drafts in a step with this many running requests
    model: str | None = None       # draft_model: the draft checkpoint's folder
    # the batch gate (spec/gate.py): from this many decoding sequences up, a step drafts only while drafting is
    # measured to give more tokens per second at that batch size than plain steps; None: never gated
    auto_disable_from_batch: int | None = 4

    def as_dict(self) -> dict:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}


KEYS = tuple(SpeculativeConfig.__dataclass_fields__)


def _int(key: str, value, lo: int, hi: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"speculative_config.{key}: must be an integer, got {value!r}")
    if value < lo or (hi is not None and value > hi):
        raise ValueError(f"speculative_config.{key}: must be in [{lo}, {hi if hi is not None else 'inf'}], "
                         f"got {value}")
    return value


def parse_speculative_config(value) -> SpeculativeConfig | None:
    """None / '' / 'null' / '{}'-less-off: None (speculation off). A JSON object string or a dict: validated."""
    if value is None or (isinstance(value, str) and value.strip() in ("", "null", "none", "off")):
        return None
    if isinstance(value, SpeculativeConfig):
        return value
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ValueError(f"speculative_config: not a JSON object ({exc})") from None
    if not isinstance(value, dict):
        raise ValueError(f"speculative_config: must be a JSON object, got {type(value).__name__}")
    for key in value:
        if key not in KEYS:
            raise ValueError(f"speculative_config.{key}: unknown key (known: {', '.join(KEYS)})")
    model = value.get("model")
    method = value.get("method", "ngram" if model is None else "draft_model")   # vLLM: a model alone is a draft
    if method in ("[ngram]", "ngram"):
        method = "ngram"
        if model is not None:
            raise ValueError("speculative_config.model: method ngram takes no model (a draft model is method "
                             "draft_model)")
    elif method in METHODS:
        pass
    elif method in NOT_IMPLEMENTED:
        raise ValueError(f"speculative_config.method: {method!r} is not implemented (implemented: "
                         f"{', '.join(METHODS)})")
    else:
        raise ValueError(f"speculative_config.method: {method!r} is not a known method (implemented: "
                         f"{', '.join(METHODS)})")
    if "num_speculative_tokens" not in value:
        raise ValueError("speculative_config.num_speculative_tokens: required (1 to "
                         f"{MAX_SPECULATIVE_TOKENS})")
    k = _int("num_speculative_tokens", value["num_speculative_tokens"], 1, MAX_SPECULATIVE_TOKENS)
    if method in MODEL_METHODS:
        model = check_model_folder(model, method)
        for key in NGRAM_KEYS:
            if key in value:
                raise ValueError(f"speculative_config.{key}: only method ngram looks up n-grams (this is {method})")
    hi = value.get("prompt_lookup_max")
    lo = value.get("prompt_lookup_min")
    # vLLM: either one given sets the other (min defaults to max and max to min); neither: 2..4 here
    if hi is None and lo is None:
        lo, hi = 2, 4
    elif hi is None:
        hi = lo
    elif lo is None:
        lo = hi
    hi = _int("prompt_lookup_max", hi, 1, 64)
    lo = _int("prompt_lookup_min", lo, 1, 64)
    if lo > hi:
        raise ValueError(f"speculative_config.prompt_lookup_min: {lo} exceeds prompt_lookup_max {hi}")
    rate = value.get("min_acceptance", SpeculativeConfig.min_acceptance)
    if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not 0.0 <= rate <= 1.0:
        raise ValueError(f"speculative_config.min_acceptance: a number in [0, 1], got {rate!r}")
    window = _int("acceptance_window", value.get("acceptance_window", SpeculativeConfig.acceptance_window), 1, 4096)
    by_batch = value.get("disable_by_batch_size")
    if by_batch is not None:
        by_batch = _int("disable_by_batch_size", by_batch, 1)
    gate = value.get("auto_disable_from_batch", SpeculativeConfig.auto_disable_from_batch)
    if gate is not None:
        gate = _int("auto_disable_from_batch", gate, 1)
    return SpeculativeConfig(method, k, lo, hi, float(rate), window, by_batch, model, gate)


def check_model_folder(model, method: str) -> str:
    """A method's `model`: a local checkpoint folder (with its config.json)."""
    if not isinstance(model, str) or not model.strip():
        what = "EAGLE-3 head's" if method == "eagle3" else "draft checkpoint's"
        raise ValueError(f"speculative_config.model: method {method} needs the {what} folder, got {model!r}")
    path = os.path.expanduser(model)
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise ValueError(f"speculative_config.model: {model!r} is not a checkpoint folder (no config.json there)")
    return path


def resolve_model_path(value, base_dir: str | None):
    """speculative_config with a relative `model` made relative to base_dir (the served model's folder), as
    the checkpoint parameter is; anything else (and anything unparsable: validation reports it) unchanged."""
    if base_dir is None or value is None:
        return value
    try:
        data = json.loads(value) if isinstance(value, str) else value
    except json.JSONDecodeError:
        return value
    if not isinstance(data, dict) or not isinstance(data.get("model"), str):
        return value
    path = os.path.expanduser(data["model"])
    if os.path.isabs(path) or not data["model"].strip():
        return value
    data = {**data, "model": os.path.normpath(os.path.join(base_dir, path))}
    return json.dumps(data) if isinstance(value, str) else data
