"""/v1/embeddings, /v1/rerank (/v2/rerank, /rerank) and /v1/score over the Triton embedding and rerank models.

Each input (a text, an id list, a (query, document) pair) is one unary Triton request, all sent at once: Triton's
dynamic batcher groups them and the model runs a batch as one ragged forward, where each input's result is the
one it gets alone. A Triton error on input i is the request's 400 naming `input[i]` (`documents[i]`, `text_2[i]`),
never a 500. The models are told apart by their outputs (`embedding`: qwen3_embed, `score`: qwen3_rerank)."""
from __future__ import annotations

import asyncio
import base64
import math
import re
import time
import uuid

import numpy as np
import tritonclient.grpc as grpcclient
from fastapi import APIRouter
from tritonclient.utils import InferenceServerException

from .errors import APIError, bad_request, model_not_found, unavailable
from .embeddings_protocol import EmbeddingRequest, RerankRequest, ScoreRequest
from .gateway import EMBED, RERANK, UNARY_TIMEOUT_S, TritonGateway
from .protocol import json_body, request_body

_ITEM_FIELD = re.compile(r"^(text_input|input_ids|document)\b:?\s*")   # the input's own: renamed input[i], ...
_BODY_FIELD = re.compile(r"^(prompt_name|dimensions|instruction|query)\b")      # the body's: named as sent


class EmbeddingModels:
    """Which served models embed or rerank (from their config's outputs), and the unary calls to them."""

    def __init__(self, gateway: TritonGateway):
        self.gateway = gateway

    async def kind(self, model: str) -> str | None:
        g = self.gateway
        if not await g._call(g.client.is_model_ready(model, client_timeout=UNARY_TIMEOUT_S)):
            if model in await g.model_names():
                raise unavailable(f"The model '{model}' is not ready")
            raise model_not_found(model)
        return await g.model_kind(model)

    async def require(self, model: str, *kinds: str) -> str:
        kind = await self.kind(model)
        if kind not in kinds:
            what = " or ".join("an embedding" if k == EMBED else "a rerank" for k in kinds)
            raise APIError(400, f"model: '{model}' is not {what} model", param="model", code="model_not_supported")
        return kind

    @staticmethod
    def _tensor(name: str, arr: np.ndarray, dtype: str):
        t = grpcclient.InferInput(name, list(arr.shape), dtype)
        t.set_data_from_numpy(arr)
        return t

    @classmethod
    def _text(cls, name: str, text: str):
        return cls._tensor(name, np.array([[text.encode()]], dtype=np.object_), "BYTES")

    async def _infer(self, model: str, tensors: list, output: str, field: str):
        try:
            result = await self.gateway.client.infer(model, tensors, client_timeout=UNARY_TIMEOUT_S)
        except InferenceServerException as exc:
            status, message = str(exc.status() or ""), exc.message() or str(exc)
            if "INVALID_ARG" in status or "INVALID_ARGUMENT" in status:
                body_field = _BODY_FIELD.match(message)
                if body_field:
                    raise bad_request(message, body_field.group(1)) from None
                raise bad_request(_ITEM_FIELD.sub(f"{field}: ", message, count=1), field.split("[")[0]) from None
            if "UNAVAILABLE" in status or "DEADLINE" in status:
                raise unavailable(f"Triton is not reachable: {message}") from None
            raise APIError(500, f"Triton error: {message}", type="server_error") from None
        return result.as_numpy(output).reshape(-1), int(result.as_numpy("num_input_tokens").reshape(-1)[0])

    async def embed(self, model: str, item, field: str, dimensions: int | None, prompt_name: str | None):
        if isinstance(item, str):
            tensors = [self._text("text_input", item)]
        else:
            tensors = [self._tensor("input_ids", np.array([item], dtype=np.int32), "INT32")]
        if dimensions is not None:
            tensors.append(self._tensor("dimensions", np.array([[dimensions]], dtype=np.int32), "INT32"))
        if prompt_name is not None:
            tensors.append(self._text("prompt_name", prompt_name))
        return await self._infer(model, tensors, "embedding", field)

    async def score(self, model: str, query: str, document: str, instruction: str | None, field: str):
        tensors = [self._text("query", query), self._text("document", document)]
        if instruction is not None:
            tensors.append(self._text("instruction", instruction))
        values, tokens = await self._infer(model, tensors, "score", field)
        return float(values[0]), tokens


