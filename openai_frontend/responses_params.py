"""OpenAI Responses request bodies (POST /v1/responses) -> the chat request the front already serves.

A Responses request is a chat request in another shape: `input` (a string or a list of items) and
`instructions` become messages, `function_call` / `function_call_output` items become the assistant's
tool calls and the tool's answers, a `reasoning` item becomes the next assistant message's
reasoning_content (Qwen3's template renders it within the current tool-calling turn), flat function
tools become chat tools, `text.format` becomes `response_format`, `max_output_tokens` becomes
`max_completion_tokens`. The result is validated by params.parse_chat, so sampling ranges, tools,
grammars and every limit are the chat path's own; its errors are renamed to the Responses field names.
Fields we do not implement are 400s naming them; some are accepted with their neutral value only.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Callable

from .errors import APIError, bad_request
from .params import Generation, parse_chat

# accepted as they are and passed to the chat path (vLLM's extensions, same names as in chat)
PASSED = ("model", "temperature", "top_p", "parallel_tool_calls", "chat_template_kwargs", "top_k", "min_p",
          "repetition_penalty", "seed", "presence_penalty", "frequency_penalty", "min_tokens", "ignore_eos",
          "cache_salt", "stop", "stop_token_ids", "structured_outputs", "user", "safety_identifier", "prompt_cache_key")
OWN = ("input", "instructions", "stream", "max_output_tokens", "tools", "tool_choice", "text", "store",
       "previous_response_id", "metadata", "reasoning")
# accepted only with these (neutral) values
NEUTRAL = {"truncation": ("disabled",), "background": (False,), "include": ([],), "service_tier": ("auto", "default"),
           "top_logprobs": (0,), "max_tool_calls": (), "stream_options": (), "prompt": (), "conversation": ()}
FIELDS = set(PASSED) | set(OWN) | set(NEUTRAL)
# chat field -> Responses field, for the chat path's error messages
RENAMED = {"max_completion_tokens": "max_output_tokens", "messages": "input", "response_format": "text.format"}
MAX_METADATA = 16


@dataclass
class ResponsesRequest:
    gen: Generation                  # the chat generation (messages include the instructions)
    history: list[dict]              # the conversation without the instructions: what a follow-up continues
    stream: bool
    store: bool
    echo: dict = field(default_factory=dict)   # request fields the response object repeats
    previous_response_id: str | None = None
    structured: str | None = None    # which Responses field a grammar error belongs to (text.format or tools)


def _same(value, allowed) -> bool:
    if isinstance(value, bool) or isinstance(allowed, bool):
        return type(value) is type(allowed) and value == allowed
    return value == allowed


def _fields(body: dict) -> None:
    unknown = sorted(k for k in body if k not in FIELDS)
    if unknown:
        raise bad_request(f"{unknown[0]}: unknown or unsupported field of a Responses request", unknown[0])
    for name, allowed in NEUTRAL.items():
        v = body.get(name)
        if v is not None and not any(_same(v, a) for a in allowed):
            why = f"only {' or '.join(json.dumps(a) for a in allowed)} is supported" if allowed else "is not supported"
            raise bad_request(f"{name}: {why}, got {json.dumps(v)}", name)
    reasoning = body.get("reasoning")
    if reasoning is not None:
        # Qwen3 thinks or does not (chat_template_kwargs.enable_thinking); effort levels and summaries are not ours
        if not isinstance(reasoning, dict) or any(v is not None for v in reasoning.values()):
            key = next((k for k, v in reasoning.items() if v is not None), None) if isinstance(reasoning, dict) else None
            raise bad_request(f"reasoning{'.' + key if key else ''}: not supported (Qwen3's thinking is switched with "
                              "chat_template_kwargs.enable_thinking)", "reasoning")


def _text(value, where: str) -> str:
    if not isinstance(value, str):
        raise bad_request(f"{where} must be a string", "input")
    return value


def _parts_text(content, where: str, kinds: tuple[str, ...]) -> str:
    """A message's content: a string, or a list of text parts of the given kinds, joined."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"{where}.content must be a string or a list of content parts", "input")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in kinds:
            raise bad_request(f"{where}.content[{j}].type: {kind!r} is not supported (only {', '.join(kinds)})", "input")
        extra = sorted(set(part) - {"type", "text", "annotations", "logprobs"})
        if extra:
            raise bad_request(f"{where}.content[{j}].{extra[0]}: unknown field", "input")
        texts.append(_text(part.get("text"), f"{where}.content[{j}].text"))
    return "\n".join(texts)


