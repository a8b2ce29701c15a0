"""An OpenAI-compatible HTTP front (/v1/completions, /v1/chat/completions, /v1/responses, /v1/models, and a chat
playground at /) over the Triton
LLM models: chat through the tokenizer model's template, tokens streamed from the LLM model directly
so that a client that goes away aborts its request.

    python -m openai_frontend [--triton-url localhost:8001] [--port 9000] [--api-key KEY]

Modules: params (request validation), gateway (Triton over asyncio gRPC), formats (OpenAI objects),
generation (stream or whole response, aborts), app (routes, auth, errors); the Responses API: responses_params
(a Responses request as a chat one), responses_api (output items, typed events, routes), responses_store (the
bounded store); playground (the static chat page in static/).
"""
from .app import create_app

__all__ = ["create_app"]
