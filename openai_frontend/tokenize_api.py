"""vLLM's /tokenize and /detokenize: a prompt or chat messages to the model's token ids, ids back to text.

Token ids come from the tokenizer model (qwen3_tokenizer: the models' own tokenizer and chat template);
text comes from the front's tokenizer (--tokenizer) or, without one, the tokenizer of the model's own
`checkpoint` / `tokenizer` parameter, loaded once per model. The bodies are protocol.TokenizeRequest and
DetokenizeRequest (vLLM's request shapes; any other field is a 400 naming it)."""
from __future__ import annotations

import asyncio

from fastapi import APIRouter

from .errors import bad_request, unavailable
from .gateway import TritonGateway
from .params import chat_messages, enable_thinking
from .protocol import DetokenizeRequest, TokenizeRequest, json_body, request_body


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


def tokenize_routes(gateway: TritonGateway, tokenizers: ModelTokenizers, dependencies) -> APIRouter:
    router = APIRouter(dependencies=dependencies)

    @router.post("/tokenize", openapi_extra=request_body(TokenizeRequest))
    async def tokenize(body: TokenizeRequest = json_body(TokenizeRequest)):
        await gateway.require_llm(body.model)
        if body.prompt is not None:
            ids = await gateway.text_input_ids(body.prompt)
        else:
            tools = [t.model_dump(exclude_unset=True) for t in body.tools] if body.tools else None
            ids = await gateway.chat_input_ids(chat_messages(body.messages), enable_thinking(body.chat_template_kwargs),
                                               tools, body.add_generation_prompt is not False)
        params = await gateway.model_parameters(body.model)
        max_len = params.get("max_model_len")
        out = {"count": len(ids), "max_model_len": int(max_len) if max_len and max_len.isdigit() else None,
               "tokens": ids, "token_strs": None}
        if body.return_token_strs:
            tok = await tokenizers.get(body.model)
            out["token_strs"] = [tok.token_bytes[i].decode("utf-8", errors="replace") for i in ids]
        return out

    @router.post("/detokenize", openapi_extra=request_body(DetokenizeRequest))
    async def detokenize(body: DetokenizeRequest = json_body(DetokenizeRequest)):
        await gateway.require_llm(body.model)
        tok = await tokenizers.get(body.model)
        bad = next((i for i in body.tokens if i >= len(tok.token_bytes)), None)
        if bad is not None:
            raise bad_request(f"tokens: {bad} is outside the vocabulary [0, {len(tok.token_bytes)})", "tokens")
        return {"prompt": tok.decode(body.tokens, skip_special_tokens=False)}

    return router
