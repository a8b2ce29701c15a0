"""Every documented field of OpenAI's and vLLM's chat and completions request bodies, sent to the front's
parser (protocol.py's models, then the Generation it builds for Triton): honoured (the Generation differs from
the same body without the field), accepted only with its neutral value (any other is a 400 naming it),
accepted as an identifier we do not use (listed below with why), or refused with a 400 naming it. Nothing
else: a field the peers document that we forget to decide on fails here. No server: the Generation is what
the front sends to Triton (tests/test_openai_server.py drives the same fields end to end).
"""
from __future__ import annotations

import dataclasses

import pytest

from openai_frontend.errors import APIError
from openai_frontend.params import chat_generation, completion_generation
from openai_frontend.protocol import ChatCompletionRequest, CompletionRequest, validated

# OpenAI's chat.completions.create parameters (2026) and vLLM's extra ChatCompletionRequest fields
OPENAI_CHAT = ("messages", "model", "audio", "frequency_penalty", "function_call", "functions", "logit_bias",
               "logprobs", "max_completion_tokens", "max_tokens", "metadata", "modalities", "n",
               "parallel_tool_calls", "prediction", "presence_penalty", "prompt_cache_key", "prompt_cache_retention",
               "reasoning_effort", "response_format", "safety_identifier", "seed", "service_tier", "stop", "store",
               "stream", "stream_options", "temperature", "tool_choice", "tools", "top_logprobs", "top_p", "user",
               "verbosity", "web_search_options")
VLLM_CHAT = ("best_of", "use_beam_search", "top_k", "min_p", "repetition_penalty", "length_penalty",
             "stop_token_ids", "include_stop_str_in_output", "ignore_eos", "min_tokens", "skip_special_tokens",
             "spaces_between_special_tokens", "truncate_prompt_tokens", "prompt_logprobs", "allowed_token_ids",
             "bad_words", "echo", "add_generation_prompt", "continue_final_message", "add_special_tokens",
             "documents", "chat_template", "chat_template_kwargs", "mm_processor_kwargs", "structured_outputs",
             "guided_json", "guided_regex", "guided_choice", "guided_grammar", "guided_json_object",
             "structural_tag", "guided_decoding_backend", "guided_whitespace_pattern", "priority", "request_id",
             "logits_processors", "return_tokens_as_token_ids", "return_token_ids", "cache_salt",
             "kv_transfer_params", "vllm_xargs", "include_reasoning", "early_stopping", "detokenize")
# OpenAI's completions.create parameters and vLLM's extra CompletionRequest fields
OPENAI_COMPLETIONS = ("model", "prompt", "best_of", "echo", "frequency_penalty", "logit_bias", "logprobs",
                      "max_tokens", "n", "presence_penalty", "seed", "stop", "stream", "stream_options", "suffix",
                      "temperature", "top_p", "user")
VLLM_COMPLETIONS = ("use_beam_search", "top_k", "min_p", "repetition_penalty", "length_penalty", "stop_token_ids",
                    "include_stop_str_in_output", "ignore_eos", "min_tokens", "skip_special_tokens",
                    "spaces_between_special_tokens", "truncate_prompt_tokens", "allowed_token_ids", "prompt_logprobs",
                    "add_special_tokens", "response_format", "structured_outputs", "guided_json", "guided_regex",
                    "guided_choice", "guided_grammar", "guided_decoding_backend", "guided_whitespace_pattern",
                    "priority", "request_id", "logits_processors", "return_tokens_as_token_ids", "return_token_ids",
                    "cache_salt", "kv_transfer_params", "vllm_xargs", "prompt_embeds", "bad_words", "early_stopping",
                    "detokenize")

# Identifiers a client sends about itself that change nothing an inference server does: accepted (refusing
# them breaks the SDKs and frameworks that always send them), documented in /openapi.json as unused.
IDENTIFIERS = {"user", "metadata", "safety_identifier", "prompt_cache_key", "request_id"}

TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object",
                                                                       "properties": {"a": {"type": "string"}}}}}]
