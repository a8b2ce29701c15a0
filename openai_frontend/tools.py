"""The `tools` / `tool_choice` / `parallel_tool_calls` fields of a chat request: validated, rendered by
Qwen3's chat template (the tokenizer model), and, for `required` or a named function, enforced with a
grammar so that the output is a valid call whatever the model would have chosen.

The front asks for the grammar by what it must allow (structured_outputs `tool_calls`: the functions and
whether several calls may follow each other); the engine builds it (backend_lib.sampling.structured) from
its own vocabulary: `<tool_call>` and `</tool_call>` are single tokens where the vocabulary has them (Qwen3:
added tokens), their text otherwise, around a JSON body that must be one of the allowed functions with
arguments matching its `parameters` schema, written as Qwen3 writes it (`{"name": ..., "arguments":
{...}}` with ", " and ": " separators), without free whitespace, so a model cannot stall in indentation.
"""
from __future__ import annotations

import json
from dataclasses import dataclass

from .errors import bad_request

MAX_TOOLS = 128


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


def _function(tool, i: int) -> dict:
    where = f"tools[{i}]"
    if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
        raise bad_request(f"{where} must be {{type: 'function', function: {{name, description, parameters}}}}",
                          "tools")
    unknown = sorted(set(tool) - {"type", "function"})
    fn = tool["function"]
    unknown += [f"function.{k}" for k in sorted(set(fn) - {"name", "description", "parameters", "strict"})]
    if unknown:
        raise bad_request(f"{where}: unknown field(s) {', '.join(unknown)}", "tools")
    if not isinstance(fn.get("name"), str) or not fn["name"] or len(fn["name"]) > 64:
        raise bad_request(f"{where}.function.name must be a non-empty string of at most 64 characters", "tools")
    if not isinstance(fn.get("description", ""), str):
        raise bad_request(f"{where}.function.description must be a string", "tools")
    if not isinstance(fn.get("parameters", {}), dict):
        raise bad_request(f"{where}.function.parameters must be a JSON schema object", "tools")
    if not isinstance(fn.get("strict", False), bool):
        raise bad_request(f"{where}.function.strict must be a boolean", "tools")
    return tool


def parse_tools(body: dict) -> ToolRequest | None:
    tools, choice = body.get("tools"), body.get("tool_choice")
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise bad_request("parallel_tool_calls must be a boolean", "parallel_tool_calls")
    if tools is None or tools == []:
        if choice not in (None, "none"):
            raise bad_request("tool_choice requires tools", "tool_choice")
        return None
    if not isinstance(tools, list) or len(tools) > MAX_TOOLS:
        raise bad_request(f"tools must be a list of at most {MAX_TOOLS} function tools", "tools")
    tools = [_function(t, i) for i, t in enumerate(tools)]
    names = [t["function"]["name"] for t in tools]
    if len(set(names)) != len(names):
        raise bad_request("tools: function names must be unique", "tools")
    req = ToolRequest(tools, "auto", parallel=parallel is not False)
    if isinstance(choice, str):
        if choice not in ("none", "auto", "required"):
            raise bad_request(f"tool_choice must be none, auto, required or a function, got {choice!r}",
                              "tool_choice")
        req.choice = choice
    elif isinstance(choice, dict):
        fn = choice.get("function")
        if choice.get("type") != "function" or not isinstance(fn, dict) or set(choice) - {"type", "function"} \
                or set(fn) != {"name"}:
            raise bad_request("tool_choice must be {type: 'function', function: {name}}", "tool_choice")
        if fn["name"] not in names:
            raise bad_request(f"tool_choice: function {fn['name']!r} is not among tools", "tool_choice")
        req.choice, req.name = None, fn["name"]
    elif choice is not None:
        raise bad_request("tool_choice must be a string or an object", "tool_choice")
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
