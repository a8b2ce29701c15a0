"""The FastAPI app: routes, API-key check and OpenAI error bodies."""
from __future__ import annotations

import hmac
import logging
from contextlib import asynccontextmanager

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, PlainTextResponse, Response

from .embeddings_api import embedding_routes
from .embeddings_protocol import EMBEDDING_BODIES
from .errors import APIError, unauthorized
from .formats import ChatFormat, CompletionFormat, TokenNames
from .gateway import TritonGateway
from .generation import ClientGone, respond
from .lora import LoraAdapters
from .metrics import CountRequests, FrontMetrics, default_triton_metrics_url
from .params import chat_generation, completion_generation
from .playground import mount_playground
from .protocol import (BODIES, ChatCompletionRequest, CompletionRequest, LoadLoRAAdapterRequest,
                       UnloadLoRAAdapterRequest, api_error, component_schemas, json_body, request_body)
from .protocol import parse_json_body  # noqa: F401  (the body reader, also imported from here)
from .responses_api import responses_routes
from .responses_store import ResponseStore
from .tokenize_api import ModelTokenizers, tokenize_routes

log = logging.getLogger("openai_frontend")


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
        models = await gateway.served_models()   # the LLMs, the embedding and the rerank models
        return {"object": "list", "data": [_model_card(m) for m in models] + await gateway.loras.cards(gateway)}

    @router.get("/models/{model:path}")
    async def get_model(model: str):
        if model in gateway.loras:
            return next(c for c in await gateway.loras.cards(gateway) if c["id"] == model)
        if model not in await gateway.served_models():
            await gateway.require_llm(model)   # the 404 / 503 of a model that is not served (or not ready)
        return _model_card(model)

    @router.post("/load_lora_adapter", openapi_extra=request_body(LoadLoRAAdapterRequest))
    async def load_lora_adapter(body: LoadLoRAAdapterRequest = json_body(LoadLoRAAdapterRequest)):
        return PlainTextResponse(await gateway.loras.load(gateway, body))

    @router.post("/unload_lora_adapter", openapi_extra=request_body(UnloadLoRAAdapterRequest))
    async def unload_lora_adapter(body: UnloadLoRAAdapterRequest = json_body(UnloadLoRAAdapterRequest)):
        return PlainTextResponse(gateway.loras.unload(body))

    @router.post("/completions", openapi_extra=request_body(CompletionRequest))
    async def completions(request: Request, body: CompletionRequest = json_body(CompletionRequest)):
        gen = completion_generation(body)
        model = gen.model   # the name the client asked for (an adapter's, before it is routed to its parent)
        return await respond(request, gateway, gen, lambda prompt: CompletionFormat(
            model, names, gen.include_usage, echo=gen.echo, prompt=prompt))

    @router.post("/chat/completions", openapi_extra=request_body(ChatCompletionRequest))
    async def chat_completions(request: Request, body: ChatCompletionRequest = json_body(ChatCompletionRequest)):
        gen = chat_generation(body)
        model = gen.model
        return await respond(request, gateway, gen, lambda _prompt: ChatFormat(
            model, names, gen.include_usage, reasoning=reasoning, thinking=gen.enable_thinking is not False,
            include_reasoning=gen.include_reasoning, parse_tools=gen.tools is not None and gen.tools.parse_calls,
            forced_tools=gen.tools is not None and gen.tools.choice in ("required", None)))

    return router


def _model_card(name: str) -> dict:
    return {"id": name, "object": "model", "created": 0, "owned_by": "triton"}


def _error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(_request, exc: APIError):
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(RequestValidationError)
    async def invalid(_request, exc: RequestValidationError):
        """FastAPI's own validation (a route's path or query parameters): one 400 in OpenAI's shape."""
        errors = [{**e, "loc": tuple(e["loc"][1:])} for e in exc.errors()]   # ("query", "x") -> ("x",)
        where = {e["loc"][0]: e.get("input") for e in errors if e["loc"]}
        return JSONResponse(api_error(errors, exc.body if exc.errors()[0]["loc"][:1] == ("body",) else where).body(),
                            status_code=400)

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
               loras: LoraAdapters | None = None, triton_metrics_url: str | None = None,
               model_repository: str | None = None) -> FastAPI:
    """The OpenAI-compatible app over the Triton server at `triton_url` (gRPC).
    tokenizer: a backend_lib Tokenizer for logprob token strings (optional).
    reasoning: split Qwen3's think block into reasoning_content (False: the raw text is the content).
    responses_store: where /v1/responses keeps responses (default: ResponseStore()'s bounds).
    loras: the LoRA adapters served as models (openai_frontend/lora.py; default: none until loaded at run time).
    triton_metrics_url: Triton's metrics page, appended to /metrics (default: the host of `triton_url`, port 8002;
    "": none).
    model_repository: Triton's model repository folder, where a model's relative checkpoint path is resolved for
    /detokenize and token strings (tokenize_api.ModelTokenizers)."""
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
    metrics = FrontMetrics(default_triton_metrics_url(triton_url) if triton_metrics_url is None
                           else triton_metrics_url)
    app.add_middleware(CountRequests, metrics=metrics)

    @app.get("/metrics", response_class=PlainTextResponse)
    async def prometheus_metrics():
        """Prometheus text: the front's request counters and latency histograms, then Triton's metrics."""
        return await metrics.response()

    @app.get("/health")
    async def health():
        ok = await gateway.healthy()
        return JSONResponse({"status": "ok" if ok else "unavailable"}, status_code=200 if ok else 503)

    app.include_router(_v1_routes(gateway, TokenNames(tokenizer), api_key, reasoning))
    app.include_router(responses_routes(gateway, ResponseStore() if responses_store is None else responses_store,
                                        reasoning, [Depends(_api_key_check(api_key))]))
    app.include_router(tokenize_routes(gateway, ModelTokenizers(gateway, tokenizer, model_repository),
                                       [Depends(_api_key_check(api_key))]))
    app.include_router(embedding_routes(gateway, [Depends(_api_key_check(api_key))]))
    mount_playground(app)   # the chat page at /
    _documented(app)
    return app


def _documented(app: FastAPI) -> None:
    """/openapi.json (and /docs) with the request bodies' schemas: routes read their body with
    protocol.json_body (the strict JSON parser), so FastAPI does not see the models; they are added here."""
    def openapi():
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
            schema.setdefault("components", {}).setdefault("schemas", {}).update(component_schemas(BODIES + EMBEDDING_BODIES))
            app.openapi_schema = schema
        return app.openapi_schema
    app.openapi = openapi
