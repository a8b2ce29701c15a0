"""Parses a Triton LLM request (vLLM and TensorRT-LLM dialects) into a prompt and sampling fields.

A field may come from a scalar input tensor, the `sampling_parameters` JSON, or a request parameter
(where the HTTP generate extension puts JSON keys that are not model inputs, and where gRPC clients
may put them). Every input or none: a request parameter we do not know is an error naming it, the
same field given twice with different values is an error naming both places, and inputs that
exclude each other (`text_input` and `input_ids`; an abort and a prompt) are an error naming both.
Pure Python over numpy arrays, so it is tested without a server.
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields
from types import UnionType
from typing import get_args, get_origin, get_type_hints

import numpy as np

from ..contract.json_input import check_text, loads
from ..contract.choices import MAX_N
from ..contract.errors import RequestError
from ..contract.structured import STRUCTURED_KEYS
from ..sampling.params import SamplingParams, check_keys
from .schema import FLAG_INPUTS, LLM_INPUT, LLM_INPUTS, SAMPLING_INPUTS

# TensorRT-LLM tensor names -> SamplingParams fields
ALIASES = {"min_length": "min_tokens", "random_seed": "seed", "num_return_sequences": "n"}
# TensorRT-LLM's guided_decoding_guide_type -> vLLM's structured_outputs key (ebnf_grammar is xgrammar's EBNF,
# not the grammar engine's Lark: refused, as structural_tag)
GUIDE_TYPES = {"json": "json_object", "json_schema": "json", "regex": "regex"}


def _field_types() -> dict[str, type]:
    """SamplingParams' fields by their type (None dropped, list[...] -> list): what a string is coerced to."""
    hints = get_type_hints(SamplingParams)
    out = {}
    for f in fields(SamplingParams):
        if not f.init:
            continue
        hint = hints[f.name]
        members = get_args(hint) if isinstance(hint, UnionType) else (hint,)
        kinds = [get_origin(t) or t for t in members if t is not type(None)]
        if len(kinds) == 1 and kinds[0] in (int, float, bool, str, list, dict):
            out[f.name] = kinds[0]
    return out


_FIELD_TYPES = _field_types()
ABORT_INPUTS = tuple(f.name for f in LLM_INPUTS if f.role == "abort")
MAX_SAMPLING_JSON_BYTES = 1 << 20


def _take_n(data: dict, where: str) -> int | None:
    """vLLM's n, taken out of the sampling fields (the serving layer forks the choices)."""
    if "n" not in data:
        return None
    v = data.pop("n")
    if isinstance(v, str) and v.isdigit() and len(v) < 4:
        v = int(v)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= MAX_N:
        raise RequestError(f"{where}: n must be an integer in [1, {MAX_N}], got {str(v)[:32]!r}")
    return v


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
    return_cumulative_logprob: bool = False
    return_num_cached_tokens: bool = False
    return_abort_token: bool = False
    given_flags: set = field(default_factory=set)   # the flags the request sent (not defaulted)
    n: int = 1                      # choices (vLLM's n): one engine request each, one Triton response stream
    logprobs_output: bool = False   # the logprobs output was asked for (return_logprobs, or logprobs: N)


@dataclass(frozen=True)
class AbortRequest:
    """A request that asks to abort another: the target's Triton request id and its abort token."""
    request_id: str
    token: str


SCALAR_SHAPES = ((1,), (1, 1))   # vllm_backend's scalar, and TensorRT-LLM's (a batch dimension of 1 first)


def scalar(name: str, arr: np.ndarray):
    """The one value of a scalar input, shaped [1] or [1, 1]; any other shape is an error naming the input."""
    if arr.shape not in SCALAR_SHAPES:
        raise RequestError(f"{name}: expected one value, shaped [1] or [1, 1], got shape {list(arr.shape)}")
    return arr.reshape(-1)[0]


def list_values(name: str, arr: np.ndarray) -> np.ndarray:
    """The values of a list input (input_ids, stop_words), shaped [n] or [1, n] (a batch dimension of 1 first)."""
    if arr.ndim == 2 and arr.shape[0] == 1 or arr.ndim == 1:
        return arr.reshape(-1)
    raise RequestError(f"{name}: expected a list of values, shaped [n] or [1, n], got shape {list(arr.shape)}")


def text_value(name: str, value, max_bytes: int | None = None) -> str:
    if max_bytes is not None and isinstance(value, (bytes, np.bytes_, str)) and len(value) > max_bytes:
        raise RequestError(f"{name}: {len(value)} bytes exceed the limit of {max_bytes} (max_prompt_bytes)")
    if isinstance(value, (bytes, np.bytes_)):
        try:
            return bytes(value).decode("utf-8")
        except UnicodeDecodeError:
            raise RequestError(f"{name}: not valid UTF-8") from None
    if isinstance(value, str):
        check_text(value, name)
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
            if len(value) > 40:
                raise ValueError
            return int(value)
        if typ is float:
            return float(value)
        if typ is list:
            if key in ("stop", "bad_words") and not value.lstrip().startswith("["):
                return [value]
            return loads(value, f"{where}.{key}")
        if typ is dict:
            return loads(value, f"{where}.{key}")
    except ValueError:
        raise RequestError(f"{where}: {key}={value[:64]!r} is not a valid {typ.__name__}") from None
    return value


