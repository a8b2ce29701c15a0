"""Validated chat and completions requests (protocol.py's models) -> a Generation: the prompt and the Triton
LLM request fields.

The models check every field (types, the engine's ranges, what goes together); what is left here is the
mapping to Triton's inputs, and the one check that needs the structured-output engine's rules: how
response_format, structured_outputs, the guided_* keys and a forced tool call make one constraint. Errors are
400s whose message and `param` name the field.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from backend_lib.contract.choices import choice_seed
from backend_lib.contract.errors import RequestError
from backend_lib.contract.structured import GUIDED_ALIASES, StructuredSpec
from client.triton_inputs import build_inputs
from .errors import bad_request
from .protocol import (ChatCompletionRequest, ChatMessage, ChatTemplateKwargs, CompletionRequest, ResponseFormat,
                       validated)
from .tools import ToolRequest, tool_request


@dataclass
class Generation:
    model: str
    stream: bool = False
    include_usage: bool = False
    continuous_usage: bool = False       # stream_options.continuous_usage_stats: usage on every chunk
    prompt: str | None = None            # completions: text prompt (the first of `prompts`)
    prompt_ids: list[int] | None = None  # completions: token-id prompt (the first of `prompts`)
    prompts: list = field(default_factory=list)   # completions: every prompt (str or ids), one or more
    messages: list[dict] | None = None   # chat: rendered by the tokenizer model
    enable_thinking: bool | None = None
    fields: dict = field(default_factory=dict)    # Triton scalar tensors (max_tokens, temperature, ...)
    sampling: dict = field(default_factory=dict)  # Triton sampling_parameters JSON
    stop: list[str] | None = None
    logprobs: int | None = None          # top-N alternatives per token; None: no logprobs
    tools: ToolRequest | None = None     # chat: tools for the template, and whether calls are parsed
    include_reasoning: bool = True       # chat: vLLM's include_reasoning (False drops reasoning_content)
    n: int = 1                           # choices per prompt
    echo: bool = False                   # completions: the prompt (and its logprobs) before the text
    prompt_logprobs: int | None = None   # vLLM: the prompt tokens' logprobs in the response

    def triton_inputs(self, input_ids: list[int] | None = None, prompt=None, choice: int = 0) -> list:
        """Input tensors of the streaming LLM request (chat passes the tokenizer model's ids; a completion
        with several prompts passes each in `prompt`). Choice j > 0 of a seeded request gets its own seed
        (backend_lib.contract.choices.choice_seed: seed + j), so a seeded request is reproducible."""
        if prompt is None:
            prompt = self.prompt if self.prompt is not None else self.prompt_ids
        ids = input_ids if input_ids is not None else (prompt if isinstance(prompt, list) else None)
        sampling = dict(self.sampling)
        if self.logprobs is not None:
            sampling["logprobs"] = self.logprobs
        wanted = [k for k in (self.prompt_logprobs, self.logprobs if self.echo else None) if k is not None]
        if wanted:
            sampling["prompt_logprobs"] = max(wanted)
        fields = dict(self.fields)
        if choice and fields.get("seed") is not None:
            fields["seed"] = choice_seed(fields["seed"], choice)
        return build_inputs(None if ids is not None else prompt, ids, stream=True,
                            sampling_parameters=sampling or None, stop_words=self.stop,
                            return_finish_reason=True, return_num_input_tokens=True, return_abort_token=True,
                            return_num_cached_tokens=True,
                            return_logprobs=self.logprobs is not None or None,
                            **fields)

    def choices(self) -> list:
        """(prompt, choice number) of every choice, in `index` order: prompt i's choice j is i * n + j."""
        prompts = self.prompts or [None]
        return [(p, j) for p in prompts for j in range(self.n)]


# scalar Triton tensors named as in OpenAI/vLLM
_SCALARS = ("temperature", "top_p", "seed", "presence_penalty", "frequency_penalty", "repetition_penalty",
            "top_k", "min_tokens")
# sampling_parameters keys passed as they are (no tensor of their own)
_SAMPLING = ("priority", "min_p", "ignore_eos", "cache_salt", "stop_token_ids", "allowed_token_ids",
             "skip_special_tokens")


def _common(req: ChatCompletionRequest | CompletionRequest, max_tokens: int | None) -> Generation:
    gen = Generation(model=req.model, stream=bool(req.stream), n=req.n or 1, prompt_logprobs=req.prompt_logprobs)
    if req.stream_options is not None:
        gen.include_usage = bool(req.stream_options.include_usage)
        gen.continuous_usage = bool(req.stream_options.continuous_usage_stats)
    if max_tokens is not None:
        gen.fields["max_tokens"] = max_tokens
    for name in _SCALARS:
        value = getattr(req, name)
        if value is not None:
            gen.fields[name] = 0 if name == "top_k" and value == -1 else value   # vLLM's -1: off
    for name in _SAMPLING:
        value = getattr(req, name)
        if value is not None:
            gen.sampling[name] = value
    if req.logit_bias:
        gen.sampling["logit_bias"] = req.logit_bias
    if req.bad_words:
        gen.sampling["bad_words"] = req.bad_words
    stop = [req.stop] if isinstance(req.stop, str) else req.stop
    gen.stop = [s for s in stop or [] if s] or None
    return gen


