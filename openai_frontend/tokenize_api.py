"""vLLM's /tokenize and /detokenize: a prompt or chat messages to the model's token ids, ids back to text.

Token ids come from the tokenizer model (qwen3_tokenizer: the models' own tokenizer and chat template);
text comes from the front's tokenizer (--tokenizer) or, without one, the tokenizer of the model's own
`checkpoint` / `tokenizer` parameter, loaded once per model. Fields outside vLLM's request shapes are a
400 naming them."""
from __future__ import annotations

import asyncio

from fastapi import APIRouter, Request

from backend_lib.sampling.params import INT32_MAX
from .errors import bad_request, unavailable
from .gateway import TritonGateway
from .params import _boolean, _enable_thinking, _messages, _model, _token_id, known_fields
from .tools import parse_tools

TOKENIZE_FIELDS = {"model", "prompt", "messages", "add_special_tokens", "add_generation_prompt",
                   "chat_template_kwargs", "tools", "return_token_strs", "continue_final_message"}
DETOKENIZE_FIELDS = {"model", "tokens"}
MAX_TOKENS = 1 << 20


class ModelTokenizers:
    """The tokenizer of each served model, for text (the front's --tokenizer when given)."""

    def __init__(self, gateway: TritonGateway, tokenizer=None):
        self.gateway, self.fixed, self._by_model = gateway, tokenizer, {}

    async def get(self, model: str):
        if self.fixed is not None:
            return self.fixed
        if model not in self._by_model:
            params = await self.gateway.model_parameters(model)
            where = params.get("tokenizer") or params.get("checkpoint")
            if not where:
                raise unavailable(f"detokenize: the model '{model}' names no checkpoint; start the front with "
                                  "--tokenizer")
            try:
                self._by_model[model] = await asyncio.to_thread(_load, where)
            except Exception as exc:
                raise unavailable(f"detokenize: cannot load the tokenizer of '{model}' ({where}): {exc}; start the "
                                  "front with --tokenizer") from None
        return self._by_model[model]


def _load(where: str):
    from backend_lib.checkpoint.hub import resolve
    from backend_lib.tokenizer import Tokenizer

    return Tokenizer(resolve(where, "tokenizer"))


def tokenize_routes(gateway: TritonGateway, tokenizers: ModelTokenizers, json_body, dependencies) -> APIRouter:
    router = APIRouter(dependencies=dependencies)

    @router.post("/tokenize")
    async def tokenize(request: Request):
        body = await json_body(request)
        known_fields(body, TOKENIZE_FIELDS)
        model = _model(body)
        if (body.get("prompt") is None) == (body.get("messages") is None):
            raise bad_request("prompt or messages: send one of them", "prompt")
        _boolean(body, "add_special_tokens")   # Qwen3 adds no special tokens to a prompt either way
        strs = _boolean(body, "return_token_strs")
        await gateway.require_llm(model)
        if body.get("prompt") is not None:
            for name in ("add_generation_prompt", "chat_template_kwargs", "tools", "continue_final_message"):
                if body.get(name) is not None:
                    raise bad_request(f"{name}: only with messages", name)
            prompt = body["prompt"]
            if not isinstance(prompt, str) or not prompt:
                raise bad_request("prompt must be a non-empty string", "prompt")
            ids = await gateway.text_input_ids(prompt)
        else:
            if _boolean(body, "continue_final_message"):
                raise bad_request("continue_final_message: only false is supported", "continue_final_message")
            gen = _boolean(body, "add_generation_prompt")
            tools = parse_tools(body)
            ids = await gateway.chat_input_ids(_messages(body), _enable_thinking(body),
                                               tools.tools if tools is not None else None, gen is not False)
        params = await gateway.model_parameters(model)
        max_len = params.get("max_model_len")
        out = {"count": len(ids), "max_model_len": int(max_len) if max_len and max_len.isdigit() else None,
               "tokens": ids, "token_strs": None}
        if strs:
            tok = await tokenizers.get(model)
            out["token_strs"] = [tok.token_bytes[i].decode("utf-8", errors="replace") for i in ids]
        return out

    @router.post("/detokenize")
    async def detokenize(request: Request):
        body = await json_body(request)
        known_fields(body, DETOKENIZE_FIELDS)
        model = _model(body)
        ids = body.get("tokens")
        if not isinstance(ids, list) or len(ids) > MAX_TOKENS or not all(_token_id(i) for i in ids):
            raise bad_request(f"tokens must be a list of at most {MAX_TOKENS} token ids, integers in [0, {INT32_MAX}]",
                              "tokens")
        await gateway.require_llm(model)
        tok = await tokenizers.get(model)
        bad = next((i for i in ids if i >= len(tok.token_bytes)), None)
        if bad is not None:
            raise bad_request(f"tokens: {bad} is outside the vocabulary [0, {len(tok.token_bytes)})", "tokens")
        return {"prompt": tok.decode(ids, skip_special_tokens=False)}

    return router
