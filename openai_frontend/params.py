"""OpenAI request bodies -> a validated Generation: the prompt and the Triton LLM request fields.

Errors are 400s whose message and `param` name the field. Every number is range-checked here by the
engine's own table (backend_lib.sampling.params.RANGES), before any tensor is built, so that none can wrap
when cast to its wire type (int32, uint64, fp32). Checks that depend on the model (its max_tokens limit,
prompt length, the vocabulary) are left to the LLM model, whose errors name the field too.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field

from backend_lib.sampling.params import INT32_MAX, NEUTRAL_KEYS, RequestError, SamplingLimits, check_number
from client.triton_inputs import build_inputs
from .errors import bad_request

ROLES = ("system", "user", "assistant", "tool")
MAX_LOGPROBS = SamplingLimits().max_logprobs   # the LLM models' limit, checked here to name top_logprobs


@dataclass
class Generation:
    model: str
    stream: bool = False
    include_usage: bool = False
    prompt: str | None = None            # completions: text prompt
    prompt_ids: list[int] | None = None  # completions: token-id prompt
    messages: list[dict] | None = None   # chat: rendered by the tokenizer model
    enable_thinking: bool | None = None
    fields: dict = field(default_factory=dict)    # Triton scalar tensors (max_tokens, temperature, ...)
    sampling: dict = field(default_factory=dict)  # Triton sampling_parameters JSON
    stop: list[str] | None = None
    logprobs: int | None = None          # top-N alternatives per token; None: no logprobs

    def triton_inputs(self, input_ids: list[int] | None = None) -> list:
        """Input tensors of the streaming LLM request (chat passes the tokenizer model's ids)."""
        ids = input_ids if input_ids is not None else self.prompt_ids
        sampling = dict(self.sampling)
        if self.logprobs is not None:
            sampling["logprobs"] = self.logprobs
        return build_inputs(None if ids is not None else self.prompt, ids, stream=True,
                            sampling_parameters=sampling or None, stop_words=self.stop,
                            return_finish_reason=True, return_num_input_tokens=True,
                            return_logprobs=self.logprobs is not None or None,
                            **self.fields)


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
FRONT_NEUTRAL = {"logit_bias": ({}, []), "echo": (False,), "suffix": ("",)}


def _neutral_fields(body: dict) -> None:
    for name, allowed in {**NEUTRAL_KEYS, **FRONT_NEUTRAL}.items():
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
    gen.include_usage = bool(_boolean(opts, "include_usage"))


# scalar Triton tensors named as in OpenAI/vLLM, each checked by RANGES[name]
_SCALARS = ("temperature", "top_p", "seed", "presence_penalty", "frequency_penalty", "repetition_penalty",
            "top_k", "min_tokens")


def _sampling(gen: Generation, body: dict, max_tokens_names: tuple[str, ...]) -> None:
    _neutral_fields(body)
    for name in max_tokens_names:
        value = _checked(body, name, "max_tokens")
        if value is not None:
            gen.fields["max_tokens"] = value
    if body.get("top_k") == -1 and not isinstance(body.get("top_k"), bool):
        body = {**body, "top_k": 0}   # vLLM's "disabled"
    for name in _SCALARS:
        value = _checked(body, name)
        if value is not None:
            gen.fields[name] = value
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


def _common(body, max_tokens_names: tuple[str, ...]) -> Generation:
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    gen = Generation(model=_model(body))
    _streaming(gen, body)
    _sampling(gen, body, max_tokens_names)
    return gen


# ----- completions ----------------------------------------------------------------------------------
def _is_ids(value) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(i, int) and not isinstance(i, bool)
                                                            for i in value)


def _prompt(gen: Generation, body: dict) -> None:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and (isinstance(prompt[0], str) or _is_ids(prompt[0])):
        prompt = prompt[0]   # a batch of exactly one prompt
    if isinstance(prompt, str):
        if not prompt:
            raise bad_request("prompt must not be empty", "prompt")
        gen.prompt = prompt
    elif _is_ids(prompt):
        bad = next((i for i in prompt if not _token_id(i)), None)
        if bad is not None:   # int32 on the wire; the vocabulary check is the model's
            raise bad_request(f"prompt: token id {bad} is outside [0, {INT32_MAX}]", "prompt")
        gen.prompt_ids = prompt
    elif isinstance(prompt, list) and len(prompt) > 1 and all(isinstance(p, str) or _is_ids(p) for p in prompt):
        raise bad_request(f"prompt: only one prompt per request is supported, got {len(prompt)}", "prompt")
    else:
        raise bad_request("prompt is required: a string, or a list of token ids", "prompt")


def _logprobs(body: dict, name: str) -> int | None:
    value = _checked(body, name, "logprobs")
    if value is not None and value > MAX_LOGPROBS:
        raise bad_request(f"{name} must be between 0 and {MAX_LOGPROBS}, got {value}", name)
    return value


def parse_completion(body) -> Generation:
    gen = _common(body, ("max_tokens",))
    _prompt(gen, body)
    gen.logprobs = _logprobs(body, "logprobs")
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
        out.append({"role": role, "content": _content(m.get("content"), f"messages[{i}]")})
    return out


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
    return _boolean(kwargs, "enable_thinking")


def parse_chat(body) -> Generation:
    gen = _common(body, ("max_tokens", "max_completion_tokens"))
    gen.messages = _messages(body)
    gen.logprobs = _chat_logprobs(body)
    gen.enable_thinking = _enable_thinking(body)
    _neutral_only(body, "tools", ([],), "(tool calling) is not supported")
    return gen
