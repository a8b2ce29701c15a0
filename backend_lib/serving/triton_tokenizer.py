"""The Triton tokenizer model: text or chat messages in, prompt token ids out.

Used as the first step of the ensembles (tokenizer -> LLM). It reads the tokenizer and chat
template of its own `checkpoint` parameter (the same folder as the LLM's), renders chat messages
as transformers does, and rejects empty prompts, prompts longer than `max_model_len` and malformed
messages with errors that name the field. Each request of a dynamic batch is answered on its own:
one bad request gets its error, the others their ids; errors never carry tracebacks or paths
(those go to the server log).
"""
from __future__ import annotations

import json

import numpy as np

from ..checkpoint import ModelConfig
from ..contract.json_input import loads
from ..contract.errors import RequestError
from ..tokenizer import Tokenizer, TokenizerError
from .request import scalar, text_value
from .schema import TOKENIZER_INPUTS, TOKENIZER_OUTPUTS, declare
from .launcher import mark_load
from .log import get_logger, setup as setup_logging
from .triton_config import engine_config_from_args

log = get_logger()
ROLES = ("system", "user", "assistant", "tool")
MESSAGE_KEYS = {"role": str, "content": (str, type(None)), "reasoning_content": str, "tool_calls": list,
                "name": str, "tool_call_id": str}


def _check_tool_calls(calls: list, where: str) -> None:
    for j, call in enumerate(calls):
        w = f"{where}.tool_calls[{j}]"
        if not isinstance(call, dict):
            raise RequestError(f"{w}: must be an object")
        unknown = sorted(set(call) - {"id", "type", "function"})
        if unknown:
            raise RequestError(f"{w}: unknown key(s) {', '.join(map(repr, unknown))}")
        if call.get("type", "function") != "function" or not isinstance(call.get("id", ""), str):
            raise RequestError(f"{w}: type must be 'function' and id a string")
        fn = call.get("function")
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or \
                not isinstance(fn.get("arguments", ""), (str, dict)) or set(fn) - {"name", "arguments"}:
            raise RequestError(f"{w}.function: must be {{name: string, arguments: string or object}}")


def parse_messages(raw: str) -> list[dict]:
    """The chat messages, every field checked for its type (a wrong type would otherwise raise deep
    inside the chat template); unknown fields are an error naming them."""
    messages = loads(raw, "messages")
    if not isinstance(messages, list) or not messages:
        raise RequestError("messages: must be a non-empty JSON list of {role, content} objects")
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise RequestError(f"messages[{i}]: must be an object with role and content")
        if m.get("role") not in ROLES:
            raise RequestError(f"messages[{i}].role: {m.get('role')!r} is not one of {', '.join(ROLES)}")
        for key, value in m.items():
            if key not in MESSAGE_KEYS:
                raise RequestError(f"messages[{i}].{key}: unknown field (known: {', '.join(MESSAGE_KEYS)})")
            if not isinstance(value, MESSAGE_KEYS[key]):
                raise RequestError(f"messages[{i}].{key}: wrong type {type(value).__name__}")
        if not isinstance(m.get("content"), str) and not m.get("tool_calls"):
            raise RequestError(f"messages[{i}].content: must be a string")
        if "tool_calls" in m:
            _check_tool_calls(m["tool_calls"], f"messages[{i}]")
    return messages


def parse_tools(raw: str | None) -> list[dict] | None:
    """The chat's function tools for the template: a JSON list of {type: function, function: {name, ...}}."""
    if raw is None or not raw.strip():
        return None
    tools = loads(raw, "tools")
    if not isinstance(tools, list):
        raise RequestError("tools: must be a JSON list of function tools")
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(fn, dict) or t.get("type") != "function" or not isinstance(fn.get("name"), str) or \
                not isinstance(fn.get("parameters", {}), dict) or not isinstance(fn.get("description", ""), str):
            raise RequestError(f"tools[{i}]: must be {{type: 'function', function: {{name: string, "
                               "description: string, parameters: object}}}}")
    return tools or None


