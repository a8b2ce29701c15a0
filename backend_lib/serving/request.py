"""Parses a Triton LLM request (vLLM and TensorRT-LLM dialects) into a prompt and sampling fields.

Precedence, highest first: scalar input tensors, the `sampling_parameters` JSON, then request
parameters (where the HTTP generate extension puts JSON keys that are not model inputs).
Pure Python over numpy arrays, so it is tested without a server.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from ..sampling.params import RequestError, check_keys
from ..sampling.structured import STRUCTURED_KEYS
from .schema import FLAG_INPUTS, LLM_INPUT, SAMPLING_INPUTS
_FIELD_TYPES = {"max_tokens": int, "min_tokens": int, "temperature": float, "top_p": float, "top_k": int,
                "min_p": float, "seed": int, "stop": list, "stop_token_ids": list, "ignore_eos": bool, "logprobs": int,
                "presence_penalty": float, "frequency_penalty": float, "repetition_penalty": float,
                "skip_special_tokens": bool, "cache_salt": str}


@dataclass
class ParsedRequest:
    text: str | None = None
    input_ids: list[int] | None = None
    sampling: dict = field(default_factory=dict)
    stream: bool = False
    exclude_input_in_output: bool = False
    return_finish_reason: bool = False
    return_num_input_tokens: bool = False
    return_num_output_tokens: bool = False
    return_logprobs: bool = False


def scalar(name: str, arr: np.ndarray):
    if arr.size != 1:
        raise RequestError(f"{name}: expected exactly one value, got shape {list(arr.shape)}")
    return arr.reshape(-1)[0]


def text_value(name: str, value, max_bytes: int | None = None) -> str:
    if max_bytes is not None and isinstance(value, (bytes, np.bytes_, str)) and len(value) > max_bytes:
        raise RequestError(f"{name}: {len(value)} bytes exceed the limit of {max_bytes} (max_prompt_bytes)")
    if isinstance(value, (bytes, np.bytes_)):
        try:
            return bytes(value).decode("utf-8")
        except UnicodeDecodeError:
            raise RequestError(f"{name}: not valid UTF-8") from None
    if isinstance(value, str):
        return value
    raise RequestError(f"{name}: expected a string, got {type(value).__name__}")


def _coerce(key: str, value, where: str):
    """vLLM-backend clients often send every sampling value as a string ("0.7", "true", "16")."""
    typ = _FIELD_TYPES.get(key)
    if typ is None or not isinstance(value, str):
        return value
    try:
        if typ is bool:
            if value.lower() in ("true", "1"):
                return True
            if value.lower() in ("false", "0"):
                return False
            raise ValueError
        if typ is int:
            return int(value)
        if typ is float:
            return float(value)
        if typ is list:
            if key == "stop" and not value.lstrip().startswith("["):
                return [value]
            return json.loads(value)
    except (ValueError, json.JSONDecodeError):
        raise RequestError(f"{where}: {key}={value!r} is not a valid {typ.__name__}") from None
    return value


def parse_request(get: Callable[[str], np.ndarray | None], parameters_json: str | None,
                  max_prompt_bytes: int | None = None) -> ParsedRequest:
    """`get(name)` returns the input tensor as numpy or None; parameters_json is request.parameters()."""
    req = ParsedRequest()
    # lowest precedence first: request parameters, then sampling_parameters JSON, then tensors
    merged: dict = {}
    if parameters_json:
        try:
            params = json.loads(parameters_json)
        except json.JSONDecodeError:
            params = {}
        if isinstance(params, dict):
            for k, v in params.items():
                if k in _FIELD_TYPES:
                    merged[k] = _coerce(k, v, "parameters")
                elif k in STRUCTURED_KEYS:   # a string here (JSON text for objects and lists)
                    merged[k] = v
                elif k == "stop_words":
                    merged["stop"] = v if isinstance(v, list) else [v]
                elif k in FLAG_INPUTS and isinstance(v, (bool, str)):
                    setattr(req, k, v if isinstance(v, bool) else v.lower() == "true")
                elif k == "beam_width" and v not in (1, "1"):
                    raise RequestError(f"beam_width: only 1 is supported, got {v}")
    sp = get("sampling_parameters")
    if sp is not None:
        raw = text_value("sampling_parameters", scalar("sampling_parameters", sp))
        if raw.strip():
            try:
                data = json.loads(raw)
            except json.JSONDecodeError as exc:
                raise RequestError(f"sampling_parameters: malformed JSON ({exc.msg} at position {exc.pos})") from None
            if not isinstance(data, dict):
                raise RequestError("sampling_parameters: must be a JSON object")
            data = check_keys(data)
            merged.update({k: _coerce(k, v, "sampling_parameters") for k, v in data.items()})
    for name in SAMPLING_INPUTS:
        arr = get(name)
        if arr is not None:
            merged[name] = LLM_INPUT[name].py_type(scalar(name, arr).item())
    bw = get("beam_width")
    if bw is not None and int(scalar("beam_width", bw)) != 1:
        raise RequestError(f"beam_width: only 1 is supported, got {int(scalar('beam_width', bw))}")
    sw = get("stop_words")
    if sw is not None:
        merged["stop"] = [text_value("stop_words", v) for v in sw.reshape(-1)]
    for name in FLAG_INPUTS:
        arr = get(name)
        if arr is not None:
            setattr(req, name, bool(scalar(name, arr)))
    if req.return_logprobs and merged.get("logprobs") is None:
        merged["logprobs"] = 0
    req.sampling = merged

    text = get("text_input")
    ids = get("input_ids")
    if text is not None:
        req.text = text_value("text_input", scalar("text_input", text), max_prompt_bytes)
    if ids is not None:
        if ids.dtype.kind not in "iu":
            raise RequestError(f"input_ids: expected integer ids, got dtype {ids.dtype}")
        req.input_ids = [int(v) for v in ids.reshape(-1)]
    if req.text is None and req.input_ids is None:
        raise RequestError("text_input or input_ids is required")
    if req.input_ids is None and req.text == "":
        raise RequestError("text_input: the prompt is empty")
    if req.input_ids is not None and not req.input_ids and not req.text:
        raise RequestError("input_ids: the prompt is empty")
    return req
