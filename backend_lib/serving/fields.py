"""Every request field of the Triton LLM dialects, ours and the peers', and what this server does with it.

The one catalogue behind docs/fields.md (`python -m backend_lib.serving.fields --write`; a test fails when
the page drifts) and behind tests/test_field_walk.py, which sends every field listed here and asserts
what the catalogue says: honoured (the parsed request differs from the same request without it), accepted
only with its neutral value, or refused with an error naming it. Nothing a peer documents is dropped in
silence: a name a client may send is either in our schema (schema.py, SamplingParams) or listed here with
the reason we refuse it.

Sources of the peer lists (read, not imported): vLLM's `SamplingParams` (vllm/sampling_params.py, current
and the older keys vllm_backend clients still send), vllm_backend's model inputs (src/model.py), and the
TensorRT-LLM backend's ensemble / tensorrt_llm_bls inputs (all_models/inflight_batcher_llm), which
Triton's OpenAI frontend and genai-perf send in their TensorRT-LLM mode.
"""
from __future__ import annotations

import argparse
from pathlib import Path

from ..contract.fields import NEUTRAL_KEYS, RANGES
from ..contract.structured import GUIDED_ALIASES, STRUCTURED_KEYS
from ..sampling.params import SamplingParams
from .schema import LLM_INPUTS

DOC_PATH = Path(__file__).resolve().parents[2] / "docs" / "fields.md"

# Our sampling keys (SamplingParams fields, vLLM's n, the structured-output keys): what each does. A test
# checks this covers exactly what the parser accepts, so a new key cannot go undocumented.
SAMPLING_DOCS: dict[str, str] = {
    "n": "choices of one prompt, 1..16 (one shared prefill; choice j seeded seed + j; each response carries "
         "`sequence_index`; without stream, one whole response per choice)",
    "max_tokens": "tokens to generate at most; beyond the context left after the prompt: an error (no clamp)",
    "min_tokens": "tokens before EOS / stop ids may end the sequence",
    "temperature": "softmax temperature; below 1e-5: greedy",
    "top_p": "nucleus probability mass, (0, 1]",
    "top_k": "sample among the k most likely (0 or vLLM's -1: off)",
    "min_p": "drop tokens below min_p x the top token's probability",
    "seed": "the request's own random generator (reproducible alone or batched)",
    "stop": "strings that end generation (not returned)",
    "stop_token_ids": "token ids that end generation",
    "ignore_eos": "keep generating past EOS",
    "logprobs": "the sampled token's logprob and its top-N alternatives (the `logprobs` output)",
    "prompt_logprobs": "every prompt token's logprob and top-N, from the prefill's own forward (the "
                       "`prompt_logprobs` output; such a request takes no cached prefix pages)",
    "presence_penalty": "penalty on tokens already generated, [-2, 2]",
    "frequency_penalty": "penalty per occurrence in the output, [-2, 2]",
    "repetition_penalty": "penalty on prompt and output tokens, > 0",
    "skip_special_tokens": "leave special tokens out of the text",
    "logit_bias": "`{token id: bias}`, bias in [-100, 100], at most 1,024 entries, in the sampler",
    "allowed_token_ids": "only these ids may be sampled",
    "bad_words": "words never generated (vLLM's token sequences, alone and after a space)",
    "cache_salt": "prefix caching: only requests with the same salt share cached pages",
    "priority": "with the model parameter `scheduling_policy: priority`: lower first, preempts higher values",
    "lora_name": "the LoRA adapter to run with (docs/lora.md)",
    "lora_path": "with `allow_runtime_lora`: where `lora_name` is loaded from on first use",
    "speculative": "with the model parameter `speculative_config`: `auto` (default; drafts verified exactly, the "
                   "output unchanged, paused while this request's acceptance stays low) or `off` (docs/speculative.md)",
    "structured_outputs": "vLLM's StructuredOutputsParams: one of json, regex, choice, grammar, json_object, "
                          "or this project's tool_calls; options disable_any_whitespace, whitespace_pattern "
                          "(JSON whitespace is bounded by default: docs/structured.md)",
    "guided_decoding": "vLLM's older name of structured_outputs",
    "guided_json": "structured_outputs.json (vLLM's older key)",
    "guided_regex": "structured_outputs.regex (vLLM's older key)",
    "guided_choice": "structured_outputs.choice (vLLM's older key)",
    "guided_grammar": "structured_outputs.grammar (vLLM's older key)",
    "guided_json_object": "structured_outputs.json_object (vLLM's older key)",
    "guided_decoding_backend": "accepted only as auto / guidance / llguidance (the engine is llguidance)",
    "guided_whitespace_pattern": "refused unless null: use structured_outputs.whitespace_pattern",
}

