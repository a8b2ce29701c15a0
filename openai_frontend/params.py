"""OpenAI request bodies -> a validated Generation: the prompt and the Triton LLM request fields.

Errors are 400s whose message and `param` name the field. Every number is range-checked here by the
engine's own table (backend_lib.sampling.params.RANGES), before any tensor is built, so that none can wrap
when cast to its wire type (int32, uint64, fp32). Checks that depend on the model (its max_tokens limit,
prompt length, the vocabulary) are left to the LLM model, whose errors name the field too.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field

from backend_lib.sampling.params import (INT32_MAX, NEUTRAL_KEYS, RequestError, SamplingLimits, check_logit_bias,
                                        check_number)
from backend_lib.sampling.structured import GUIDED_ALIASES, StructuredSpec
from client.triton_inputs import build_inputs
from .errors import bad_request
from .tools import ToolRequest, parse_tools

ROLES = ("system", "user", "assistant", "tool")
MAX_LOGPROBS = SamplingLimits().max_logprobs   # the LLM models' limit, checked here to name top_logprobs


MAX_N = 16              # choices per prompt (n)
MAX_CHOICES = 256       # prompts x n in one request


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
        with several prompts passes each in `prompt`). Choice j > 0 of a seeded request gets seed + j (as
        vLLM derives its n > 1 children's seeds), so a seeded request is reproducible."""
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
            fields["seed"] = (fields["seed"] + choice) % 2**64
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


# ----- typed field readers (None when absent or null) -----------------------------------------------
def _checked(body: dict, name: str, table: str | None = None):
    """body[name] range-checked by the engine's table (RANGES[table or name]), so that no value can wrap
    when cast to its wire type; a 400 naming `name` otherwise."""
    table = table or name
    try:
        return check_number(table, body.get(name))
    except RequestError as exc:
        message = str(exc)
        if table != name and message.startswith(table):
            message = name + message[len(table):]
        raise bad_request(message, name) from None