def _flag(where: str, value) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in ("true", "false"):
        return value.lower() == "true"
    raise RequestError(f"{where} must be a boolean, got {value!r}")


def _parameters(req: ParsedRequest, parameters_json: str | None) -> dict:
    """The request parameters as sampling fields (flags set on `req`); unknown ones are an error."""
    if not parameters_json:
        return {}
    params = loads(parameters_json, "parameters")
    if not isinstance(params, dict):
        raise RequestError("parameters: must be an object")
    rest = {}
    n = _take_n(params, "parameters")
    if n is not None:
        rest["n"] = n
    for k, v in params.items():
        if k in FLAG_INPUTS:
            setattr(req, k, _flag(f"parameters.{k}", v))
            req.given_flags.add(k)
        elif k == "min_length":   # TensorRT-LLM's name
            if "min_tokens" in params:
                raise RequestError("min_length and min_tokens: one meaning, send one of them")
            rest["min_tokens"] = v
        elif k == "stop_words":
            rest["stop"] = v if isinstance(v, list) else [v]
        elif k == "beam_width":
            if v not in (1, "1"):
                raise RequestError(f"beam_width: only 1 is supported, got {v!r}")
        elif k in ("sampling_parameters", "text_input", "input_ids", *ABORT_INPUTS):
            raise RequestError(f"parameters.{k}: send {k} as an input tensor, not a request parameter")
        else:
            rest[k] = v
    n = rest.pop("n", None)
    rest = check_keys(rest, "parameters")   # unknown keys and non-neutral vLLM keys: an error naming them
    if n is not None:
        rest["n"] = n
    return {k: (_coerce(k, v, "parameters") if k in _FIELD_TYPES else v) for k, v in rest.items()}


def _same(name: str, a, b) -> bool:
    """Whether two values of one field agree (compared at the wire tensor's type when it has one)."""
    f = LLM_INPUT.get(name)
    if f is not None and f.role == "sampling" and not isinstance(a, (list, dict)) and not isinstance(b, (list, dict)):
        try:
            return bool(np.array(a).astype(f.np_dtype) == np.array(b).astype(f.np_dtype)) and type(a) is not bool \
                and type(b) is not bool
        except (TypeError, ValueError, OverflowError):
            return False
    return a == b and type(a) is type(b)


def _merge(merged: dict, origin: dict, values: dict, where: str) -> None:
    for k, v in values.items():
        if k in merged and not _same(k, merged[k], v):
            raise RequestError(f"{k}: given in {origin[k]} ({merged[k]!r}) and in {where} ({v!r}) with different "
                               "values; send it once")
        merged[k] = v
        origin[k] = where


def _guide(kind_arr, guide_arr) -> dict | None:
    """TensorRT-LLM's guided decoding inputs as vLLM's structured_outputs."""
    if kind_arr is None:
        if guide_arr is not None:
            raise RequestError("guided_decoding_guide: needs guided_decoding_guide_type")
        return None
    kind = text_value("guided_decoding_guide_type", scalar("guided_decoding_guide_type", kind_arr))
    if kind not in GUIDE_TYPES:
        raise RequestError(f"guided_decoding_guide_type: {kind[:40]!r} is not supported (json, json_schema or regex; "
                           "send other grammars as structured_outputs.grammar)")
    if kind == "json":
        if guide_arr is not None:
            raise RequestError("guided_decoding_guide: guide type json takes no guide (any JSON object)")
        return {"json_object": True}
    if guide_arr is None:
        raise RequestError(f"guided_decoding_guide: guide type {kind} needs the guide")
    guide = text_value("guided_decoding_guide", scalar("guided_decoding_guide", guide_arr))
    if kind == "json_schema":   # parsed here so that a bad document names this input
        guide = loads(guide, "guided_decoding_guide")
        if not isinstance(guide, dict):
            raise RequestError("guided_decoding_guide: a json_schema guide must be a JSON object")
    return {GUIDE_TYPES[kind]: guide}