# field -> (value, what else the body needs for the value to be valid)
SAMPLES = {
    "model": ("other", {}), "messages": ([{"role": "user", "content": "bye"}], {}), "prompt": ("bye", {}),
    "stream": (False, {}), "stream_options": ({"include_usage": True}, {}),
    "max_tokens": (9, {}), "max_completion_tokens": (9, {}), "n": (3, {}), "temperature": (0.5, {}),
    "top_p": (0.5, {}), "top_k": (5, {}), "min_p": (0.1, {}), "seed": (7, {}), "presence_penalty": (0.5, {}),
    "frequency_penalty": (0.5, {}), "repetition_penalty": (1.2, {}), "min_tokens": (2, {}),
    "ignore_eos": (True, {}), "cache_salt": ("s", {}), "stop": (["x"], {}), "stop_token_ids": ([5], {}),
    "logit_bias": ({"5": 3}, {}), "allowed_token_ids": ([5, 6], {}), "bad_words": (["no"], {}),
    "skip_special_tokens": (False, {}), "priority": (2, {}), "prompt_logprobs": (1, {"stream": False}),
    "structured_outputs": ({"regex": "[ab]+"}, {}), "guided_json": ({"type": "object"}, {}),
    "guided_regex": ("[ab]+", {}), "guided_choice": (["a", "b"], {}), "guided_grammar": ('start: "a"', {}),
    "guided_json_object": (True, {}), "guided_decoding_backend": ("llguidance", {}),
    "guided_whitespace_pattern": (" ?", {}), "response_format": ({"type": "json_object"}, {}),
    "logprobs": (True, {}), "top_logprobs": (2, {"logprobs": True}), "echo": (True, {}),
    "tools": (TOOLS, {}), "tool_choice": ("required", {"tools": TOOLS}),
    "parallel_tool_calls": (False, {"tools": TOOLS, "tool_choice": "required"}),
    "chat_template_kwargs": ({"enable_thinking": False}, {}), "include_reasoning": (False, {}),
}
# a value no neutral-only field takes as neutral
NOT_NEUTRAL = {"best_of": 2, "use_beam_search": True, "length_penalty": 0.5, "early_stopping": True,
               "logits_processors": ["x"], "include_stop_str_in_output": True, "detokenize": False,
               "spaces_between_special_tokens": False, "truncate_prompt_tokens": 5, "add_generation_prompt": False,
               "continue_final_message": True, "add_special_tokens": True, "store": True, "service_tier": "flex",
               "modalities": ["audio"], "suffix": "x"}

CHAT = (ChatCompletionRequest, chat_generation, {"model": "m", "messages": [{"role": "user", "content": "hi"}],
                                                 "stream": True})
COMPLETION = (CompletionRequest, completion_generation, {"model": "m", "prompt": "hi", "stream": True})


def _generation(kind, body) -> dict:
    model, build, _ = kind
    gen = build(validated(model, body))
    return dataclasses.asdict(gen)


def _neutral_only(model, name: str) -> bool:
    f = model.model_fields.get(name)
    return f is not None and any(type(m).__name__ == "WithJsonSchema" for m in f.metadata)


def _cases():
    for label, kind, names in (("chat", CHAT, OPENAI_CHAT + VLLM_CHAT),
                               ("completions", COMPLETION, OPENAI_COMPLETIONS + VLLM_COMPLETIONS)):
        for name in sorted(set(names)):
            yield pytest.param(kind, name, id=f"{label}-{name}")


@pytest.mark.parametrize("kind, name", list(_cases()))
def test_every_documented_field_is_honoured_neutral_or_refused_by_name(kind, name):
    model, _, base = kind
    declared = {f.alias or n for n, f in model.model_fields.items()}
    if name not in declared:   # refused: the one 400, naming it
        with pytest.raises(APIError) as e:
            _generation(kind, {**base, name: NOT_NEUTRAL.get(name, 1)})
        assert e.value.status == 400 and e.value.param == name, (name, e.value.message)
        return
    if name in IDENTIFIERS:
        assert "unused" in model.model_fields[name].description   # and /openapi.json says so
        assert _generation(kind, {**base, name: {"k": "v"} if name == "metadata" else "abc"}) == \
            _generation(kind, base)
        return
    if _neutral_only(model, name):
        with pytest.raises(APIError) as e:
            _generation(kind, {**base, name: NOT_NEUTRAL[name]})
        assert e.value.status == 400 and e.value.param == name, (name, e.value.message)
        return
    assert name in SAMPLES, f"{name}: honoured by the front's model, but this walk has no value to send for it"
    value, needs = SAMPLES[name]
    if model is CompletionRequest and name == "logprobs":   # the legacy API's logprobs is the top-N count
        value = 2
    before = {**base, **needs}
    assert _generation(kind, {**before, name: value}) != _generation(kind, before), \
        f"{name} = {value!r} changed nothing the front sends to Triton: dropped"


@pytest.mark.parametrize("kind", [CHAT, COMPLETION], ids=["chat", "completions"])
def test_every_field_of_our_models_is_walked(kind):
    """The other direction: a field our model declares is one the peers document (or ours, listed here)."""
    model, _, _ = kind
    # vLLM's older key, kept beside its siblings; chat's identifiers, shared by both bodies
    ours = {"guided_json_object", "metadata", "prompt_cache_key", "safety_identifier"}
    names = set(OPENAI_CHAT + VLLM_CHAT if model is ChatCompletionRequest else OPENAI_COMPLETIONS + VLLM_COMPLETIONS)
    declared = {f.alias or n for n, f in model.model_fields.items()}
    assert declared - names - ours == set()