def _token_id(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= INT32_MAX


def _boolean(body: dict, name: str):
    v = body.get(name)
    if v is not None and not isinstance(v, bool):
        raise bad_request(f"{name} must be a boolean, got {v!r}", name)
    return v


def _same(value, allowed) -> bool:
    """value == allowed, where a boolean equals only a boolean (True is not n=1, 0 is not echo=false)."""
    if isinstance(value, bool) or isinstance(allowed, bool):
        return type(value) is type(allowed) and value == allowed
    return value == allowed


def _neutral_only(body: dict, name: str, allowed: tuple, why: str | None = None) -> None:
    """400 for a field we do not implement, unless it is absent, null or one of its neutral `allowed` values."""
    v = body.get(name)
    if v is None or any(_same(v, a) for a in allowed):
        return
    if why is None:
        why = (f"only {' or '.join(json.dumps(a) for a in allowed)} is supported" if allowed
               else "is not supported (only null)")
    raise bad_request(f"{name}: {why}, got {json.dumps(v)}", name)


# vLLM/OpenAI fields accepted only with their neutral value, beyond the engine's NEUTRAL_KEYS
FRONT_NEUTRAL = {"suffix": ("",)}
FRONT_OWN = ("n", "prompt_logprobs")   # NEUTRAL_KEYS of the engine that the front implements itself


def _neutral_fields(body: dict) -> None:
    for name, allowed in {**NEUTRAL_KEYS, **FRONT_NEUTRAL}.items():
        if name not in FRONT_OWN:
            _neutral_only(body, name, allowed)


# ----- shared fields ------------------------------------------------------------------------------
def _model(body: dict) -> str:
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad_request("model: a model name is required", "model")
    return model


def _stop(body: dict) -> list[str] | None:
    stop = body.get("stop")
    if stop is None:
        return None
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
        raise bad_request("stop must be a string or a list of strings", "stop")
    return [s for s in stop if s] or None


def _streaming(gen: Generation, body: dict) -> None:
    gen.stream = bool(_boolean(body, "stream"))
    opts = body.get("stream_options")
    if opts is None:
        return
    if not isinstance(opts, dict):
        raise bad_request("stream_options must be an object", "stream_options")
    if not gen.stream:
        raise bad_request("stream_options is only allowed when stream is true", "stream_options")
    unknown = sorted(set(opts) - {"include_usage", "continuous_usage_stats"})
    if unknown:
        raise bad_request(f"stream_options.{unknown[0]}: unknown field", "stream_options")
    gen.include_usage = bool(_boolean(opts, "include_usage"))
    gen.continuous_usage = bool(_boolean(opts, "continuous_usage_stats"))


# scalar Triton tensors named as in OpenAI/vLLM, each checked by RANGES[name]
_SCALARS = ("temperature", "top_p", "seed", "presence_penalty", "frequency_penalty", "repetition_penalty",
            "top_k", "min_tokens")


def _sampling(gen: Generation, body: dict, max_tokens_names: tuple[str, ...]) -> None:
    _neutral_fields(body)
    given = {}
    for name in max_tokens_names:
        value = _checked(body, name, "max_tokens")
        if value is not None:
            given[name] = value
    if len(set(given.values())) > 1:   # OpenAI deprecated max_tokens for max_completion_tokens: one meaning
        raise bad_request(f"{' and '.join(given)} differ ({', '.join(str(v) for v in given.values())}); "
                          "send one of them", next(iter(given)))
    if given:
        gen.fields["max_tokens"] = next(iter(given.values()))
    if body.get("top_k") == -1 and not isinstance(body.get("top_k"), bool):
        body = {**body, "top_k": 0}   # vLLM's "disabled"
    for name in _SCALARS:
        value = _checked(body, name)
        if value is not None:
            gen.fields[name] = value
    priority = _checked(body, "priority")   # vLLM: with the model's scheduling_policy priority, lower first
    if priority is not None:
        gen.sampling["priority"] = priority
    min_p = _checked(body, "min_p")   # no tensor of its own: sampling_parameters
    if min_p is not None:
        gen.sampling["min_p"] = min_p
    if _boolean(body, "ignore_eos") is not None:
        gen.sampling["ignore_eos"] = body["ignore_eos"]
    salt = body.get("cache_salt")   # vLLM: requests with different salts never share cached KV pages
    if salt is not None:
        if not isinstance(salt, str) or not salt or len(salt) > 256:
            raise bad_request("cache_salt must be a non-empty string of at most 256 characters", "cache_salt")
        gen.sampling["cache_salt"] = salt
    stop_ids = body.get("stop_token_ids")
    if stop_ids is not None:
        if not isinstance(stop_ids, list) or not all(_token_id(i) for i in stop_ids):
            raise bad_request(f"stop_token_ids must be a list of token ids, integers in [0, {INT32_MAX}]",
                              "stop_token_ids")
        gen.sampling["stop_token_ids"] = stop_ids
    gen.stop = _stop(body)
    _token_masks(gen, body)


LIMITS = SamplingLimits()


def _token_masks(gen: Generation, body: dict) -> None:
    """logit_bias (OpenAI), allowed_token_ids and bad_words (vLLM): checked for shape and range here (the
    vocabulary is the model's check), passed in sampling_parameters."""
    raw = body.get("logit_bias")
    try:
        bias = check_logit_bias(None if raw == [] else raw, None, LIMITS.max_logit_bias)
    except RequestError as exc:
        raise bad_request(str(exc), "logit_bias") from None
    if bias:
        gen.sampling["logit_bias"] = {str(k): v for k, v in bias.items()}
    allowed = body.get("allowed_token_ids")
    if allowed is not None:
        if not isinstance(allowed, list) or not allowed or not all(_token_id(i) for i in allowed):
            raise bad_request(f"allowed_token_ids must be a non-empty list of token ids, integers in [0, {INT32_MAX}]",
                              "allowed_token_ids")
        gen.sampling["allowed_token_ids"] = allowed
    words = body.get("bad_words")
    if words is not None:
        if not isinstance(words, list) or not all(isinstance(w, str) for w in words):
            raise bad_request("bad_words must be a list of strings", "bad_words")
        if len(words) > LIMITS.max_bad_words or any(len(w) > LIMITS.max_bad_word_len for w in words):
            raise bad_request(f"bad_words: at most {LIMITS.max_bad_words} words of at most "
                              f"{LIMITS.max_bad_word_len} characters", "bad_words")
        if words:
            gen.sampling["bad_words"] = words


def _response_format(body: dict) -> dict | None:
    """OpenAI's response_format as a structured_outputs constraint (None: free text)."""
    rf = body.get("response_format")
    if rf is None:
        return None
    if not isinstance(rf, dict) or rf.get("type") not in ("text", "json_object", "json_schema"):
        raise bad_request("response_format.type must be text, json_object or json_schema", "response_format")
    unknown = sorted(set(rf) - {"type", "json_schema"})
    if unknown:
        raise bad_request(f"response_format: unknown field(s) {', '.join(unknown)}", "response_format")
    if rf["type"] == "text":
        return None
    if rf["type"] == "json_object":
        return {"json_object": True}
    js = rf.get("json_schema")
    if not isinstance(js, dict) or not isinstance(js.get("name", ""), str) or set(js) - {
            "name", "description", "schema", "strict"}:
        raise bad_request("response_format.json_schema must be {name, description, schema, strict}",
                          "response_format")
    schema = js.get("schema", {})
    if not isinstance(schema, dict):
        raise bad_request("response_format.json_schema.schema must be a JSON schema object", "response_format")
    return {"json": schema}


def _structured(gen: Generation, body: dict, forced: dict | None = None) -> None:
    """response_format, vLLM's structured_outputs and guided_* keys, and a forced tool call (`forced`, a
    `tool_calls` constraint), into the one structured_outputs constraint the engine compiles (its errors name
    the field)."""
    so = body.get("structured_outputs")
    guided = {k: body[k] for k in (*GUIDED_ALIASES, "guided_decoding_backend", "guided_whitespace_pattern")
              if body.get(k) is not None}
    constraint = _response_format(body)
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


# Every field a request may carry; anything else is a 400 naming it (nothing silently ignored). Fields we
# do not implement are in NEUTRAL_KEYS / FRONT_NEUTRAL (accepted only with their neutral value).
_METADATA = ("user", "metadata", "safety_identifier", "prompt_cache_key", "request_id")   # identify, do nothing
_SHARED_FIELDS = {"model", "stream", "stream_options", "max_tokens", "temperature", "top_p", "top_k", "min_p",
                  "seed", "presence_penalty", "frequency_penalty", "repetition_penalty", "min_tokens",
                  "ignore_eos", "cache_salt", "stop", "stop_token_ids", "logprobs", "response_format",
                  "structured_outputs", "guided_decoding_backend", "guided_whitespace_pattern",
                  "skip_special_tokens", "logit_bias", "allowed_token_ids", "bad_words", "prompt_logprobs",
                  "priority", *GUIDED_ALIASES,
                  *_METADATA, *NEUTRAL_KEYS}
COMPLETION_FIELDS = _SHARED_FIELDS | {"prompt", "echo", "suffix"}
CHAT_FIELDS = _SHARED_FIELDS | {"messages", "max_completion_tokens", "top_logprobs", "chat_template_kwargs",
                                "tools", "tool_choice", "parallel_tool_calls", "include_reasoning",
                                "add_generation_prompt", "continue_final_message", "add_special_tokens",
                                "store", "service_tier", "modalities", "n"}
CHAT_NEUTRAL = {"add_generation_prompt": (True,), "continue_final_message": (False,),
                "add_special_tokens": (False,), "store": (False,), "service_tier": ("auto", "default"),
                "modalities": (["text"],)}


def known_fields(body, known: set[str]) -> None:
    """A request body is an object whose every field is in `known`: else a 400 naming the first other one (the
    rule of every endpoint of the front)."""
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    unknown = sorted(k for k in body if k not in known)
    if unknown:
        raise bad_request(f"{unknown[0]}: unknown or unsupported field", unknown[0])


def _known_fields(body: dict, known: set[str]) -> None:
    known_fields(body, known)
    for name in _METADATA:
        v = body.get(name)
        if v is not None and not isinstance(v, (str, dict)):
            raise bad_request(f"{name} must be a string", name)


def _common(body, max_tokens_names: tuple[str, ...], known: set[str]) -> Generation:
    _known_fields(body, known)
    gen = Generation(model=_model(body))
    _streaming(gen, body)
    _sampling(gen, body, max_tokens_names)
    gen.n = _n(body)
    gen.prompt_logprobs = _logprobs(body, "prompt_logprobs")
    if gen.prompt_logprobs is not None and gen.stream:
        raise bad_request("prompt_logprobs: not available with stream true (as vLLM)", "prompt_logprobs")
    skip = _boolean(body, "skip_special_tokens")
    if skip is not None:
        gen.sampling["skip_special_tokens"] = skip
    return gen


def _n(body: dict) -> int:
    n = body.get("n")
    if n is None:
        return 1
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_N:
        raise bad_request(f"n must be an integer in [1, {MAX_N}], got {json.dumps(n)}", "n")
    return n


# ----- completions ----------------------------------------------------------------------------------
def _is_ids(value) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(i, int) and not isinstance(i, bool)
                                                            for i in value)


