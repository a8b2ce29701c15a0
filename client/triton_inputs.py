"""Builds the Triton input tensors of an LLM request (both dialects) for tritonclient gRPC."""
from __future__ import annotations

import json

import numpy as np
import tritonclient.grpc as grpcclient

from backend_lib.serving.schema import LLM_INPUT, TOKENIZER_INPUTS

FIELDS = {**LLM_INPUT, **{f.name: f for f in TOKENIZER_INPUTS}}


def tensor(name: str, value, module=grpcclient):
    """One input tensor of the schema's type: a scalar becomes [value], a list stays a list."""
    f = FIELDS[name]
    values = value if isinstance(value, (list, tuple)) else [value]
    if f.type == "TYPE_STRING":
        values = [v.encode("utf-8") if isinstance(v, str) else v for v in values]
    arr = np.array(values, dtype=f.np_dtype)
    t = module.InferInput(name, list(arr.shape), f.wire_type)
    t.set_data_from_numpy(arr)
    return t


def build_inputs(prompt: str | None = None, input_ids: list[int] | None = None, *, stream: bool = True,
                 sampling_parameters: dict | None = None, stop_words: list[str] | None = None,
                 messages: list[dict] | None = None, module=grpcclient, **fields) -> list:
    """prompt/input_ids (or chat `messages` for the ensembles); sampling_parameters as the vLLM JSON; other
    keyword fields by their schema name: scalar tensors (TensorRT-LLM dialect: max_tokens=32,
    temperature=0.0, ...) or flags (return_finish_reason=True, enable_thinking=False)."""
    inputs = []
    if messages is not None:
        inputs.append(tensor("messages", json.dumps(messages, ensure_ascii=False), module))
    if prompt is not None:
        inputs.append(tensor("text_input", prompt, module))
    if input_ids is not None:
        inputs.append(tensor("input_ids", list(input_ids), module))
    inputs.append(tensor("stream", stream, module))
    if sampling_parameters:
        inputs.append(tensor("sampling_parameters", json.dumps(sampling_parameters), module))
    if stop_words:
        inputs.append(tensor("stop_words", list(stop_words), module))
    for name, value in fields.items():
        if value is None:
            continue
        if name not in FIELDS or FIELDS[name].role not in ("sampling", "flag", "control"):
            raise ValueError(f"unknown request field {name!r}")
        inputs.append(tensor(name, value, module))
    return inputs


def is_final(result) -> bool:
    params = result.get_response().parameters
    return "triton_final_response" in params and params["triton_final_response"].bool_param


def response_text(result) -> tuple[str, list[int]]:
    """(text delta, ids) of one response; empty for the empty final response."""
    text = result.as_numpy("text_output")
    ids = result.as_numpy("output_ids")
    return ("".join(t.decode("utf-8") for t in text) if text is not None else "",
            [int(i) for i in ids] if ids is not None else [])
