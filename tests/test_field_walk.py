"""Every documented request field of vLLM's, vllm_backend's and the TensorRT-LLM backend's request shapes,
sent to the Triton path's parser: honoured (the request it builds differs from the same request without
the field), accepted only with its neutral value, or refused with an error naming it; never dropped.

The field lists come from backend_lib/serving/fields.py (the catalogue behind docs/fields.md) and from the
peers' own lists written out below; each peer name must be in our schema or in the catalogue's refused
tables, so a field the peers document and we forget to decide on fails here.
"""
from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from backend_lib.contract.errors import RequestError
from backend_lib.contract.fields import NEUTRAL_KEYS, SamplingLimits
from backend_lib.sampling.params import SamplingParams
from backend_lib.serving import fields
from backend_lib.serving.request import parse_request
from backend_lib.serving.schema import LLM_INPUT

VOCAB = 151936

# vLLM's SamplingParams fields (vllm/sampling_params.py, 2026) and the older keys vllm_backend clients send.
VLLM_SAMPLING_PARAMS = (
    "n", "presence_penalty", "frequency_penalty", "repetition_penalty", "temperature", "top_p", "top_k", "min_p",
    "seed", "stop", "stop_token_ids", "ignore_eos", "max_tokens", "min_tokens", "logprobs", "prompt_logprobs",
    "prompt_logprob_token_ids", "prompt_logprob_start", "logprob_token_ids", "flat_logprobs", "detokenize",
    "skip_special_tokens", "spaces_between_special_tokens", "include_stop_str_in_output", "output_kind",
    "stream_interval", "skip_clone", "structured_outputs", "logit_bias", "allowed_token_ids", "extra_args",
    "bad_words", "skip_reading_prefix_cache", "thinking_token_budget", "repetition_detection",
    "routed_experts_prompt_start", "trace_decode_token_ids",
    # older vLLM releases / vllm_backend clients
    "best_of", "use_beam_search", "length_penalty", "early_stopping", "truncate_prompt_tokens",
    "logits_processors", "guided_decoding", "guided_json", "guided_regex", "guided_choice", "guided_grammar",
    "guided_json_object", "guided_decoding_backend", "guided_whitespace_pattern",
    # request-level fields of vLLM that vllm_backend reads from sampling_parameters
    "lora_name", "priority", "cache_salt",
)
# vllm_backend's inputs (src/model.py) and the TensorRT-LLM backend's ensemble / BLS inputs.
VLLM_BACKEND_INPUTS = ("text_input", "stream", "sampling_parameters", "exclude_input_in_output",
                       "return_finish_reason", "return_cumulative_logprob", "return_logprobs",
                       "return_num_input_tokens", "return_num_output_tokens", "multi_modal_data")
TRTLLM_INPUTS = ("text_input", "decoder_text_input", "image_input", "max_tokens", "bad_words", "stop_words",
                 "end_id", "pad_id", "top_k", "top_p", "temperature", "length_penalty", "repetition_penalty",
                 "min_length", "presence_penalty", "frequency_penalty", "random_seed", "return_log_probs",
                 "return_context_logits", "return_generation_logits", "beam_width", "stream",
                 "prompt_embedding_table", "prompt_vocab_size", "embedding_bias_words", "embedding_bias_weights",
                 "num_draft_tokens", "use_draft_logits", "draft_input_ids", "draft_logits",
                 "draft_acceptance_threshold", "exclude_input_in_output", "num_return_sequences",
                 "lora_task_id", "lora_weights", "lora_config", "guided_decoding_guide_type",
                 "guided_decoding_guide", "return_perf_metrics")

# A value other than the default for every sampling key, so that an honoured key must change the request.
SAMPLES = {
    "n": 3, "presence_penalty": 0.5, "frequency_penalty": -0.5, "repetition_penalty": 1.2, "temperature": 0.7,
    "top_p": 0.9, "top_k": 5, "min_p": 0.1, "seed": 7, "stop": ["x"], "stop_token_ids": [5], "ignore_eos": True,
    "max_tokens": 9, "min_tokens": 2, "logprobs": 2, "prompt_logprobs": 1, "prompt_logprob_token_ids": [1],
    "prompt_logprob_start": 1, "logprob_token_ids": [1], "flat_logprobs": True, "detokenize": False,
    "skip_special_tokens": False, "spaces_between_special_tokens": False, "include_stop_str_in_output": True,
    "output_kind": 1, "stream_interval": 2, "skip_clone": True, "structured_outputs": {"regex": "[ab]+"},
    "logit_bias": {"5": 3.0}, "allowed_token_ids": [5, 6], "extra_args": {"a": 1}, "bad_words": ["no"],
    "skip_reading_prefix_cache": True, "thinking_token_budget": 10,
    "repetition_detection": {"max_pattern_size": 3, "min_count": 3}, "routed_experts_prompt_start": 1,
    "trace_decode_token_ids": [1, 2], "best_of": 2, "use_beam_search": True, "length_penalty": 0.5,
    "early_stopping": True, "truncate_prompt_tokens": 5, "logits_processors": ["x"],
    "guided_decoding": {"choice": ["a", "b"]}, "guided_json": {"type": "object"}, "guided_regex": "[0-9]+",
    "guided_choice": ["a", "b"], "guided_grammar": 'start: "a"', "guided_json_object": True,
    "guided_decoding_backend": "xgrammar", "guided_whitespace_pattern": " ?", "lora_name": "sql",
    "lora_path": "/adapters/sql", "priority": 3, "cache_salt": "tenant-a",
}
STREAM = {"stream": np.array([True])}   # n > 1 and abort tokens need a stream: every walk streams