def _known(item: dict, where: str, allowed: set[str]) -> None:
    extra = sorted(set(item) - allowed)
    if extra:
        raise bad_request(f"{where}.{extra[0]}: unknown field", "input")


def input_messages(value) -> list[dict]:
    """`input` as chat messages."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not isinstance(value, list) or not value:
        raise bad_request("input is required: a string or a non-empty list of input items", "input")
    out: list[dict] = []
    reasoning: str | None = None   # a reasoning item waiting for its assistant message
    for i, item in enumerate(value):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise bad_request(f"{where} must be an object", "input")
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            _known(item, where, {"type", "role", "content", "id", "status"})
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise bad_request(f"{where}.role: {role!r} is not one of user, system, developer, assistant", "input")
            kinds = ("output_text",) if role == "assistant" else ("input_text",)
            msg = {"role": "system" if role == "developer" else role, "content": _parts_text(item.get("content"), where, kinds)}
            if role == "assistant" and reasoning is not None:
                msg["reasoning_content"], reasoning = reasoning, None
            out.append(msg)
        elif kind == "function_call":
            _known(item, where, {"type", "call_id", "name", "arguments", "id", "status"})
            call = {"id": _text(item.get("call_id"), f"{where}.call_id"), "type": "function",
                    "function": {"name": _text(item.get("name"), f"{where}.name"),
                                 "arguments": _text(item.get("arguments"), f"{where}.arguments")}}
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant" and reasoning is None:
                last.setdefault("tool_calls", []).append(call)   # calls of one turn: one assistant message
            else:
                msg = {"role": "assistant", "content": "", "tool_calls": [call]}
                if reasoning is not None:
                    msg["reasoning_content"], reasoning = reasoning, None
                out.append(msg)
        elif kind == "function_call_output":
            _known(item, where, {"type", "call_id", "output", "id", "status"})
            output = item.get("output")
            text = output if isinstance(output, str) else _parts_text(output, f"{where}.output", ("input_text",))
            out.append({"role": "tool", "tool_call_id": _text(item.get("call_id"), f"{where}.call_id"), "content": text})
        elif kind == "reasoning":
            _known(item, where, {"type", "id", "summary", "content", "encrypted_content", "status"})
            if item.get("encrypted_content") is not None:
                raise bad_request(f"{where}.encrypted_content: not supported (reasoning is returned in the clear)",
                                  "input")
            parts = item.get("content") or item.get("summary") or []
            if not isinstance(parts, list) or not all(isinstance(p, dict) and isinstance(p.get("text"), str) for p in parts):
                raise bad_request(f"{where}.content must be a list of {{type, text}} parts", "input")
            reasoning = "".join(p["text"] for p in parts)
        else:
            raise bad_request(f"{where}.type: {kind!r} is not supported (message, function_call, function_call_output, "
                              "reasoning)", "input")
    return out


def _tools(body: dict) -> tuple[list | None, object]:
    """Flat Responses function tools and tool_choice in the chat shapes."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    chat_tools = None
    if tools is not None:
        if not isinstance(tools, list):
            raise bad_request("tools must be a list of function tools", "tools")
        chat_tools = []
        for i, tool in enumerate(tools):
            if not isinstance(tool, dict) or tool.get("type") != "function":
                kind = tool.get("type") if isinstance(tool, dict) else None
                raise bad_request(f"tools[{i}].type: {kind!r} is not supported (only function tools)", "tools")
            extra = sorted(set(tool) - {"type", "name", "description", "parameters", "strict"})
            if extra:
                raise bad_request(f"tools[{i}].{extra[0]}: unknown field", "tools")
            fn = {k: tool[k] for k in ("name", "description", "parameters", "strict") if tool.get(k) is not None}
            chat_tools.append({"type": "function", "function": fn})
    if isinstance(choice, dict):
        if choice.get("type") != "function" or set(choice) != {"type", "name"}:
            raise bad_request("tool_choice must be none, auto, required or {type: 'function', name}", "tool_choice")
        choice = {"type": "function", "function": {"name": choice["name"]}}
    return chat_tools, choice


