"""The `tools` / `tool_choice` / `parallel_tool_calls` fields of a chat request (validated by protocol.py's
models): rendered by Qwen3's chat template (the tokenizer model), and, for `required` or a named function,
enforced with a grammar so that the output is a valid call whatever the model would have chosen.

The front asks for the grammar by what it must allow (structured_outputs `tool_calls`: the functions and
whether several calls may follow each other); the engine builds it (backend_lib.contract.structured) from
its own vocabulary: `<tool_call>` and `</tool_call>` are single tokens where the vocabulary has them (Qwen3:
added tokens), their text otherwise, around a JSON body that must be one of the allowed functions with
arguments matching its `parameters` schema, written as Qwen3 writes it (`{"name": ..., "arguments":
{...}}` with ", " and ": " separators), without free whitespace, so a model cannot stall in indentation.
"""
from __future__ import annotations

import json
from dataclasses import dataclass

from .errors import bad_request


@dataclass
class ToolRequest:
    tools: list[dict]            # OpenAI tool objects, as the template takes them
    choice: str | None           # "none" | "auto" | "required" | None (a named function: `name`)
    name: str | None = None
    parallel: bool = True

    @property
    def parse_calls(self) -> bool:
        """Whether the output's <tool_call> blocks become tool_calls (vLLM: not with tool_choice none)."""
        return self.choice != "none"

    def constraint(self) -> dict | None:
        """The structured_outputs constraint that forces a call (required / named), or None (auto / none)."""
        if self.choice not in ("required", None):
            return None
        fns = [t["function"] for t in self.tools if self.name is None or t["function"]["name"] == self.name]
        functions = [{"name": f["name"], "parameters": f.get("parameters") or {"type": "object"}} for f in fns]
        return {"tool_calls": {"functions": functions, "parallel": self.parallel and self.name is None}}


def tool_request(tools, choice, parallel: bool | None) -> ToolRequest | None:
    """The validated tools, tool_choice and parallel_tool_calls of a chat request (protocol.ChatTool /
    NamedToolChoice models) as a ToolRequest, None without tools. A forced call's schemas must compile."""
    if not tools:
        return None
    req = ToolRequest([t.model_dump(exclude_unset=True) for t in tools], "auto", parallel=parallel is not False)
    if isinstance(choice, str):
        req.choice = choice
    elif choice is not None:   # a named function
        req.choice, req.name = None, choice.function.name
    if req.choice in ("required", None):
        _check_enforced_schemas(req)
    return req


def _check_enforced_schemas(req: ToolRequest) -> None:
    """A tool whose parameters the grammar enforces must compile as a JSON schema: refused here, naming the
    tool, rather than by the engine, which sees only the combined constraint (structured_outputs.tool_calls, a
    field the client never sent)."""
    import llguidance

    for i, tool in enumerate(req.tools):
        fn = tool["function"]
        if req.name is not None and fn["name"] != req.name:
            continue
        schema = fn.get("parameters") or {"type": "object"}
        try:
            error = llguidance.LLMatcher.validate_grammar(
                llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema)))
        except (ValueError, TypeError) as exc:
            error = str(exc)
        if error and not error.startswith("WARNING"):
            raise bad_request(f"tools[{i}].function.parameters is not a JSON schema the grammar engine can "
                              f"enforce: {error.strip().splitlines()[0]}", "tools")