def _status(name: str) -> str:
    if name in fields.SAMPLING_DOCS and name not in ("guided_decoding_backend", "guided_whitespace_pattern"):
        return "honoured"
    if name in NEUTRAL_KEYS or name in ("guided_decoding_backend", "guided_whitespace_pattern"):
        return "neutral"
    assert name in fields.VLLM_REFUSED, f"{name}: a vLLM field neither in our schema nor in the refused table"
    return "refused"


def _snapshot(req) -> dict:
    """What the engine gets from a parsed request: its flags and its validated SamplingParams."""
    params = SamplingParams.from_dict(dict(req.sampling)).validate(SamplingLimits(), VOCAB)
    out = {k: v for k, v in dataclasses.asdict(req).items() if k not in ("sampling", "given_flags")}
    out["params"] = repr(params)
    return out


def _parse(sampling: dict | None = None, parameters: dict | None = None, **tensors):
    inputs = {"text_input": np.array([b"hello"], dtype=object), **STREAM, **tensors}
    if sampling is not None:
        inputs["sampling_parameters"] = np.array([json.dumps(sampling).encode()], dtype=object)
    return _snapshot(parse_request(inputs, json.dumps(parameters) if parameters is not None else None))


BASELINE = None


def _baseline():
    global BASELINE
    if BASELINE is None:
        BASELINE = _parse()
    return BASELINE


def test_the_catalogue_covers_exactly_what_the_parser_takes():
    assert set(fields.SAMPLING_DOCS) == fields.sampling_keys(), (
        "every key the parser accepts with any value is documented in fields.SAMPLING_DOCS, and nothing else")
    assert not set(fields.VLLM_REFUSED) & fields.sampling_keys()
    assert not set(fields.TENSOR_REFUSED) & set(LLM_INPUT)


def test_docs_fields_page_is_generated_from_the_catalogue():
    assert fields.DOC_PATH.read_text() == fields.markdown(), (
        "docs/fields.md is stale: python -m backend_lib.serving.fields --write")


@pytest.mark.parametrize("carrier", ["sampling_parameters", "parameters"])
@pytest.mark.parametrize("name", VLLM_SAMPLING_PARAMS + ("lora_path",))
def test_every_vllm_sampling_field_is_honoured_or_refused_by_name(name, carrier):
    value = SAMPLES[name]
    send = {"sampling": {name: value}} if carrier == "sampling_parameters" else {"parameters": {name: value}}
    status = _status(name)
    if status == "honoured":
        assert _parse(**send) != _baseline(), f"{carrier}.{name} = {value!r} changed nothing: dropped"
        return
    with pytest.raises(RequestError) as e:
        _parse(**send)
    assert name in str(e.value), f"{carrier}.{name}: the error does not name the field: {e.value}"
    if status == "neutral":
        neutral = NEUTRAL_KEYS.get(name, (None,))
        for v in neutral or (None,):
            assert _parse(**{k: {name: v} for k in send}) == _baseline(), f"{name} = {v!r} is its neutral value"


@pytest.mark.parametrize("name", sorted(set(VLLM_BACKEND_INPUTS + TRTLLM_INPUTS)))
def test_every_peer_input_is_ours_or_refused_by_name(name):
    """A peer's tensor we do not declare is refused by Triton itself (an unexpected input, named); the same
    name as an HTTP generate JSON key or request parameter reaches the model, which must refuse it by name."""
    if name in LLM_INPUT or name in fields.sampling_keys():
        return   # ours: its behaviour is walked by the tests of the sampling fields and the flags
    assert name in fields.TENSOR_REFUSED, f"{name}: a peer input neither in our schema nor in the refused table"
    with pytest.raises(RequestError) as e:
        _parse(parameters={name: 7})   # 7: not the neutral value of any key (length_penalty's is 1)
    assert name in str(e.value)