async def _all(coros):
    """Every call's result, or the first error (the others are cancelled: their results would be dropped)."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        return await asyncio.gather(*tasks)
    except BaseException:
        for t in tasks:
            t.cancel()
        raise


def _cosine(a: np.ndarray, b: np.ndarray) -> float:
    a, b = a.astype(np.float64), b.astype(np.float64)
    return float(a @ b / max(math.sqrt(float(a @ a) * float(b @ b)), 1e-300))


def embedding_routes(gateway: TritonGateway, dependencies) -> APIRouter:
    models = EmbeddingModels(gateway)
    router = APIRouter(dependencies=dependencies)

    @router.post("/v1/embeddings", openapi_extra=request_body(EmbeddingRequest))
    async def embeddings(body: EmbeddingRequest = json_body(EmbeddingRequest)):
        await models.require(body.model, EMBED)
        items = body.items()
        results = await _all(models.embed(body.model, item, "input" if body.single else f"input[{i}]",
                                          body.dimensions, body.prompt_name) for i, item in enumerate(items))
        data = []
        for i, (vector, _) in enumerate(results):
            vector = vector.astype("<f4")
            value = base64.b64encode(vector.tobytes()).decode() if body.encoding_format == "base64" \
                else vector.tolist()
            data.append({"object": "embedding", "index": i, "embedding": value})
        tokens = sum(n for _, n in results)
        return {"id": f"embd-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()), "model": body.model,
                "data": data, "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}

    async def rerank(body: RerankRequest = json_body(RerankRequest)):
        await models.require(body.model, RERANK)
        docs = body.texts()
        results = await _all(models.score(body.model, body.query, d, body.instruction, f"documents[{i}]")
                             for i, d in enumerate(docs))
        order = sorted(range(len(docs)), key=lambda i: -results[i][0])   # stable: ties keep document order
        if body.top_n:
            order = order[:body.top_n]
        out = []
        for i in order:
            entry = {"index": i, "relevance_score": results[i][0]}
            if body.return_documents is not False:
                entry["document"] = {"text": docs[i]}
            out.append(entry)
        tokens = sum(n for _, n in results)
        return {"id": f"rerank-{uuid.uuid4().hex}", "model": body.model, "usage": {"total_tokens": tokens},
                "results": out}

    for path in ("/v1/rerank", "/v2/rerank", "/rerank"):
        router.add_api_route(path, rerank, methods=["POST"], openapi_extra=request_body(RerankRequest))

    async def score(body: ScoreRequest = json_body(ScoreRequest)):
        kind = await models.require(body.model, RERANK, EMBED)
        pairs = body.pairs()

        def where(name: str, i: int) -> str:
            return f"{name}[{i}]" if isinstance(getattr(body, name), list) else name

        if kind == RERANK:
            results = await _all(models.score(body.model, q, d, body.instruction, where("text_2", i))
                                 for i, (q, d) in enumerate(pairs))
        else:
            if body.instruction is not None:
                raise bad_request("instruction: only with a rerank model", "instruction")
            queries = list(dict.fromkeys(q for q, _ in pairs))
            firsts = dict(zip(queries, await _all(models.embed(body.model, q, where("text_1", i), None, None)
                                                  for i, q in enumerate(queries))))
            seconds = await _all(models.embed(body.model, d, where("text_2", i), None, None)
                                 for i, (_, d) in enumerate(pairs))
            results = [(_cosine(firsts[q][0], v), firsts[q][1] + n) for (q, _), (v, n) in zip(pairs, seconds)]
        tokens = sum(n for _, n in results)
        return {"id": f"score-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()), "model": body.model,
                "data": [{"index": i, "object": "score", "score": s} for i, (s, _) in enumerate(results)],
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}

    for path in ("/v1/score", "/score"):
        router.add_api_route(path, score, methods=["POST"], openapi_extra=request_body(ScoreRequest))
    return router
