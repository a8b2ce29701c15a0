"""OpenAI request bodies -> a validated Generation: the prompt and the Triton LLM request fields.

Errors are 400s whose message and `param` name the field. Range checks that depend on the model
(max_tokens and logprobs limits, prompt length) are left to the LLM model, whose errors name the field too.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from ..triton_inputs import build_inputs
from .errors import bad_request

ROLES = ("system", "user", "assistant", "tool")
MAX_LOGPROBS = 20


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
def _number(body: dict, name: str, lo: float | None = None, hi: float | None = None, lo_open: bool = False):
    v = body.get(name)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise bad_request(f"{name} must be a finite number, got {v!r}", name)
    if (lo is not None and (v <= lo if lo_open else v < lo)) or (hi is not None and v > hi):
        if hi is None:
            bound = f"{'>' if lo_open else '>='} {lo}"
        else:
            bound = f"in {'(' if lo_open else '['}{lo}, {hi}]"
        raise bad_request(f"{name} must be {bound}, got {v}", name)
    return float(v)


def _integer(body: dict, name: str, lo: int | None = None, hi: int | None = None):
    v = body.get(name)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int):
        raise bad_request(f"{name} must be an integer, got {v!r}", name)
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        bound = f">= {lo}" if hi is None else f"between {lo} and {hi}"
        raise bad_request(f"{name} must be {bound}, got {v}", name)
    return v


def _boolean(body: dict, name: str):
    v = body.get(name)
    if v is not None and not isinstance(v, bool):
        raise bad_request(f"{name} must be a boolean, got {v!r}", name)
    return v


def _reject(body: dict, name: str, allowed=(None,), why: str = "is not supported") -> None:
    """400 for a field we do not implement, unless it has a harmless value (`allowed`, or empty)."""
    v = body.get(name)
    if v not in allowed and v not in ({}, []):
        raise bad_request(f"{name} {why}", name)


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


def _sampling(gen: Generation, body: dict, max_tokens_names: tuple[str, ...]) -> None:
    n = _integer(body, "n")
    if n is not None and n != 1:
        raise bad_request(f"n: only n=1 is supported, got {n}", "n")
    for name in max_tokens_names:
        value = _integer(body, name, lo=1)
        if value is not None:
            gen.fields["max_tokens"] = value
    scalars = {"temperature": _number(body, "temperature", lo=0),
               "top_p": _number(body, "top_p", lo=0, hi=1, lo_open=True),
               "seed": _integer(body, "seed", lo=0, hi=2**64 - 1),
               "presence_penalty": _number(body, "presence_penalty", lo=-2, hi=2),
               "frequency_penalty": _number(body, "frequency_penalty", lo=-2, hi=2),
               # vLLM extensions that clients send in extra_body
               "top_k": _integer(body, "top_k", lo=-1), "min_tokens": _integer(body, "min_tokens", lo=0),
               "repetition_penalty": _number(body, "repetition_penalty", lo=0, lo_open=True)}
    if scalars["top_k"] == -1:   # vLLM's "disabled"
        scalars["top_k"] = 0
    gen.fields.update({k: v for k, v in scalars.items() if v is not None})
    if _boolean(body, "ignore_eos") is not None:
        gen.sampling["ignore_eos"] = body["ignore_eos"]
    stop_ids = body.get("stop_token_ids")
    if stop_ids is not None:
        if not isinstance(stop_ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in stop_ids):
            raise bad_request("stop_token_ids must be a list of integers", "stop_token_ids")
        gen.sampling["stop_token_ids"] = stop_ids
    gen.stop = _stop(body)
    _reject(body, "logit_bias")


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
        gen.prompt_ids = prompt
    elif isinstance(prompt, list) and len(prompt) > 1 and all(isinstance(p, str) or _is_ids(p) for p in prompt):
        raise bad_request(f"prompt: only one prompt per request is supported, got {len(prompt)}", "prompt")
    else:
        raise bad_request("prompt is required: a string, or a list of token ids", "prompt")


def parse_completion(body) -> Generation:
    gen = _common(body, ("max_tokens",))
    _prompt(gen, body)
    gen.logprobs = _integer(body, "logprobs", lo=0, hi=MAX_LOGPROBS)
    _reject(body, "echo", (None, False), "is not supported")
    _reject(body, "best_of", (None, 1), "must be 1")
    _reject(body, "suffix", (None, ""), "is not supported")
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
    top = _integer(body, "top_logprobs", lo=0, hi=MAX_LOGPROBS)
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
    _reject(body, "tools", why="(tool calling) is not supported")
    return gen