@pytest.mark.parametrize("flag", [f.name for f in LLM_INPUT.values() if f.role == "flag"])
def test_every_flag_changes_the_request_as_tensor_and_as_parameter(flag):
    value = flag != "stream"   # stream defaults to on in this walk: send it off
    if flag == "exclude_input_in_output":   # true is what a stream does anyway: a change only when not streaming
        base = _snapshot(parse_request({"text_input": np.array([b"hello"], dtype=object)}, None))
        got = _snapshot(parse_request({"text_input": np.array([b"hello"], dtype=object),
                                       flag: np.array([True])}, None))
        assert got != base
        return
    assert _parse(**{flag: np.array([value])}) != _baseline()
    if flag == "stream":   # the walk's stream tensor is on: a parameter saying otherwise is a conflict
        with pytest.raises(RequestError, match="stream: given in the request parameters"):
            _parse(parameters={flag: value})
        inputs = {"text_input": np.array([b"hello"], dtype=object)}
        assert _snapshot(parse_request(inputs, json.dumps({"stream": True}))) == _baseline()
        return
    assert _parse(parameters={flag: value}) != _baseline()


@pytest.mark.parametrize("name", [f.name for f in LLM_INPUT.values() if f.role == "sampling"])
def test_every_sampling_tensor_changes_the_request(name):
    f = LLM_INPUT[name]
    value = {"max_tokens": 9, "min_tokens": 2, "min_length": 2, "top_k": 5, "seed": 7, "random_seed": 7,
             "num_return_sequences": 3}.get(name, 0.5)
    arr = np.array([value], dtype=f.np_dtype)
    assert _parse(**{name: arr}) != _baseline(), f"input tensor {name} changed nothing: dropped"


def _strings(*values):
    return np.array([v.encode() for v in values], dtype=object)


def test_trt_llm_names_mean_what_vllm_names_mean():
    """random_seed is seed, num_return_sequences is n, the bad_words tensor is bad_words, and TensorRT-LLM's
    guided decoding inputs are structured_outputs: the same request as the vLLM spelling, shaped [1] or
    [1, 1] (TensorRT-LLM clients send a batch dimension)."""
    same = [
        (dict(random_seed=np.array([7], dtype=np.uint64)), {"seed": 7}),
        (dict(random_seed=np.array([[7]], dtype=np.uint64)), {"seed": 7}),
        (dict(num_return_sequences=np.array([3], dtype=np.int32)), {"n": 3}),
        (dict(bad_words=_strings("no", "never")), {"bad_words": ["no", "never"]}),
        (dict(bad_words=np.array([[b"no", b"never"]], dtype=object)), {"bad_words": ["no", "never"]}),
        (dict(guided_decoding_guide_type=_strings("json")), {"structured_outputs": {"json_object": True}}),
        (dict(guided_decoding_guide_type=_strings("regex"), guided_decoding_guide=_strings("[ab]+")),
         {"structured_outputs": {"regex": "[ab]+"}}),
        (dict(guided_decoding_guide_type=np.array([[b"json_schema"]], dtype=object),
              guided_decoding_guide=np.array([[b'{"type": "object"}']], dtype=object)),
         {"structured_outputs": {"json": {"type": "object"}}}),
    ]
    for tensors, sampling in same:
        assert _parse(**tensors) == _parse(sampling=sampling) != _baseline(), tensors


@pytest.mark.parametrize("tensors, field", [
    (dict(random_seed=np.array([7], dtype=np.uint64), seed=np.array([8], dtype=np.uint64)), "seed"),
    (dict(num_return_sequences=np.array([17], dtype=np.int32)), "num_return_sequences"),
    (dict(num_return_sequences=np.array([0], dtype=np.int32)), "num_return_sequences"),
    (dict(guided_decoding_guide_type=_strings("ebnf_grammar"), guided_decoding_guide=_strings("root ::= x")),
     "guided_decoding_guide_type"),
    (dict(guided_decoding_guide=_strings("[ab]+")), "guided_decoding_guide"),
    (dict(guided_decoding_guide_type=_strings("regex")), "guided_decoding_guide"),
    (dict(guided_decoding_guide_type=_strings("json_schema"), guided_decoding_guide=_strings("{not json")),
     "guided_decoding_guide"),
    (dict(guided_decoding_guide_type=_strings("json"), guided_decoding_guide=_strings("{}")),
     "guided_decoding_guide"),
    (dict(bad_words=np.array([[b"a"], [b"b"]], dtype=object)), "bad_words"),
])
def test_trt_llm_inputs_refused_name_the_input(tensors, field):
    with pytest.raises(RequestError) as e:
        _parse(**tensors)
    assert field in str(e.value)
