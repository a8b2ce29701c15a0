"""vLLM's /tokenize and /detokenize: a prompt or chat messages to the model's token ids, ids back to text.

Token ids come from the tokenizer model (qwen3_tokenizer: the models' own tokenizer and chat template);
text comes from the front's tokenizer (--tokenizer) or, without one, the tokenizer of the model's own
`checkpoint` / `tokenizer` parameter, loaded once per model. The bodies are protocol.TokenizeRequest and
DetokenizeRequest (vLLM's request shapes; any other field is a 400 naming it)."""
from __future__ import annotations

import asyncio
import logging
import os

from fastapi import APIRouter

from .errors import bad_request, unavailable
from .gateway import TritonGateway
from .params import chat_messages, enable_thinking
from .protocol import DetokenizeRequest, TokenizeRequest, json_body, request_body

log = logging.getLogger("openai_frontend")


class ModelTokenizers:
    """The tokenizer of each served model, for text (the front's --tokenizer when given). Without one, the folder
    the model itself loaded: its `tokenizer` or `checkpoint` parameter with the model's own environment overrides
    ($<MODEL>_TOKENIZER, $<MODEL>_CHECKPOINT, which scripts/serve.sh exports for the server and the front alike), a
    relative path resolved against the model's folder in `model_repository` (the front's --model-repository,
    default ./model_repository), as the model resolves it."""

    def __init__(self, gateway: TritonGateway, tokenizer=None, model_repository: str | None = None):
        self.gateway, self.fixed, self._by_model = gateway, tokenizer, {}
        self.model_repository = model_repository

    async def location(self, model: str) -> str | None:
        params = await self.gateway.model_parameters(model)
        for key in ("tokenizer", "checkpoint"):
            where = os.environ.get(f"{model.upper()}_{key.upper()}") or params.get(key)
            if where:
                break
        else:
            return None
        from backend_lib.checkpoint.hub import parse_hub_id

        path = os.path.expanduser(where)
        if not os.path.isabs(path) and self.model_repository:
            local = os.path.normpath(os.path.join(self.model_repository, model, path))
            if os.path.isdir(local) or parse_hub_id(where) is None:
                return local
        return where

    async def get(self, model: str):
        if self.fixed is not None:
            return self.fixed
        if model not in self._by_model:
            where = await self.location(model)
            if not where:
                raise unavailable(f"detokenize: the model '{model}' names no checkpoint; start the front with "
                                  "--tokenizer")
            try:
                self._by_model[model] = await asyncio.to_thread(_load, where)
            except Exception as exc:
                log.warning("cannot load the tokenizer of %r from %s: %s", model, where, exc)
                # the server's paths stay in the front's log
                raise unavailable(f"detokenize: cannot load the tokenizer of '{model}'; start the front with "
                                  "--tokenizer or --model-repository") from None
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
