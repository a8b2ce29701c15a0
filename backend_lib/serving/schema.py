"""The wire schema of the served models: every input and output, in one table.

Everything else reads this table: the LLM and tokenizer models declare their I/O from it in
`auto_complete_config` (so their config.pbtxt files hold only what an operator edits), request
parsing and response building go by it, the client builds tensors from it, and the ensembles'
config.pbtxt files are generated from it (`python -m backend_lib.serving.schema --write`; a test
fails when they drift). A new request field is one row here plus the code that uses it.
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

import numpy as np

# Triton config type -> (wire datatype of the client API, numpy dtype)
TYPES = {
    "TYPE_STRING": ("BYTES", np.object_),
    "TYPE_BOOL": ("BOOL", np.bool_),
    "TYPE_INT32": ("INT32", np.int32),
    "TYPE_UINT32": ("UINT32", np.uint32),
    "TYPE_UINT64": ("UINT64", np.uint64),
    "TYPE_FP32": ("FP32", np.float32),
}


@dataclass(frozen=True)
class Field:
    name: str
    type: str                  # Triton config type (TYPES)
    dims: tuple[int, ...]
    role: str                  # prompt | flag | sampling | json | stop | control | output
    doc: str

    @property
    def wire_type(self) -> str:
        return TYPES[self.type][0]

    @property
    def np_dtype(self):
        return TYPES[self.type][1]

    @property
    def py_type(self):
        """Python type of a scalar value of this field."""
        return {"TYPE_STRING": str, "TYPE_BOOL": bool, "TYPE_FP32": float}.get(self.type, int)

    def config(self, optional: bool) -> dict:
        entry = {"name": self.name, "data_type": self.type, "dims": list(self.dims)}
        if optional:
            entry["optional"] = True
        return entry


def _f(name, type_, dims, role, doc):
    return Field(name, type_, tuple(dims), role, doc)


# Inputs of the LLM models (qwen3_a8w8, qwen3_tq): both Triton LLM dialects (vLLM backend and TensorRT-LLM).
LLM_INPUTS: tuple[Field, ...] = (
    _f("text_input", "TYPE_STRING", [1], "prompt", "the prompt text"),
    _f("input_ids", "TYPE_INT32", [-1], "prompt", "the prompt as token ids (instead of text_input)"),
    _f("stream", "TYPE_BOOL", [1], "flag", "one response per token (true) or one response in all"),
    _f("sampling_parameters", "TYPE_STRING", [1], "json", "vLLM SamplingParams as a JSON object"),
    _f("max_tokens", "TYPE_INT32", [1], "sampling", "tokens to generate at most"),
    _f("min_tokens", "TYPE_INT32", [1], "sampling", "tokens to generate before EOS/stop ids may end"),
    _f("top_k", "TYPE_INT32", [1], "sampling", "sample among the k most likely tokens (0: all)"),
    _f("beam_width", "TYPE_INT32", [1], "control", "TensorRT-LLM beam width; only 1"),
    _f("temperature", "TYPE_FP32", [1], "sampling", "softmax temperature (below 1e-5: greedy)"),
    _f("top_p", "TYPE_FP32", [1], "sampling", "nucleus probability mass"),
    _f("presence_penalty", "TYPE_FP32", [1], "sampling", "penalty on tokens already generated"),
    _f("frequency_penalty", "TYPE_FP32", [1], "sampling", "penalty per occurrence in the output"),
    _f("repetition_penalty", "TYPE_FP32", [1], "sampling", "penalty on prompt and output tokens"),
    _f("seed", "TYPE_UINT64", [1], "sampling", "seed of the request's own random generator"),
    _f("stop_words", "TYPE_STRING", [-1], "stop", "strings that end generation (not returned)"),
    _f("exclude_input_in_output", "TYPE_BOOL", [1], "flag",
       "non-streaming: return only the generated text (false with stream is an error, as vllm_backend)"),
    _f("return_finish_reason", "TYPE_BOOL", [1], "flag", "add finish_reason"),
    _f("return_num_input_tokens", "TYPE_BOOL", [1], "flag", "add num_input_tokens"),
    _f("return_num_output_tokens", "TYPE_BOOL", [1], "flag", "add num_output_tokens"),
    _f("return_logprobs", "TYPE_BOOL", [1], "flag", "add cumulative_logprob and per-token logprobs"),
    _f("return_cumulative_logprob", "TYPE_BOOL", [1], "flag", "add cumulative_logprob (vllm_backend)"),
    _f("return_num_cached_tokens", "TYPE_BOOL", [1], "flag",
       "add num_cached_tokens (the prompt tokens served from the prefix cache)"),
    _f("min_length", "TYPE_INT32", [1], "sampling", "TensorRT-LLM's name for min_tokens"),
    _f("random_seed", "TYPE_UINT64", [1], "sampling", "TensorRT-LLM's name for seed"),
    _f("num_return_sequences", "TYPE_INT32", [1], "sampling", "TensorRT-LLM's name for n (choices, 1..16)"),
    _f("bad_words", "TYPE_STRING", [-1], "stop", "words never generated (vLLM's bad_words; TensorRT-LLM's tensor)"),
    _f("guided_decoding_guide_type", "TYPE_STRING", [1], "guide",
       "TensorRT-LLM's guided decoding: json, json_schema or regex (structured_outputs json_object, json, regex)"),
    _f("guided_decoding_guide", "TYPE_STRING", [1], "guide",
       "the schema (json_schema) or the regex (regex) of guided_decoding_guide_type"),
    _f("return_abort_token", "TYPE_BOOL", [1], "flag",
       "streaming: the first response (sent at admission, before any token) carries abort_token, the "
       "capability that aborts this request"),
    _f("abort_request_id", "TYPE_STRING", [1], "abort",
       "with abort_token and nothing else: abort the running request of this Triton request id (it ends with "
       "finish_reason 'abort'); a clean alternative to cancelling a gRPC stream"),
    _f("abort_token", "TYPE_STRING", [1], "abort",
       "the abort_token of the request named by abort_request_id (returned to its sender alone)"),
)

LLM_OUTPUTS: tuple[Field, ...] = (
    _f("text_output", "TYPE_STRING", [-1], "output", "new text (streaming) or the whole text"),
    _f("output_ids", "TYPE_INT32", [-1], "output", "new token ids"),
    _f("finish_reason", "TYPE_STRING", [-1], "output", "stop | length | cancelled | abort (last response)"),
    _f("num_input_tokens", "TYPE_UINT32", [1], "output", "prompt tokens"),
    _f("num_cached_tokens", "TYPE_UINT32", [1], "output", "prompt tokens served from the prefix cache"),
    _f("num_output_tokens", "TYPE_UINT32", [-1], "output",
       "tokens in this response (vllm_backend: the count since the previous response)"),
    _f("cumulative_logprob", "TYPE_FP32", [-1], "output", "sum of the chosen tokens' logprobs"),
    _f("logprobs", "TYPE_STRING", [-1], "output",
       "vllm_backend's shape: one JSON list per response, per new token {token id: {logprob, rank, "
       "decoded_token}} (the token, then its top-N alternatives)"),
    _f("abort_token", "TYPE_STRING", [-1], "output",
       "return_abort_token: the request's abort capability, in its first response only"),
    _f("sequence_index", "TYPE_INT32", [1], "output",
       "n > 1: the choice this response belongs to (0..n-1), as TensorRT-LLM's num_return_sequences"),
    _f("prompt_logprobs", "TYPE_STRING", [-1], "output",
       "sampling_parameters.prompt_logprobs: per prompt token, JSON {id, logprob, rank, top: [{id, logprob}]} "
       "(the first token's logprob and rank null), in the first response with a token"),
)

# Inputs and outputs of the tokenizer model (qwen3_tokenizer), the first step of the ensembles.
TOKENIZER_INPUTS: tuple[Field, ...] = (
    _f("text_input", "TYPE_STRING", [1], "prompt", "the prompt text"),
    _f("messages", "TYPE_STRING", [1], "prompt", "chat messages: a JSON list of {role, content, ...}"),
    _f("tools", "TYPE_STRING", [1], "json", "chat: OpenAI function tools (JSON list) for the chat template"),
    _f("enable_thinking", "TYPE_BOOL", [1], "flag", "Qwen3 chat template: think before answering"),
    _f("add_generation_prompt", "TYPE_BOOL", [1], "flag", "end the rendered chat with the assistant's turn"),
)
TOKENIZER_OUTPUTS: tuple[Field, ...] = (
    _f("input_ids", "TYPE_INT32", [-1], "output", "prompt token ids"),
)

# The embedding model (qwen3_embed, task embed; not decoupled, dynamically batched): one text or id list per
# request, its vector out. It tokenizes itself: an embedding checkpoint's tokenizer appends its own end token and
# its prompts are named by the checkpoint (config_sentence_transformers.json), not by qwen3_tokenizer's chat template.
EMBED_INPUTS: tuple[Field, ...] = (
    _f("text_input", "TYPE_STRING", [1], "prompt", "the text to embed"),
    _f("input_ids", "TYPE_INT32", [-1], "prompt", "the text as token ids (instead of text_input), taken as they are"),
    _f("prompt_name", "TYPE_STRING", [1], "control",
       "a prompt of the checkpoint's config_sentence_transformers.json (Qwen3-Embedding: query, document) put "
       "before text_input; default: its default_prompt_name, else none"),
    _f("dimensions", "TYPE_INT32", [1], "control", "keep the first N dimensions, renormalized (matryoshka)"),
)
EMBED_OUTPUTS: tuple[Field, ...] = (
    _f("embedding", "TYPE_FP32", [-1], "output", "the vector (L2-normalized when the checkpoint normalizes)"),
    _f("num_input_tokens", "TYPE_UINT32", [1], "output", "tokens embedded"),
)
# The rerank model (qwen3_rerank, task rerank: a Qwen3-Reranker checkpoint): one (query, document) pair
# per request, its relevance out (P(yes) under the model card's prompt, backend_lib/embedding/rerank_prompt.py).
RERANK_INPUTS: tuple[Field, ...] = (
    _f("query", "TYPE_STRING", [1], "prompt", "the query"),
    _f("document", "TYPE_STRING", [1], "prompt", "the document to judge"),
    _f("instruction", "TYPE_STRING", [1], "control",
       "the task's instruction in the prompt (default: web search: retrieve relevant passages)"),
)
RERANK_OUTPUTS: tuple[Field, ...] = (
    _f("score", "TYPE_FP32", [1], "output", "relevance in (0, 1): softmax over the [no, yes] logits, P(yes)"),
    _f("num_input_tokens", "TYPE_UINT32", [1], "output", "tokens of the filled-in prompt"),
)

LLM_INPUT = {f.name: f for f in LLM_INPUTS}
LLM_OUTPUT = {f.name: f for f in LLM_OUTPUTS}
FLAG_INPUTS = tuple(f.name for f in LLM_INPUTS if f.role == "flag")
SAMPLING_INPUTS = tuple(f.name for f in LLM_INPUTS if f.role == "sampling")


def declare(auto_complete_model_config, inputs, outputs):
    """auto_complete_config body: declares the given fields (all inputs optional)."""
    for f in inputs:
        auto_complete_model_config.add_input(f.config(optional=True))
    for f in outputs:
        auto_complete_model_config.add_output(f.config(optional=False))
    return auto_complete_model_config


# ----- ensembles: tokenizer -> LLM, generated from the table ----------------------------------------
ENSEMBLES = {"qwen3_a8w8_ensemble": "qwen3_a8w8", "qwen3_tq_ensemble": "qwen3_tq"}
TOKENIZER_MODEL = "qwen3_tokenizer"


def ensemble_inputs() -> tuple[Field, ...]:
    """The tokenizer's inputs, then every LLM input but the prompt ones (the tokenizer makes input_ids) and
    the abort control (an abort goes to the LLM model directly)."""
    return TOKENIZER_INPUTS + tuple(f for f in LLM_INPUTS if f.role not in ("prompt", "abort"))


def _io_block(kind: str, fields, optional: bool) -> str:
    rows = []
    for f in fields:
        opt = ", optional: true" if optional else ""
        dims = ", ".join(str(d) for d in f.dims)
        rows.append(f'  {{ name: "{f.name}", data_type: {f.type}, dims: [ {dims} ]{opt} }}')
    return f"{kind} [\n" + ",\n".join(rows) + "\n]\n"


def ensemble_config(name: str, llm: str) -> str:
    """The config.pbtxt text of one ensemble."""
    tok_maps = "\n".join(f'      input_map {{ key: "{f.name}", value: "{f.name}" }}' for f in TOKENIZER_INPUTS)
    llm_fields = [f for f in LLM_INPUTS if f.role not in ("prompt", "abort")]
    llm_maps = "\n".join(['      input_map { key: "input_ids", value: "_input_ids" }'] +
                         [f'      input_map {{ key: "{f.name}", value: "{f.name}" }}' for f in llm_fields])
    out_maps = "\n".join(f'      output_map {{ key: "{f.name}", value: "{f.name}" }}' for f in LLM_OUTPUTS)
    return (
        f"# GENERATED by `python -m backend_lib.serving.schema --write` from backend_lib/serving/schema.py:\n"
        f"# edit the schema, not this file (tests/test_schema.py fails when they differ).\n"
        f"# {TOKENIZER_MODEL} -> {llm}, streaming through the ensemble. The LLM step returns text itself\n"
        f"# (an incremental detokenizer per request), so streamed text never breaks spaces or UTF-8 characters.\n"
        f'name: "{name}"\nplatform: "ensemble"\nmax_batch_size: 0\n\n'
        + _io_block("input", ensemble_inputs(), True) + _io_block("output", LLM_OUTPUTS, False) +
        "\nensemble_scheduling {\n  step [\n    {\n"
        f'      model_name: "{TOKENIZER_MODEL}"\n      model_version: -1\n{tok_maps}\n'
        '      output_map { key: "input_ids", value: "_input_ids" }\n    },\n    {\n'
        f'      model_name: "{llm}"\n      model_version: -1\n{llm_maps}\n{out_maps}\n    }}\n  ]\n}}\n')


def write_ensembles(repository: Path) -> list[Path]:
    written = []
    for name, llm in ENSEMBLES.items():
        path = Path(repository) / name / "config.pbtxt"
        path.write_text(ensemble_config(name, llm))
        written.append(path)
    return written


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--write", action="store_true", help="(re)write the ensembles' config.pbtxt files")
    ap.add_argument("--repository", default=str(Path(__file__).resolve().parents[2] / "model_repository"))
    args = ap.parse_args(argv)
    if args.write:
        for path in write_ensembles(Path(args.repository)):
            print(f"wrote {path}")
    else:
        for f in LLM_INPUTS + LLM_OUTPUTS:
            print(f"{f.name:28s} {f.wire_type:7s} {str(list(f.dims)):6s} {f.doc}")


if __name__ == "__main__":
    main()
