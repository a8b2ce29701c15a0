"""The wire schema is the one source of the models' I/O: generated ensembles, parsing and client agree."""
from __future__ import annotations

import json
import re

import numpy as np
import pytest

from backend_lib.contract.errors import RequestError
from backend_lib.serving import schema
from backend_lib.serving.request import parse_request
from backend_lib.serving.responses import abort_token_arrays, output_arrays
from client.triton_inputs import build_inputs
from helpers import ROOT


@pytest.mark.parametrize("name, llm", sorted(schema.ENSEMBLES.items()))
def test_ensemble_configs_are_generated_from_the_schema(name, llm):
    on_disk = (ROOT / "model_repository" / name / "config.pbtxt").read_text()
    assert on_disk == schema.ensemble_config(name, llm), \
        "the ensemble config drifted from the schema: run `python -m backend_lib.serving.schema --write`"


@pytest.mark.parametrize("model", ["qwen3_a8w8", "qwen3_tq", "qwen3_tokenizer"])
def test_python_models_declare_no_io_of_their_own(model):
    text = (ROOT / "model_repository" / model / "config.pbtxt").read_text()
    assert "input [" not in text and "output [" not in text   # auto_complete_config declares them


class FakeConfig:
    def __init__(self, max_batch_size: int = 0):
        self.inputs, self.outputs, self.policy, self.mbs = [], [], None, None
        self.configured = max_batch_size    # what config.pbtxt says

    def as_dict(self):
        return {"max_batch_size": self.configured}

    def add_input(self, d):
        self.inputs.append(d)

    def add_output(self, d):
        self.outputs.append(d)

    def set_model_transaction_policy(self, d):
        self.policy = d

    def set_max_batch_size(self, n):
        self.mbs = n


def test_llm_auto_complete_declares_every_schema_field_optional_and_decoupled():
    from backend_lib.serving.triton_llm import TritonLLMModel

    cfg = TritonLLMModel.auto_complete_config(FakeConfig())
    assert [d["name"] for d in cfg.inputs] == [f.name for f in schema.LLM_INPUTS]
    assert all(d["optional"] for d in cfg.inputs)
    assert [d["name"] for d in cfg.outputs] == [f.name for f in schema.LLM_OUTPUTS]
    assert cfg.policy == {"decoupled": True} and cfg.mbs == 0
    # max_batch_size 1 in config.pbtxt: TensorRT-LLM's shapes (a batch dimension first); nothing else
    assert TritonLLMModel.auto_complete_config(FakeConfig(1)).mbs == 1
    with pytest.raises(ValueError, match="max_batch_size 8"):
        TritonLLMModel.auto_complete_config(FakeConfig(8))


@pytest.mark.parametrize("shape", [(1,), (1, 1)])
def test_scalar_inputs_shaped_as_vllm_backend_or_tensorrt_llm_parse_alike(shape):
    """vllm_backend's scalars are [1]; TensorRT-LLM's (Triton's OpenAI frontend, genai-perf's converter) [1, 1]."""
    def arr(value, dtype):
        return np.array(value, dtype=dtype).reshape(shape)

    batch = (1,) if len(shape) == 2 else ()
    inputs = {"max_tokens": arr(7, np.int32), "temperature": arr(0.5, np.float32), "stream": arr(True, np.bool_),
              "sampling_parameters": arr(b'{"ignore_eos": true}', np.object_),
              "input_ids": np.array([1, 2, 3], dtype=np.int32).reshape(batch + (3,)),
              "stop_words": np.array([b"a", b"b"], dtype=np.object_).reshape(batch + (2,))}
    req = parse_request(inputs, None)
    assert req.input_ids == [1, 2, 3] and req.stream
    assert parse_request({"text_input": arr(b"hi", np.object_)}, None).text == "hi"
    assert req.sampling == {"max_tokens": 7, "temperature": 0.5, "ignore_eos": True, "stop": ["a", "b"]}