def _response_format(rf: ResponseFormat | None) -> dict | None:
    """OpenAI's response_format as a structured_outputs constraint (None: free text)."""
    if rf is None or rf.type == "text":
        return None
    if rf.type == "json_object":
        return {"json_object": True}
    return {"json": rf.json_schema.schema_ if rf.json_schema.schema_ is not None else {}}


def _structured(gen: Generation, req: ChatCompletionRequest | CompletionRequest, forced: dict | None = None) -> None:
    """response_format, vLLM's structured_outputs and guided_* keys, and a forced tool call (`forced`, a
    `tool_calls` constraint), into the
    one structured_outputs constraint the engine compiles (its errors name the field)."""
    so = req.structured_outputs.model_dump(exclude_unset=True, by_alias=True) \
        if req.structured_outputs is not None else None
    guided = {k: getattr(req, k) for k in (*GUIDED_ALIASES, "guided_decoding_backend", "guided_whitespace_pattern")
              if getattr(req, k) is not None}
    constraint = _response_format(req.response_format)
    if forced is not None:
        if constraint is not None:
            raise bad_request("response_format cannot be combined with tool_choice required or a named function",
                              "response_format")
        constraint = forced
    if constraint is None:
        if so is not None:
            gen.sampling["structured_outputs"] = so
        gen.sampling.update(guided)
        return
    aliases = [k for k in guided if k in GUIDED_ALIASES]
    if aliases:
        raise bad_request(f"{aliases[0]}: one constraint per request (response_format or tools given)", aliases[0])
    gen.sampling.update(guided)   # guided_decoding_backend / guided_whitespace_pattern: the engine checks them
    options = {}
    if so is not None:   # only options (disable_any_whitespace, whitespace_pattern) may come with it
        try:
            opts = StructuredSpec.options_only(so, "structured_outputs")
        except RequestError as exc:
            raise bad_request(str(exc), "structured_outputs") from None
        options = {"disable_any_whitespace": opts["compact"], "whitespace_pattern": opts["whitespace"]}
        if "tool_calls" in constraint and (opts["compact"] or opts["whitespace"]):
            raise bad_request("structured_outputs: whitespace options do not apply to tool calls",
                              "structured_outputs")
    gen.sampling["structured_outputs"] = {**constraint, **{k: v for k, v in options.items() if v}}


# ----- completions ----------------------------------------------------------------------------------
def completion_generation(req: CompletionRequest) -> Generation:
    gen = _common(req, req.max_tokens)
    prompt = req.prompt
    gen.prompts = prompt if isinstance(prompt, list) and not isinstance(prompt[0], int) else [prompt]
    first = gen.prompts[0]
    if isinstance(first, str):
        gen.prompt = first
    else:
        gen.prompt_ids = first
    gen.logprobs = req.logprobs
    gen.echo = bool(req.echo)
    _structured(gen, req)
    return gen


def parse_completion(body) -> Generation:
    """A /v1/completions body (parsed JSON) as a Generation, or the 400 naming the field."""
    return completion_generation(validated(CompletionRequest, body))


# ----- chat -----------------------------------------------------------------------------------------
def chat_messages(messages: list[ChatMessage]) -> list[dict]:
    """The messages as the tokenizer model's template takes them: developer is system, text parts joined, a
    refusal is the content, reasoning (current vLLM) or reasoning_content (older clients) the thinking."""
    out = []
    for m in messages:
        content = m.content if isinstance(m.content, str) else "\n".join(p.text for p in m.content or [])
        msg = {"role": "system" if m.role == "developer" else m.role, "content": m.refusal or content}
        reasoning = m.reasoning if m.reasoning is not None else m.reasoning_content
        if reasoning is not None:
            msg["reasoning_content"] = reasoning
        for key in ("name", "tool_call_id"):
            if getattr(m, key) is not None:
                msg[key] = getattr(m, key)
        if m.tool_calls:
            msg["tool_calls"] = [c.model_dump(exclude_unset=True) for c in m.tool_calls]
        out.append(msg)
    return out


def enable_thinking(kwargs: ChatTemplateKwargs | None) -> bool | None:
    return kwargs.enable_thinking if kwargs is not None else None


def chat_generation(req: ChatCompletionRequest) -> Generation:
    gen = _common(req, req.max_tokens if req.max_tokens is not None else req.max_completion_tokens)
    gen.messages = chat_messages(req.messages)
    gen.logprobs = (req.top_logprobs or 0) if req.logprobs else None
    gen.enable_thinking = enable_thinking(req.chat_template_kwargs)
    gen.tools = tool_request(req.tools, req.tool_choice, req.parallel_tool_calls)
    gen.include_reasoning = req.include_reasoning is not False
    _structured(gen, req, gen.tools.constraint() if gen.tools is not None else None)
    return gen


def parse_chat(body) -> Generation:
    """A /v1/chat/completions body (parsed JSON) as a Generation, or the 400 naming the field."""
    return chat_generation(validated(ChatCompletionRequest, body))
