"""OpenAI Responses request bodies (POST /v1/responses) -> the chat request the front already serves.

A Responses request is a chat request in another shape: `input` (a string or a list of items) and
`instructions` become messages, `function_call` / `function_call_output` items become the assistant's
tool calls and the tool's answers, a `reasoning` item becomes the next assistant message's
reasoning_content (Qwen3's template renders it within the current tool-calling turn), flat function
tools become chat tools, `text.format` becomes `response_format`, `max_output_tokens` becomes
`max_completion_tokens`. The body is protocol.CreateResponseRequest (fields we do not implement are 400s
naming them; some are accepted with their neutral value only); the chat request it becomes is validated as a
chat request, so sampling ranges, tools, grammars and every limit are the chat path's own, and its errors
are renamed to the Responses field names.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from .errors import APIError
from .params import Generation, chat_generation
from .protocol import (ChatCompletionRequest, ContentPart, CreateResponseRequest, FunctionCallItem,
                       FunctionCallOutputItem, MessageItem, ReasoningItem, TextConfig, SamplingFields,
                       TemplateFields, validated)

# passed as they are to the chat path (vLLM's extensions, same names as in chat)
PASSED = {"model", *SamplingFields.model_fields, *TemplateFields.model_fields}
# chat field -> Responses field, for the chat path's error messages
RENAMED = {"max_completion_tokens": "max_output_tokens", "messages": "input", "response_format": "text.format"}


@dataclass
class ResponsesRequest:
    gen: Generation                  # the chat generation (messages include the instructions)
    history: list[dict]              # the conversation without the instructions: what a follow-up continues
    stream: bool
    store: bool
    echo: dict = field(default_factory=dict)   # request fields the response object repeats
    previous_response_id: str | None = None
    structured: str | None = None    # which Responses field a grammar error belongs to (text.format or tools)


def _text(content: str | list[ContentPart]) -> str:
    """A message's content: a string, or its text parts joined."""
    return content if isinstance(content, str) else "\n".join(p.text for p in content)


def input_messages(value: str | list) -> list[dict]:
    """`input` (validated items) as chat messages."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    out: list[dict] = []
    reasoning: str | None = None   # a reasoning item waiting for its assistant message
    for item in value:
        if isinstance(item, MessageItem):
            msg = {"role": "system" if item.role == "developer" else item.role, "content": _text(item.content)}
            if item.role == "assistant" and reasoning is not None:
                msg["reasoning_content"], reasoning = reasoning, None
            out.append(msg)
        elif isinstance(item, FunctionCallItem):
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments}}
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant" and reasoning is None:
                last.setdefault("tool_calls", []).append(call)   # calls of one turn: one assistant message
            else:
                msg = {"role": "assistant", "content": "", "tool_calls": [call]}
                if reasoning is not None:
                    msg["reasoning_content"], reasoning = reasoning, None
                out.append(msg)
        elif isinstance(item, FunctionCallOutputItem):
            out.append({"role": "tool", "tool_call_id": item.call_id, "content": _text(item.output)})
        elif isinstance(item, ReasoningItem):
            reasoning = "".join(p.text for p in item.content or item.summary or [])
    return out


def _tools(req: CreateResponseRequest) -> tuple[list | None, object]:
    """Flat Responses function tools and tool_choice in the chat shapes."""
    chat_tools = None
    if req.tools is not None:
        chat_tools = [{"type": "function", "function": t.model_dump(exclude_none=True, exclude={"type"})}
                      for t in req.tools]
    choice = req.tool_choice
    if choice is not None and not isinstance(choice, str):
        choice = {"type": "function", "function": {"name": choice.name}}
    return chat_tools, choice


def _format(text: TextConfig | None) -> dict | None:
    """`text.format` as a chat response_format."""
    fmt = text.format if text is not None else None
    if fmt is None:
        return None
    if fmt.type != "json_schema":
        return {"type": fmt.type}
    return {"type": "json_schema", "json_schema": fmt.model_dump(exclude_none=True, exclude={"type"}, by_alias=True)}


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
    """`body` (parsed JSON) as a chat generation. history_of(previous_response_id) is the stored conversation that
    the request continues (it raises when there is none)."""
    return responses_request(validated(CreateResponseRequest, body), history_of)


def responses_request(req: CreateResponseRequest, history_of: Callable[[str], list[dict]] | None = None
                      ) -> ResponsesRequest:
    previous = req.previous_response_id
    history = history_of(previous) if previous is not None and history_of is not None else []
    conversation = list(history) + input_messages(req.input)
    chat_tools, choice = _tools(req)
    chat = req.model_dump(include=PASSED, exclude_none=True, by_alias=True)
    chat["messages"] = ([{"role": "system", "content": req.instructions}] if req.instructions else []) + conversation
    for key, value in (("max_completion_tokens", req.max_output_tokens), ("tools", chat_tools),
                       ("tool_choice", choice), ("response_format", _format(req.text))):
        if value is not None:
            chat[key] = value
    structured = "text.format" if chat.get("response_format") else "tools"
    try:
        gen = chat_generation(validated(ChatCompletionRequest, chat))
    except APIError as exc:
        raise renamed(exc, structured) from None
    fmt = req.text.format if req.text is not None else None
    echo = {"instructions": req.instructions, "metadata": req.metadata or {}, "max_output_tokens": req.max_output_tokens,
            "temperature": req.temperature, "top_p": req.top_p,
            "parallel_tool_calls": req.parallel_tool_calls is not False,
            "tools": [t.model_dump(exclude_unset=True) for t in req.tools or []],
            "tool_choice": req.tool_choice.model_dump() if req.tool_choice is not None and not isinstance(
                req.tool_choice, str) else req.tool_choice or "auto",
            "text": {"format": fmt.model_dump(exclude_unset=True, by_alias=True) if fmt is not None else {"type": "text"}},
            "truncation": "disabled", "user": req.user, "reasoning": {"effort": None, "summary": None},
            "previous_response_id": previous, "store": req.store is not False}
    return ResponsesRequest(gen, conversation, stream=bool(req.stream), store=req.store is not False,
                            echo=echo, previous_response_id=previous, structured=structured)