@pytest.mark.parametrize("name, arr", [
    ("max_tokens", np.array([3, 4], dtype=np.int32)), ("max_tokens", np.array([[3, 4]], dtype=np.int32)),
    ("max_tokens", np.array([[3], [4]], dtype=np.int32)), ("max_tokens", np.array([[[3]]], dtype=np.int32)),
    ("max_tokens", np.array([], dtype=np.int32)), ("temperature", np.array([[0.5, 0.5]], dtype=np.float32)),
    ("stream", np.array([[True], [True]])), ("input_ids", np.array([[1, 2], [3, 4]], dtype=np.int32)),
    ("stop_words", np.array([[b"a"], [b"b"]], dtype=np.object_)),
])
def test_inputs_of_any_other_shape_are_refused_naming_the_input_and_its_shape(name, arr):
    inputs = {"text_input": np.array([b"hi"], dtype=np.object_), name: arr}
    if name == "input_ids":
        del inputs["text_input"]
    with pytest.raises(RequestError, match=rf"^{name}: .*got shape {re.escape(str(list(arr.shape)))}"):
        parse_request(inputs, None)


def test_every_sampling_input_reaches_the_sampling_fields_with_its_schema_type():
    values = {"max_tokens": 7, "min_tokens": 1, "top_k": 3, "temperature": 0.5, "top_p": 0.75,
              "presence_penalty": 0.25, "frequency_penalty": 0.5, "repetition_penalty": 1.5, "seed": 11}
    # TRT-LLM's names: min_length is min_tokens, random_seed seed, num_return_sequences n (tests/test_field_walk.py)
    assert set(values) | {"min_length", "random_seed", "num_return_sequences"} == set(schema.SAMPLING_INPUTS)
    tensors = {t.name(): t for t in build_inputs("hi", stream=False, **values)}
    for name in values:   # the client sends the schema's wire type
        assert tensors[name].datatype() == schema.LLM_INPUT[name].wire_type
    arrays = {name: np.array(v, dtype=schema.LLM_INPUT[name].np_dtype).reshape(1) for name, v in values.items()}
    arrays["text_input"] = np.array([b"hi"], dtype=np.object_)
    req = parse_request(arrays, None)
    assert req.sampling == values and req.text == "hi"
    arrays["min_length"] = np.array([1], dtype=np.int32)
    assert parse_request(arrays, None).sampling == values   # the same value under both names
    arrays["min_length"] = np.array([2], dtype=np.int32)
    with pytest.raises(RequestError, match="min_length and min_tokens"):
        parse_request(arrays, None)
    del arrays["min_tokens"]
    assert parse_request(arrays, None).sampling["min_tokens"] == 2


def test_outputs_use_the_schema_dtypes():
    class Flags:
        return_finish_reason = return_num_input_tokens = return_num_output_tokens = return_logprobs = True
        return_num_cached_tokens = True

    arrays = output_arrays("é", [1, 2], finish_reason="stop", num_input_tokens=3, num_output_tokens=2,
                           cumulative_logprob=-1.5, logprobs=[{"id": 1, "logprob": -0.5, "rank": 2, "top": [
                               {"id": 3, "logprob": -0.25}, {"id": 1, "logprob": -0.5}]}], flags=Flags,
                           prompt_logprobs=[{"id": 2, "logprob": None, "rank": None, "top": []}],
                           token_text=lambda i: f"<{i}>", num_cached_tokens=16)
    arrays = {**abort_token_arrays("t"), **arrays}
    assert [json.loads(x) for x in arrays["prompt_logprobs"]] == [
        {"id": 2, "logprob": None, "rank": None, "top": [], "decoded_token": "<2>"}]
    # vllm_backend's shape: one JSON list per response, the sampled token first, each token once
    assert json.loads(arrays["logprobs"][0]) == [{"1": {"logprob": -0.5, "rank": 2, "decoded_token": "<1>"},
                                                  "3": {"logprob": -0.25, "rank": 1, "decoded_token": "<3>"}}]
    assert set(arrays) | {"sequence_index"} == {f.name for f in schema.LLM_OUTPUTS}   # n > 1: added per choice
    for name, arr in arrays.items():
        assert arr.dtype == schema.LLM_OUTPUT[name].np_dtype
    assert arrays["text_output"][0].decode() == "é" and arrays["num_cached_tokens"].tolist() == [16]