def tokenize_request(tok: Tokenizer, max_model_len: int, text: str | None, messages: str | None,
                     enable_thinking: bool = True, add_generation_prompt: bool = True,
                     tools: str | None = None) -> list[int]:
    if text is not None and messages is not None:
        raise RequestError("text_input and messages: send one of them, not both")
    if tools is not None and messages is None:
        raise RequestError("tools: only with messages (a chat)")
    if messages is not None:
        parsed_tools = parse_tools(tools)
        try:
            prompt = tok.apply_chat_template(parse_messages(messages), add_generation_prompt=add_generation_prompt,
                                             enable_thinking=enable_thinking,
                                             **({"tools": parsed_tools} if parsed_tools else {}))
        except TokenizerError as exc:
            raise RequestError(str(exc)) from None
        field = "messages"
    elif text is not None:
        prompt, field = text, "text_input"
    else:
        raise RequestError("text_input or messages is required")
    if not prompt:
        raise RequestError(f"{field}: the prompt is empty")
    ids = tok.encode(prompt)
    if not ids:
        raise RequestError(f"{field}: the prompt is empty")
    if len(ids) >= max_model_len:
        raise RequestError(f"{field}: the prompt has {len(ids)} tokens; max_model_len is {max_model_len}")
    return ids


class TritonTokenizerModel:
    @staticmethod
    def auto_complete_config(auto_complete_model_config):
        return declare(auto_complete_model_config, TOKENIZER_INPUTS, TOKENIZER_OUTPUTS)

    def initialize(self, args):
        import triton_python_backend_utils as pb_utils

        setup_logging(pb_utils)
        self.pb = pb_utils
        mark_load(args["model_name"], "loading")
        self.batched = json.loads(args["model_config"]).get("max_batch_size", 0) > 0
        try:
            cfg = engine_config_from_args(args)
        except ValueError as exc:
            raise pb_utils.TritonModelException(str(exc)) from None
        folder = cfg.tokenizer or cfg.checkpoint
        self.max_model_len = cfg.max_model_len or ModelConfig.from_dir(cfg.checkpoint).max_position_embeddings
        self.max_prompt_bytes = cfg.limits.max_prompt_bytes
        self.tok = Tokenizer(folder)
        mark_load(args["model_name"], "ready")
        log.info("%s: tokenizer from %s (max_model_len %d)", args["model_name"], folder, self.max_model_len)

    def _ids(self, request) -> np.ndarray:
        pb = self.pb

        def get(name):
            t = pb.get_input_tensor_by_name(request, name)
            return None if t is None else t.as_numpy()

        def text(name):
            arr = get(name)
            return None if arr is None else text_value(name, scalar(name, arr), self.max_prompt_bytes)

        def flag(name, default):
            arr = get(name)
            return default if arr is None else bool(scalar(name, arr))

        ids = tokenize_request(self.tok, self.max_model_len, text("text_input"), text("messages"),
                               flag("enable_thinking", True), flag("add_generation_prompt", True), text("tools"))
        arr = np.array(ids, dtype=np.int32)
        return arr[None, :] if self.batched else arr

    def execute(self, requests):
        pb = self.pb
        responses = []
        for request in requests:   # each request on its own: one bad request never fails the batch
            try:
                responses.append(pb.InferenceResponse(output_tensors=[pb.Tensor("input_ids", self._ids(request))]))
            except RequestError as exc:
                responses.append(pb.InferenceResponse(
                    output_tensors=[], error=pb.TritonError(str(exc), pb.TritonError.INVALID_ARG)))
            except Exception:
                log.exception("tokenizer request failed")
                responses.append(pb.InferenceResponse(output_tensors=[], error=pb.TritonError(
                    "internal error in the tokenizer model (logged by the server)", pb.TritonError.INTERNAL)))
        return responses