def _one_prompt(prompt, where: str):
    if isinstance(prompt, str):
        if not prompt:
            raise bad_request(f"{where} must not be empty", "prompt")
        return prompt
    if _is_ids(prompt):
        bad = next((i for i in prompt if not _token_id(i)), None)
        if bad is not None:   # int32 on the wire; the vocabulary check is the model's
            raise bad_request(f"{where}: token id {bad} is outside [0, {INT32_MAX}]", "prompt")
        return prompt
    raise bad_request("prompt is required: a string, a list of token ids, or a list of either", "prompt")


def _prompt(gen: Generation, body: dict) -> None:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt) and not _is_ids(prompt):
        if len(prompt) * gen.n > MAX_CHOICES:
            raise bad_request(f"prompt: {len(prompt)} prompts x n {gen.n} choices exceed {MAX_CHOICES} choices "
                              "per request", "prompt")
        gen.prompts = [_one_prompt(p, f"prompt[{i}]") for i, p in enumerate(prompt)]
    else:
        gen.prompts = [_one_prompt(prompt, "prompt")]
    first = gen.prompts[0]
    if isinstance(first, str):
        gen.prompt = first
    else:
        gen.prompt_ids = first


def _logprobs(body: dict, name: str) -> int | None:
    value = _checked(body, name, "logprobs")
    if value is not None and value > MAX_LOGPROBS:
        raise bad_request(f"{name} must be between 0 and {MAX_LOGPROBS}, got {value}", name)
    return value


