"""Hermes-style tool-call parser for Qwen3: `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>` blocks.

Behaviour follows vLLM's `hermes` tool parser (`Hermes2ProToolParser`, vLLM main in 2026:
`vllm/tool_parsers/hermes_tool_parser.py`, formerly `vllm/entrypoints/openai/tool_parsers/`) together
with what vLLM's chat serving layer does with its result:

- No `<tool_call>` in the text: no calls, the whole text is content.
- Otherwise every block is taken with vLLM's pattern `<tool_call>(.*?)</tool_call>|<tool_call>(.*)`
  (DOTALL), so an unclosed last block (output cut, or stopped before `</tool_call>`) still counts
  when its JSON is complete. Each body must be a JSON object with a string "name" and an
  "arguments" member; arguments are re-serialized with `json.dumps(arguments, ensure_ascii=False)`.
- If any block fails (malformed or truncated JSON, missing keys), there are no calls at all and
  the whole text is content, as in vLLM. Except for a forced call (tool_choice required or a named function,
  whose grammar makes every block a valid call): there a last block cut by max_tokens is dropped and the
  complete calls before it are returned (finish_reason length).
- Content is the text before the first `<tool_call>`, unstripped, or None when it is empty or only
  whitespace (vLLM's serving layer drops whitespace-only content when tools were called). Text
  between or after blocks is dropped, as vLLM drops it.
- Names are not checked against the request's tools: vLLM's hermes parser returns whatever name
  the model wrote, so this parser takes no tool list.
- Ids are "call_" + 24 random hex digits, OpenAI's shape (vLLM writes "chatcmpl-tool-" + 32 hex).

Streaming: content before the first `<tool_call>` streams as it arrives, except a suffix that could
still become `<tool_call>` and except leading whitespace-only text (it is content only if no call
follows). Everything from the first `<tool_call>` on is held until `finish()`, because a malformed
block anywhere turns the whole output back into content; Qwen3 ends its turn right after the last
`</tool_call>`, so this costs about one token of latency. `finish()` then sends the rest of the
content, or for each call a delta with index, id, type and name (arguments "") followed by one
delta with the full arguments, the way OpenAI streams calls. For every split of the text into
deltas, the streamed content and calls equal `parse()` of the whole text. (vLLM streams argument
text as the model writes it and never falls back to content; the one-shot emission keeps the
streamed and non-streamed results identical.)
"""
from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass

from .reasoning import partial_tag_len

TOOL_CALL_START = "<tool_call>"
_BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)", re.DOTALL)


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # a JSON text

    def to_openai(self) -> dict:
        """The `message.tool_calls[]` item of a chat.completion."""
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def _call(body: str) -> ToolCall | None:
    try:
        obj = json.loads(body)
    except (ValueError, RecursionError):
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or "arguments" not in obj:
        return None
    return ToolCall("call_" + secrets.token_hex(12), obj["name"], json.dumps(obj["arguments"], ensure_ascii=False))


def parse(text: str, keep_complete: bool = False) -> tuple[str | None, list[ToolCall]]:
    """(content, calls) of a whole output (or of the content part the reasoning parser left). keep_complete (a
    forced call, tool_choice required or named: the grammar makes every block a valid call, so only max_tokens can
    cut one): an unclosed last block that does not parse is dropped and the complete calls before it are kept."""
    start = text.find(TOOL_CALL_START)
    if start < 0:
        return text or None, []
    calls = []
    blocks = _BLOCK.findall(text)
    for i, (closed, unclosed) in enumerate(blocks):
        call = _call(closed or unclosed)
        if call is None:
            if keep_complete and calls and i == len(blocks) - 1 and not closed:
                break   # the output was cut inside its last call
            return text, []
        calls.append(call)
    content = text[:start]
    return (content if content.strip() else None), calls


class ToolCallStream:
    """Incremental `parse()`: `feed()` and `finish()` return OpenAI chat.completion.chunk `delta` dicts."""

    def __init__(self, keep_complete: bool = False):
        self.keep_complete = keep_complete   # see parse()
        self._parts: list[str] = []  # every delta, for the whole-output parse in finish()
        self._pending = ""  # unsent text before the first <tool_call>
        self._sent = 0  # content characters sent
        self._calls_seen = False

    def feed(self, delta: str) -> list[dict]:
        self._parts.append(delta)
        if self._calls_seen:
            return []
        text = self._pending + delta
        start = text.find(TOOL_CALL_START)
        if start >= 0:
            self._calls_seen = True
            sendable = start
        else:
            sendable = len(text) - partial_tag_len(text, TOOL_CALL_START)
        # Whitespace-only content is dropped when calls follow: wait for a visible character.
        if sendable == 0 or (self._sent == 0 and not text[:sendable].strip()):
            self._pending = text
            return []
        self._pending = text[sendable:]
        self._sent += sendable
        return [{"content": text[:sendable]}]

    def finish(self) -> list[dict]:
        content, calls = parse("".join(self._parts), self.keep_complete)
        deltas = []
        if content and len(content) > self._sent:
            deltas.append({"content": content[self._sent:]})
        for index, call in enumerate(calls):
            deltas.append({"tool_calls": [{"index": index, "id": call.id, "type": "function",
                                           "function": {"name": call.name, "arguments": ""}}]})
            deltas.append({"tool_calls": [{"index": index, "function": {"arguments": call.arguments}}]})
        return deltas
