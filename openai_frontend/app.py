"""The FastAPI app: routes, API-key check and OpenAI error bodies."""
from __future__ import annotations

import hmac
import json
import logging
import re
from contextlib import asynccontextmanager

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response

from .errors import APIError, bad_request, unauthorized
from .formats import ChatFormat, CompletionFormat, TokenNames
from .gateway import TritonGateway
from .generation import ClientGone, respond
from .params import parse_chat, parse_completion
from .playground import mount_playground
from .responses_api import responses_routes
from .responses_store import ResponseStore

log = logging.getLogger("openai_frontend")


MAX_JSON_DEPTH = 64
_JSON_SPECIAL = re.compile(rb'[\[\]{}"\\]')
_QUOTE, _BACKSLASH, _OPEN = ord('"'), ord("\\"), (ord("["), ord("{"))


def nested_deeper_than(raw: bytes, limit: int) -> bool:
    """Whether a JSON text nests arrays and objects deeper than `limit` (brackets inside strings do not
    count), found in one pass over its brackets and quotes, before any parsing: a deep body never reaches
    the recursive parser."""
    depth, in_string, escaped = 0, False, -1
    for m in _JSON_SPECIAL.finditer(raw):
        pos = m.start()
        c = raw[pos]
        if in_string:
            if pos == escaped:
                continue
            if c == _BACKSLASH:
                escaped = pos + 1
            elif c == _QUOTE:
                in_string = False
        elif c == _QUOTE:
            in_string = True
        elif c in _OPEN:
            depth += 1
            if depth > limit:
                return True
        elif c != _BACKSLASH:
            depth -= 1
    return False


def parse_json_body(raw: bytes):
    """The request body as JSON, or a 400: not JSON, or nested deeper than MAX_JSON_DEPTH."""
    if nested_deeper_than(raw, MAX_JSON_DEPTH):
        raise bad_request(f"the request body is nested deeper than {MAX_JSON_DEPTH} levels")
    try:
        return json.loads(raw)
    except (ValueError, RecursionError) as exc:   # JSONDecodeError, bad UTF-8, an integer of > 4300 digits
        raise bad_request(f"the request body is not valid JSON ({exc})") from None


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
        return {"object": "list", "data": [_model_card(m) for m in models]}

    @router.get("/models/{model:path}")
    async def get_model(model: str):
        await gateway.require_llm(model)
        return _model_card(model)

    @router.post("/completions")
    async def completions(request: Request):
        gen = parse_completion(await _json_body(request))
        return await respond(request, gateway, gen, CompletionFormat(gen.model, names, gen.include_usage))

    @router.post("/chat/completions")
    async def chat_completions(request: Request):
        gen = parse_chat(await _json_body(request))
        fmt = ChatFormat(gen.model, names, gen.include_usage, reasoning=reasoning,
                         thinking=gen.enable_thinking is not False, include_reasoning=gen.include_reasoning,
                         parse_tools=gen.tools is not None and gen.tools.parse_calls)
        return await respond(request, gateway, gen, fmt)

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
               reasoning: bool = True, responses_store: ResponseStore | None = None) -> FastAPI:
    """The OpenAI-compatible app over the Triton server at `triton_url` (gRPC).
    tokenizer: a backend_lib Tokenizer for logprob token strings (optional).
    reasoning: split Qwen3's think block into reasoning_content (False: the raw text is the content).
    responses_store: where /v1/responses keeps responses (default: ResponseStore()'s bounds)."""
    gateway = TritonGateway(triton_url)

    @asynccontextmanager
    async def lifespan(_app):
        yield
        await gateway.close()

    app = FastAPI(title="Qwen3 on Triton: OpenAI-compatible API", lifespan=lifespan)
    _error_handlers(app)

    @app.get("/health")
    async def health():
        ok = await gateway.healthy()
        return JSONResponse({"status": "ok" if ok else "unavailable"}, status_code=200 if ok else 503)

    app.include_router(_v1_routes(gateway, TokenNames(tokenizer), api_key, reasoning))
    app.include_router(responses_routes(gateway, ResponseStore() if responses_store is None else responses_store,
                                        _json_body, reasoning,
                                        [Depends(_api_key_check(api_key))]))
    mount_playground(app)   # the chat page at /
    return app