def _format(text) -> dict | None:
    """`text.format` as a chat response_format."""
    if text is None:
        return None
    if not isinstance(text, dict):
        raise bad_request("text must be an object {format}", "text")
    extra = sorted(k for k, v in text.items() if k != "format" and v is not None)
    if extra:
        raise bad_request(f"text.{extra[0]}: not supported", "text")
    fmt = text.get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") not in ("text", "json_object", "json_schema"):
        raise bad_request("text.format.type must be text, json_object or json_schema", "text.format")
    if fmt["type"] != "json_schema":
        _known_format(fmt, {"type"})
        return {"type": fmt["type"]}
    _known_format(fmt, {"type", "name", "schema", "strict", "description"})
    return {"type": "json_schema", "json_schema": {k: fmt[k] for k in ("name", "schema", "strict", "description")
                                                   if fmt.get(k) is not None}}


def _known_format(fmt: dict, allowed: set[str]) -> None:
    extra = sorted(set(fmt) - allowed)
    if extra:
        raise bad_request(f"text.format.{extra[0]}: unknown field", "text.format")


def renamed(exc: APIError, structured: str | None = None) -> APIError:
    """A chat-path error with the field named as the Responses request names it."""
    names = dict(RENAMED, structured_outputs=structured or "text.format")
    param = exc.param
    message = exc.message
    for old, new in names.items():
        if param == old or (param or "").startswith(old + "."):
            param = new + (param or "")[len(old):]
        if message.startswith(old):
            message = new + message[len(old):]
    return APIError(exc.status, message, type=exc.type, param=param, code=exc.code)


def parse_responses(body, history_of: Callable[[str], list[dict]] | None = None) -> ResponsesRequest:
    """`body` as a chat generation. history_of(previous_response_id) is the stored conversation that the request
    continues (it raises when there is none)."""
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    _fields(body)
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise bad_request("instructions must be a string", "instructions")
    metadata = body.get("metadata")
    if metadata is not None and (not isinstance(metadata, dict) or len(metadata) > MAX_METADATA or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in metadata.items())):
        raise bad_request(f"metadata must be an object of at most {MAX_METADATA} string values", "metadata")
    for name in ("stream", "store"):
        if body.get(name) is not None and not isinstance(body[name], bool):
            raise bad_request(f"{name} must be a boolean", name)
    previous = body.get("previous_response_id")
    if previous is not None and not isinstance(previous, str):
        raise bad_request("previous_response_id must be a string", "previous_response_id")
    history = history_of(previous) if previous is not None and history_of is not None else []
    conversation = list(history) + input_messages(body.get("input"))
    chat_tools, choice = _tools(body)
    chat = {k: body[k] for k in PASSED if body.get(k) is not None}
    chat["messages"] = ([{"role": "system", "content": instructions}] if instructions else []) + conversation
    for key, value in (("max_completion_tokens", body.get("max_output_tokens")), ("tools", chat_tools),
                       ("tool_choice", choice), ("response_format", _format(body.get("text")))):
        if value is not None:
            chat[key] = value
    structured = "text.format" if chat.get("response_format") else "tools"
    try:
        gen = parse_chat(chat)
    except APIError as exc:
        raise renamed(exc, structured) from None
    text = body.get("text") if isinstance(body.get("text"), dict) else {}
    echo = {"instructions": instructions, "metadata": metadata or {}, "max_output_tokens": body.get("max_output_tokens"),
            "temperature": body.get("temperature"), "top_p": body.get("top_p"),
            "parallel_tool_calls": body.get("parallel_tool_calls", True), "tools": body.get("tools") or [],
            "tool_choice": body.get("tool_choice", "auto"), "text": {"format": text.get("format") or {"type": "text"}},
            "truncation": "disabled", "user": body.get("user"), "reasoning": {"effort": None, "summary": None},
            "previous_response_id": previous, "store": body.get("store") is not False}
    return ResponsesRequest(gen, conversation, stream=bool(body.get("stream")), store=body.get("store") is not False,
                            echo=echo, previous_response_id=previous, structured=structured)
