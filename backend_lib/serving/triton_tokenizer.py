"""The Triton tokenizer model: text or chat messages in, prompt token ids out.

Used as the first step of the ensembles (tokenizer -> LLM). It reads the tokenizer and chat
template of its own `checkpoint` parameter (the same folder as the LLM's), renders chat messages
as transformers does, and rejects empty prompts, prompts longer than `max_model_len` and malformed
messages with errors that name the field.
"""
from __future__ import annotations

import json
import logging
import os

import numpy as np

from ..config import _resolve
from ..sampling.params import RequestError
from ..tokenizer import Tokenizer, TokenizerError

log = logging.getLogger("backend_lib.triton")
ROLES = ("system", "user", "assistant", "tool")


def parse_messages(raw: str) -> list[dict]:
    try:
        messages = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise RequestError(f"messages: malformed JSON ({exc.msg} at position {exc.pos})") from None
    if not isinstance(messages, list) or not messages:
        raise RequestError("messages: must be a non-empty JSON list of {role, content} objects")
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise RequestError(f"messages[{i}]: must be an object with role and content")
        if m.get("role") not in ROLES:
            raise RequestError(f"messages[{i}].role: {m.get('role')!r} is not one of {', '.join(ROLES)}")
        content = m.get("content")
        if not isinstance(content, str):
            raise RequestError(f"messages[{i}].content: must be a string, got {type(content).__name__}")
    return messages


def tokenize_request(tok: Tokenizer, max_model_len: int, text: str | None, messages: str | None,
                     enable_thinking: bool = True, add_generation_prompt: bool = True) -> list[int]:
    if text is not None and messages is not None:
        raise RequestError("text_input and messages: send one of them, not both")
    if messages is not None:
        try:
            prompt = tok.apply_chat_template(parse_messages(messages), add_generation_prompt=add_generation_prompt,
                                             enable_thinking=enable_thinking)
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


def _text(arr, name, max_bytes: int):
    if arr is None:
        return None
    v = arr.reshape(-1)
    if v.size != 1:
        raise RequestError(f"{name}: expected one value, got {v.size}")
    if len(v[0]) > max_bytes:
        raise RequestError(f"{name}: {len(v[0])} bytes exceed the limit of {max_bytes} (max_prompt_bytes)")
    try:
        return bytes(v[0]).decode("utf-8") if isinstance(v[0], (bytes, np.bytes_)) else str(v[0])
    except UnicodeDecodeError:
        raise RequestError(f"{name}: not valid UTF-8") from None


class TritonTokenizerModel:
    def initialize(self, args):
        import triton_python_backend_utils as pb_utils

        from .triton_llm import _setup_logging

        _setup_logging()
        self.pb = pb_utils
        cfg = json.loads(args["model_config"])
        self.batched = cfg.get("max_batch_size", 0) > 0
        params = {k: v.get("string_value", "") for k, v in (cfg.get("parameters") or {}).items()}
        name = args["model_name"].upper()
        folder = os.environ.get(f"{name}_TOKENIZER") or os.environ.get(f"{name}_CHECKPOINT") \
            or params.get("tokenizer") or params.get("checkpoint")
        if not folder:
            raise pb_utils.TritonModelException("parameter 'checkpoint' (or 'tokenizer') is required")
        folder = _resolve(folder, args["model_repository"])
        try:
            self.max_model_len = int(os.environ.get(f"{name}_MAX_MODEL_LEN") or params.get("max_model_len") or 4096)
        except ValueError:
            raise pb_utils.TritonModelException(f"max_model_len: {params.get('max_model_len')!r} is not an integer")
        try:
            self.max_prompt_bytes = int(params.get("max_prompt_bytes") or 1 << 20)
        except ValueError:
            raise pb_utils.TritonModelException(f"max_prompt_bytes: {params.get('max_prompt_bytes')!r} is not an integer")
        self.tok = Tokenizer(folder)
        log.info("%s: tokenizer from %s (max_model_len %d)", args["model_name"], folder, self.max_model_len)

    def execute(self, requests):
        pb = self.pb
        responses = []
        for request in requests:
            def get(name):
                t = pb.get_input_tensor_by_name(request, name)
                return None if t is None else t.as_numpy()
            try:
                flag = lambda n, default: default if get(n) is None else bool(get(n).reshape(-1)[0])  # noqa: E731
                ids = tokenize_request(self.tok, self.max_model_len,
                                       _text(get("text_input"), "text_input", self.max_prompt_bytes),
                                       _text(get("messages"), "messages", self.max_prompt_bytes),
                                       flag("enable_thinking", True), flag("add_generation_prompt", True))
                arr = np.array(ids, dtype=np.int32)
                if self.batched:
                    arr = arr[None, :]
                responses.append(pb.InferenceResponse(output_tensors=[pb.Tensor("input_ids", arr)]))
            except RequestError as exc:
                responses.append(pb.InferenceResponse(
                    output_tensors=[], error=pb.TritonError(str(exc), pb.TritonError.INVALID_ARG)))
        return responses
