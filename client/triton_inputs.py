"""Builds the Triton input tensors of an LLM request (both dialects) for tritonclient gRPC."""
from __future__ import annotations

import json

import numpy as np
import tritonclient.grpc as grpcclient

SCALAR_TYPES = {"max_tokens": ("INT32", np.int32), "min_tokens": ("INT32", np.int32), "top_k": ("INT32", np.int32),
                "beam_width": ("INT32", np.int32), "temperature": ("FP32", np.float32), "top_p": ("FP32", np.float32),
                "presence_penalty": ("FP32", np.float32), "frequency_penalty": ("FP32", np.float32),
                "repetition_penalty": ("FP32", np.float32), "seed": ("UINT64", np.uint64)}
FLAGS = ("stream", "exclude_input_in_output", "return_finish_reason", "return_num_input_tokens",
         "return_num_output_tokens", "return_logprobs")


def _tensor(name, arr, dtype, module=grpcclient):
    t = module.InferInput(name, list(arr.shape), dtype)
    t.set_data_from_numpy(arr)
    return t


def build_inputs(prompt: str | None = None, input_ids: list[int] | None = None, *, stream: bool = True,
                 sampling_parameters: dict | None = None, stop_words: list[str] | None = None,
                 messages: list[dict] | None = None, enable_thinking: bool | None = None, module=grpcclient,
                 **fields) -> list:
    """prompt/input_ids (or chat `messages` for the ensembles); sampling_parameters as the vLLM JSON; other
    keyword fields as scalar tensors (TensorRT-LLM dialect: max_tokens=32, temperature=0.0, ...) or flags
    (return_finish_reason=True)."""
    inputs = []
    if messages is not None:
        data = json.dumps(messages, ensure_ascii=False).encode()
        inputs.append(_tensor("messages", np.array([data], dtype=np.object_), "BYTES", module))
    if enable_thinking is not None:
        inputs.append(_tensor("enable_thinking", np.array([enable_thinking], dtype=bool), "BOOL", module))
    if prompt is not None:
        inputs.append(_tensor("text_input", np.array([prompt.encode("utf-8")], dtype=np.object_), "BYTES", module))
    if input_ids is not None:
        inputs.append(_tensor("input_ids", np.array(input_ids, dtype=np.int32), "INT32", module))
    inputs.append(_tensor("stream", np.array([stream], dtype=bool), "BOOL", module))
    if sampling_parameters:
        data = json.dumps(sampling_parameters).encode()
        inputs.append(_tensor("sampling_parameters", np.array([data], dtype=np.object_), "BYTES", module))
    if stop_words:
        inputs.append(_tensor("stop_words", np.array([s.encode() for s in stop_words], dtype=np.object_), "BYTES",
                              module))
    for name, value in fields.items():
        if value is None:
            continue
        if name in SCALAR_TYPES:
            triton_type, np_type = SCALAR_TYPES[name]
            inputs.append(_tensor(name, np.array([value], dtype=np_type), triton_type, module))
        elif name in FLAGS:
            inputs.append(_tensor(name, np.array([bool(value)], dtype=bool), "BOOL", module))
        else:
            raise ValueError(f"unknown request field {name!r}")
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
