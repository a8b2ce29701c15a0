"""The FastAPI app: routes, API-key check and OpenAI error bodies."""
from __future__ import annotations

import hmac
import json
import logging
import re
from contextlib import asynccontextmanager

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response

from backend_lib.json_input import loads
from backend_lib.sampling.errors import RequestError
from .errors import APIError, bad_request, unauthorized
from .formats import ChatFormat, CompletionFormat, TokenNames
from .gateway import TritonGateway
from .generation import ClientGone, respond
from .lora import LoraAdapters
from .params import parse_chat, parse_completion
from .playground import mount_playground
from .responses_api import responses_routes
from .responses_store import ResponseStore
from .tokenize_api import ModelTokenizers, tokenize_routes

log = logging.getLogger("openai_frontend")


def parse_json_body(raw: bytes):
    """The request body as strict JSON (backend_lib.json_input: depth, number range, duplicate keys,
    surrogates, NaN), or a 400 naming the field."""
    try:
        return loads(raw, "")
    except RequestError as exc:
        message = str(exc)
        param = re.match(r"([A-Za-z_][A-Za-z0-9_]*)", message)
        raise bad_request(message, param.group(1) if param and not message.startswith("the request body")
                          else None) from None


async def _json_body(request: Request):
    return parse_json_body(await request.body())


def _api_key_check(api_key: str | None):
    expected = f"Bearer {api_key}".encode() if api_key else None

    async def check(request: Request) -> None:
        if expected is not None and not hmac.compare_digest(
                request.headers.get("authorization", "").encode(), expected):
            raise unauthorized()
    return check


def _v1_routes(gateway: TritonGateway, names: TokenNames, api_key: str | None, reasoning: bool) -> APIRouter:
    router = APIRouter(prefix="/v1", dependencies=[Depends(_api_key_check(api_key))])

    @router.get("/models")
    async def list_models():
        models = await gateway.llm_models()
        return {"object": "list", "data": [_model_card(m) for m in models] + await gateway.loras.cards(gateway)}

    @router.get("/models/{model:path}")
    async def get_model(model: str):
        if model in gateway.loras:
            return next(c for c in await gateway.loras.cards(gateway) if c["id"] == model)
        await gateway.require_llm(model)
        return _model_card(model)

    @router.post("/load_lora_adapter")
    async def load_lora_adapter(request: Request):
        return PlainTextResponse(await gateway.loras.load(gateway, await _json_body(request)))

    @router.post("/unload_lora_adapter")
    async def unload_lora_adapter(request: Request):
        return PlainTextResponse(gateway.loras.unload(await _json_body(request)))

    @router.post("/completions")
    async def completions(request: Request):
        gen = parse_completion(await _json_body(request))
        model = gen.model   # the name the client asked for (an adapter's, before it is routed to its parent)
        return await respond(request, gateway, gen, lambda prompt: CompletionFormat(
            model, names, gen.include_usage, echo=gen.echo, prompt=prompt))

    @router.post("/chat/completions")
    async def chat_completions(request: Request):
        gen = parse_chat(await _json_body(request))
        model = gen.model
        return await respond(request, gateway, gen, lambda _prompt: ChatFormat(
            model, names, gen.include_usage, reasoning=reasoning, thinking=gen.enable_thinking is not False,
            include_reasoning=gen.include_reasoning, parse_tools=gen.tools is not None and gen.tools.parse_calls))

    return router


def _model_card(name: str) -> dict:
    return {"id": name, "object": "model", "created": 0, "owned_by": "triton"}


def _error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(_request, exc: APIError):
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(ClientGone)
    async def client_gone(_request, _exc):
        return Response(status_code=499)   # nobody is listening

    @app.exception_handler(Exception)
    async def internal(_request, exc: Exception):
        log.exception("request failed")
        body = APIError(500, f"internal error: {exc}", type="server_error").body()
        return JSONResponse(body, status_code=500)


def create_app(triton_url: str = "localhost:8001", api_key: str | None = None, tokenizer=None,
               reasoning: bool = True, responses_store: ResponseStore | None = None,
               loras: LoraAdapters | None = None) -> FastAPI:
    """The OpenAI-compatible app over the Triton server at `triton_url` (gRPC).
    tokenizer: a backend_lib Tokenizer for logprob token strings (optional).
    reasoning: split Qwen3's think block into reasoning_content (False: the raw text is the content).
    responses_store: where /v1/responses keeps responses (default: ResponseStore()'s bounds).
    loras: the LoRA adapters served as models (openai_frontend/lora.py; default: none until loaded at run time)."""
    gateway = TritonGateway(triton_url)
    if loras is not None:
        gateway.loras = loras

    @asynccontextmanager
    async def lifespan(_app):
        yield
        await gateway.close()

    app = FastAPI(title="Qwen3 on Triton: OpenAI-compatible API", lifespan=lifespan)
    app.state.gateway = gateway
    _error_handlers(app)

    @app.get("/health")
    async def health():
        ok = await gateway.healthy()
        return JSONResponse({"status": "ok" if ok else "unavailable"}, status_code=200 if ok else 503)

    app.include_router(_v1_routes(gateway, TokenNames(tokenizer), api_key, reasoning))
    app.include_router(responses_routes(gateway, ResponseStore() if responses_store is None else responses_store,
                                        _json_body, reasoning,
                                        [Depends(_api_key_check(api_key))]))
    app.include_router(tokenize_routes(gateway, ModelTokenizers(gateway, tokenizer), _json_body,
                                       [Depends(_api_key_check(api_key))]))
    mount_playground(app)   # the chat page at /
    return app