# vLLM SamplingParams fields (and request-level fields vLLM clients put beside them) that we refuse, with
# why. Sent with any value other than null they are an error naming them.
VLLM_REFUSED: dict[str, str] = {
    "prompt_logprob_token_ids": "scoring selected prompt rows is not implemented (prompt_logprobs scores all)",
    "prompt_logprob_start": "as prompt_logprob_token_ids",
    "logprob_token_ids": "logprobs of chosen ids are not implemented (logprobs: N gives the top N)",
    "flat_logprobs": "an engine-internal layout of vLLM's; our logprobs output has one shape",
    "output_kind": "a vLLM Python-API option; streaming sends deltas, non-streaming one response",
    "stream_interval": "every token is streamed as it is sampled",
    "skip_clone": "vLLM-internal",
    "extra_args": "no plugins read extra arguments",
    "skip_reading_prefix_cache": "not implemented (cache_salt keeps a request's pages apart)",
    "thinking_token_budget": "not implemented",
    "repetition_detection": "not implemented",
    "routed_experts_prompt_start": "Qwen3 dense models have no experts",
    "trace_decode_token_ids": "a debugging / RL option of vLLM's, not implemented",
}

# Model inputs (tensors) the peers declare that our models do not: Triton itself refuses a request
# carrying one ("unexpected inference input"), naming it; as HTTP generate JSON keys they become request
# parameters, which our parser refuses by name.
TENSOR_REFUSED: dict[str, str] = {
    # vllm_backend
    "multi_modal_data": "Qwen3 text models take no images",
    # TensorRT-LLM backend (ensemble / tensorrt_llm_bls)
    "decoder_text_input": "encoder-decoder models only",
    "image_input": "Qwen3 text models take no images",
    "end_id": "the checkpoint's EOS ids end generation; add others with stop_token_ids",
    "pad_id": "responses are not padded",
    "length_penalty": "beam search only (beam_width is 1)",
    "return_log_probs": "TensorRT-LLM's log-prob outputs are not served; use return_logprobs (vllm_backend's)",
    "return_context_logits": "logits are not returned (prompt_logprobs gives the prompt's logprobs)",
    "return_generation_logits": "logits are not returned (logprobs: N gives the top N)",
    "return_perf_metrics": "not implemented (Triton's metrics endpoint and the engine's log have them)",
    "prompt_embedding_table": "prompt tuning is not implemented",
    "prompt_vocab_size": "prompt tuning is not implemented",
    "embedding_bias_words": "use logit_bias (token ids) in sampling_parameters",
    "embedding_bias_weights": "use logit_bias (token ids) in sampling_parameters",
    "draft_input_ids": "draft tokens are not taken from clients: speculation is the model's own "
                       "(speculative_config, n-gram or draft-model drafts verified exactly; docs/speculative.md)",
    "draft_logits": "as draft_input_ids (client drafts are not taken)",
    "draft_acceptance_threshold": "as draft_input_ids; acceptance here is exact (a draft is kept iff it is the "
                                  "target's own token)",
    "num_draft_tokens": "as draft_input_ids (the model's speculative_config sets num_speculative_tokens)",
    "use_draft_logits": "as draft_input_ids (client drafts are not taken)",
    "lora_task_id": "TensorRT-LLM's LoRA cache; use lora_name (docs/lora.md)",
    "lora_weights": "TensorRT-LLM's LoRA cache; use lora_name (docs/lora.md)",
    "lora_config": "TensorRT-LLM's LoRA cache; use lora_name (docs/lora.md)",
}