def parse_abort(inputs: dict[str, np.ndarray], parameters_json: str | None) -> AbortRequest | None:
    """The abort this request asks for (None when it carries no abort input); an abort carries
    abort_request_id and abort_token and nothing else."""
    given = [name for name in ABORT_INPUTS if name in inputs]
    if not given:
        return None
    others = sorted(set(inputs) - set(ABORT_INPUTS))
    if parameters_json and loads(parameters_json, "parameters"):
        others.append("request parameters")
    if others:
        raise RequestError(f"abort_request_id: an abort request carries abort_request_id and abort_token only, "
                           f"got also {', '.join(others)}")
    missing = [name for name in ABORT_INPUTS if name not in inputs]
    if missing:
        raise RequestError(f"{missing[0]}: an abort needs abort_request_id and the abort_token that the request's "
                           "first response carried (ask for it with return_abort_token)")
    values = {name: text_value(name, scalar(name, inputs[name])) for name in ABORT_INPUTS}
    return AbortRequest(values["abort_request_id"], values["abort_token"])


def parse_request(inputs: dict[str, np.ndarray], parameters_json: str | None,
                  max_prompt_bytes: int | None = None) -> ParsedRequest:
    """`inputs`: the request's input tensors as numpy, by name; parameters_json is request.parameters()."""
    req = ParsedRequest()
    get = inputs.get
    merged: dict = {}
    origin: dict = {}
    _merge(merged, origin, _parameters(req, parameters_json), "the request parameters")
    sp = get("sampling_parameters")
    if sp is not None:
        raw = text_value("sampling_parameters", scalar("sampling_parameters", sp))
        if raw.strip():
            data = loads(raw, "sampling_parameters", max_bytes=MAX_SAMPLING_JSON_BYTES)
            if not isinstance(data, dict):
                raise RequestError("sampling_parameters: must be a JSON object")
            n = _take_n(data, "sampling_parameters")
            data = check_keys(data)
            if n is not None:
                data["n"] = n
            _merge(merged, origin, {k: _coerce(k, v, "sampling_parameters") for k, v in data.items()},
                   "sampling_parameters")
    tensors = {}
    for name in SAMPLING_INPUTS:
        arr = get(name)
        if arr is not None:
            key = ALIASES.get(name, name)
            value = LLM_INPUT[name].py_type(scalar(name, arr).item())
            if key in tensors and tensors[key] != value:
                raise RequestError(f"{name} and {key}: given as input tensors with different values; send one")
            tensors[key] = value
    bw = get("beam_width")
    if bw is not None and int(scalar("beam_width", bw)) != 1:
        raise RequestError(f"beam_width: only 1 is supported, got {int(scalar('beam_width', bw))}")
    sw = get("stop_words")
    if sw is not None:
        tensors["stop"] = [text_value("stop_words", v) for v in list_values("stop_words", sw)]
    bad = get("bad_words")
    if bad is not None:
        tensors["bad_words"] = [text_value("bad_words", v) for v in list_values("bad_words", bad)]
    if "n" in tensors and not 1 <= tensors["n"] <= MAX_N:
        raise RequestError(f"num_return_sequences: must be an integer in [1, {MAX_N}], got {tensors['n']}")
    guide = _guide(get("guided_decoding_guide_type"), get("guided_decoding_guide"))
    if guide is not None:
        tensors["structured_outputs"] = guide
    _merge(merged, origin, tensors, "an input tensor")
    for name in FLAG_INPUTS:
        arr = get(name)
        if arr is not None:
            value = bool(scalar(name, arr))
            if name in req.given_flags and getattr(req, name) != value:
                raise RequestError(f"{name}: given in the request parameters ({getattr(req, name)}) and as an "
                                   f"input tensor ({value}) with different values; send it once")
            setattr(req, name, value)
            req.given_flags.add(name)
    req.logprobs_output = req.return_logprobs or merged.get("logprobs") is not None
    if (req.return_logprobs or req.return_cumulative_logprob) and merged.get("logprobs") is None:
        merged["logprobs"] = 0
    if req.stream and "exclude_input_in_output" in req.given_flags and not req.exclude_input_in_output:
        raise RequestError("exclude_input_in_output: false is not allowed with stream true (as vllm_backend: a "
                           "stream returns only the generated text)")
    if req.return_abort_token and not req.stream:
        raise RequestError("return_abort_token: needs stream true (the token comes in a response of its own, "
                           "before the first token)")
    req.n = merged.pop("n", 1)   # n > 1 without stream: each choice's one (final) response, with its sequence_index
    req.sampling = merged

    text = get("text_input")
    ids = get("input_ids")
    if text is not None and ids is not None:
        raise RequestError("text_input and input_ids: send one of them, not both")
    if text is not None:
        req.text = text_value("text_input", scalar("text_input", text), max_prompt_bytes)
    if ids is not None:
        if ids.dtype.kind not in "iu":
            raise RequestError(f"input_ids: expected integer ids, got dtype {ids.dtype}")
        req.input_ids = [int(v) for v in list_values("input_ids", ids)]
    if req.text is None and req.input_ids is None:
        raise RequestError("text_input or input_ids is required")
    if req.input_ids is None and req.text == "":
        raise RequestError("text_input: the prompt is empty")
    if req.input_ids is not None and not req.input_ids:
        raise RequestError("input_ids: the prompt is empty")
    return req