def parse_completion(body) -> Generation:
    gen = _common(body, ("max_tokens",), COMPLETION_FIELDS)
    _prompt(gen, body)
    gen.logprobs = _logprobs(body, "logprobs")
    gen.echo = bool(_boolean(body, "echo"))
    _structured(gen, body)
    return gen


# ----- chat -----------------------------------------------------------------------------------------
def _content(content, where: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"{where}.content must be a string or a list of text parts", "messages")
    texts = []
    for j, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise bad_request(f"{where}.content[{j}]: only text parts are supported", "messages")
        texts.append(part["text"])
    return "\n".join(texts)


def _messages(body: dict) -> list[dict]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad_request("messages is required: a non-empty list of {role, content} objects", "messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise bad_request(f"messages[{i}] must be an object with role and content", "messages")
        role = "system" if m.get("role") == "developer" else m.get("role")
        if role not in ROLES:
            raise bad_request(f"messages[{i}].role: {m.get('role')!r} is not one of "
                              f"{', '.join(ROLES + ('developer',))}", "messages")
        unknown = sorted(set(m) - MESSAGE_FIELDS)
        if unknown:
            raise bad_request(f"messages[{i}].{unknown[0]}: unknown field", "messages")
        msg = {"role": role, "content": _content(m.get("content"), f"messages[{i}]")}
        refusal = m.get("refusal")
        if refusal is not None:   # what the assistant said when it refused: its content for the template
            if role != "assistant" or not isinstance(refusal, str) or msg["content"]:
                raise bad_request(f"messages[{i}].refusal: only an assistant message without content may carry "
                                  "a refusal (a string)", "messages")
            msg["content"] = refusal
        reasoning = [m[k] for k in ("reasoning_content", "reasoning") if m.get(k) is not None]
        if len(reasoning) == 2 and reasoning[0] != reasoning[1]:
            raise bad_request(f"messages[{i}]: reasoning and reasoning_content differ; send one of them", "messages")
        if reasoning:   # current vLLM names it `reasoning`, older clients `reasoning_content`
            msg["reasoning_content"] = reasoning[0]
        for key in ("name", "tool_call_id"):   # checked by the tokenizer model
            if m.get(key) is not None:
                msg[key] = m[key]
        if m.get("tool_calls"):
            msg["tool_calls"] = m["tool_calls"]
        out.append(msg)
    return out


MESSAGE_FIELDS = {"role", "content", "name", "tool_calls", "tool_call_id", "reasoning_content", "refusal",
                  "reasoning"}


def _chat_logprobs(body: dict) -> int | None:
    top = _logprobs(body, "top_logprobs")
    if not _boolean(body, "logprobs"):
        if top is not None:
            raise bad_request("top_logprobs requires logprobs to be true", "top_logprobs")
        return None
    return top or 0


def _enable_thinking(body: dict) -> bool | None:
    kwargs = body.get("chat_template_kwargs")
    if kwargs is None:
        return None
    if not isinstance(kwargs, dict):
        raise bad_request("chat_template_kwargs must be an object", "chat_template_kwargs")
    unknown = sorted(set(kwargs) - {"enable_thinking"})
    if unknown:
        raise bad_request(f"chat_template_kwargs.{unknown[0]}: not supported (only enable_thinking)",
                          "chat_template_kwargs")
    return _boolean(kwargs, "enable_thinking")


def parse_chat(body) -> Generation:
    gen = _common(body, ("max_tokens", "max_completion_tokens"), CHAT_FIELDS)
    for name, allowed in CHAT_NEUTRAL.items():
        _neutral_only(body, name, allowed)
    gen.messages = _messages(body)
    gen.logprobs = _chat_logprobs(body)
    gen.enable_thinking = _enable_thinking(body)
    gen.tools = parse_tools(body)
    include = _boolean(body, "include_reasoning")
    gen.include_reasoning = include is not False
    _structured(gen, body, gen.tools.constraint() if gen.tools is not None else None)
    return gen