def sampling_keys() -> set[str]:
    """Every key a sampling-parameters object may carry with any value."""
    return SamplingParams.names() | set(STRUCTURED_KEYS) | {"n"}


def _value_range(name: str) -> str:
    r = RANGES.get(name)
    return r.describe() if r is not None else ""


def markdown() -> str:
    lines = [
        "# Every request field",
        "",
        "<!-- generated by `python -m backend_lib.serving.fields --write` from backend_lib/serving/fields.py, "
        "schema.py and SamplingParams; tests/test_field_walk.py sends every field below and checks what it "
        "says -->",
        "",
        "Each field a client of vLLM, vllm_backend or the TensorRT-LLM backend may send to `qwen3_a8w8` / "
        "`qwen3_tq` is in one of the tables: honoured, accepted only with its neutral value, or refused with an "
        "`INVALID_ARG` naming it. Nothing is dropped in silence. The OpenAI front's bodies are listed with their "
        "types and ranges by the front itself, at `/docs` and `/openapi.json` ([OpenAI front](openai.md)); "
        "tests/test_front_field_walk.py walks every field of OpenAI's and vLLM's chat and completions bodies "
        "the same way (honoured, neutral-only, an identifier accepted unused, or a 400 naming it).",
        "",
        "## Input tensors",
        "",
        "Declared by the models (`backend_lib/serving/schema.py`); all optional. Scalar inputs are shaped `[1]` "
        "(vllm_backend's shapes); with `max_batch_size: 1` in the model's config.pbtxt they are `[1, 1]` and "
        "lists `[1, n]`, as TensorRT-LLM clients (Triton's OpenAI frontend in its TensorRT-LLM mode) send them "
        "(docs/wire.md).",
        "",
        "| input | type | what it does |",
        "|---|---|---|",
    ]
    for f in LLM_INPUTS:
        lines.append(f"| `{f.name}` | {f.wire_type} | {f.doc} |")
    lines += [
        "",
        "## Sampling fields",
        "",
        "In the `sampling_parameters` JSON (values may be strings, as vllm_backend clients send them), as a "
        "request parameter (HTTP `generate` puts JSON keys that are not inputs there), and, for the scalar "
        "ones, as input tensors. The same field in two places with different values is an error naming both.",
        "",
        "| field | range | what it does |",
        "|---|---|---|",
    ]
    for name in sorted(SAMPLING_DOCS):
        lines.append(f"| `{name}` | {_value_range(name)} | {SAMPLING_DOCS[name]} |")
    lines += [
        "",
        "## Accepted only with their neutral value",
        "",
        "vLLM keys that vllm_backend clients (Triton's OpenAI frontend among them) send by default. Any other "
        "value is an error naming the key.",
        "",
        "| field | accepted values |",
        "|---|---|",
    ]
    for name in sorted(NEUTRAL_KEYS):
        if name in SAMPLING_DOCS:
            continue
        vals = ", ".join(f"`{v!r}`" for v in NEUTRAL_KEYS[name]) or "`None`"
        lines.append(f"| `{name}` | {vals} or null |")
    lines += [
        "",
        "## Refused vLLM sampling fields",
        "",
        "| field | why |",
        "|---|---|",
    ]
    for name in sorted(VLLM_REFUSED):
        lines.append(f"| `{name}` | {VLLM_REFUSED[name]} |")
    lines += [
        "",
        "## Peers' inputs our models do not declare",
        "",
        "Sent as tensors, Triton refuses them by name before the model sees the request; sent as HTTP "
        "`generate` JSON keys or request parameters, the model refuses them by name.",
        "",
        "| input | why |",
        "|---|---|",
    ]
    for name in sorted(TENSOR_REFUSED):
        lines.append(f"| `{name}` | {TENSOR_REFUSED[name]} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--write", action="store_true", help=f"write {DOC_PATH.name} (else print it)")
    args = ap.parse_args(argv)
    text = markdown()
    if args.write:
        DOC_PATH.write_text(text)
        print(f"wrote {DOC_PATH}")
    else:
        print(text, end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
