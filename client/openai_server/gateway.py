"""Triton over asyncio gRPC: health, the LLM models, the chat template, and cancellable token streams."""
from __future__ import annotations

import asyncio
import json
import uuid
from dataclasses import dataclass, field

import grpc
import numpy as np
import tritonclient.grpc as grpcclient
import tritonclient.grpc.aio as aio
from tritonclient.utils import InferenceServerException

from ..triton_inputs import is_final, response_text
from .errors import APIError, from_triton, model_not_found, unavailable

TOKENIZER_MODEL = "qwen3_tokenizer"
UNARY_TIMEOUT_S = 30.0


@dataclass
class Delta:
    """One LLM response: new text and ids, their logprob entries, the prompt length, whether it is the last."""
    text: str
    ids: list[int]
    logprobs: list[dict] = field(default_factory=list)
    finish_reason: str | None = None
    num_input_tokens: int = 0
    final: bool = False


def _transport_error(exc: Exception) -> APIError:
    """A failed gRPC call: Triton down -> 503, model missing -> 404, anything else -> 500."""
    status = exc.status() if isinstance(exc, InferenceServerException) else getattr(exc, "code", lambda: None)()
    status = str(status or "")
    message = exc.message() if isinstance(exc, InferenceServerException) else str(exc)
    if "UNAVAILABLE" in status or "DEADLINE_EXCEEDED" in status:
        return unavailable(f"Triton is not reachable: {message}")
    if "NOT_FOUND" in status:
        return APIError(404, message, param="model", code="model_not_found")
    if "INVALID_ARG" in status:
        return from_triton(message)
    return APIError(500, f"Triton error: {message}", type="server_error")


def _delta(result) -> Delta:
    text, ids = response_text(result)

    def first(name, default=0):
        arr = result.as_numpy(name)
        return arr.reshape(-1)[0] if arr is not None and arr.size else default

    reason = first("finish_reason", None)
    logprobs = result.as_numpy("logprobs")
    return Delta(text, ids, [json.loads(x) for x in logprobs] if logprobs is not None else [],
                 reason.decode() if reason is not None else None, int(first("num_input_tokens")), is_final(result))


def is_llm_config(config: dict) -> bool:
    """A streaming LLM model: takes input_ids, returns text_output, and is not an ensemble."""
    inputs = {t["name"] for t in config.get("input", [])}
    outputs = {t["name"] for t in config.get("output", [])}
    return config.get("platform") != "ensemble" and "input_ids" in inputs and "text_output" in outputs


class TritonStream:
    """One streaming LLM request. Iterate it for Deltas; close() cancels the gRPC call unless it ended,
    which makes Triton cancel the request (the LLM models then abort it and free its KV pages)."""

    def __init__(self, client: aio.InferenceServerClient, model: str, inputs: list):
        self._ended = asyncio.Event()   # ends the request side once the final response arrived
        self._finished = False

        async def requests():
            yield {"model_name": model, "inputs": inputs, "request_id": uuid.uuid4().hex,
                   "enable_empty_final_response": True}
            await self._ended.wait()

        self._call = client.stream_infer(requests())

    async def __aiter__(self):
        try:
            async for result, error in self._call:
                if error is not None:
                    raise from_triton(error.message())
                delta = _delta(result)
                yield delta
                if delta.final:
                    self._finished = True
                    return
        except (grpc.RpcError, InferenceServerException) as exc:
            raise _transport_error(exc) from None
        finally:
            self.close()   # cancels the call unless the final response arrived

    def close(self) -> None:
        if not self._finished:
            self._finished = True
            self._call.cancel()
        self._ended.set()


class TritonGateway:
    def __init__(self, url: str):
        self.url = url
        self._client: aio.InferenceServerClient | None = None
        self._is_llm: dict[str, bool] = {}

    @property
    def client(self) -> aio.InferenceServerClient:
        if self._client is None:   # created lazily, inside the server's event loop
            self._client = aio.InferenceServerClient(self.url)
        return self._client

    async def close(self) -> None:
        if self._client is not None:
            await self._client.close()

    async def healthy(self) -> bool:
        try:
            return (await self.client.is_server_live(client_timeout=5.0)
                    and await self.client.is_server_ready(client_timeout=5.0))
        except (grpc.RpcError, InferenceServerException):
            return False

    async def _call(self, coro):
        try:
            return await coro
        except (grpc.RpcError, InferenceServerException) as exc:
            raise _transport_error(exc) from None

    async def _llm(self, name: str) -> bool:
        if name not in self._is_llm:
            config = await self._call(self.client.get_model_config(name, as_json=True,
                                                                   client_timeout=UNARY_TIMEOUT_S))
            self._is_llm[name] = is_llm_config(config.get("config", {}))
        return self._is_llm[name]

    async def llm_models(self) -> list[str]:
        """The ready models that are streaming LLMs (not ensembles, not the tokenizer)."""
        index = await self._call(self.client.get_model_repository_index(as_json=True,
                                                                        client_timeout=UNARY_TIMEOUT_S))
        ready = sorted({m["name"] for m in index.get("models", []) if m.get("state") == "READY"})
        return [name for name in ready if await self._llm(name)]

    async def require_llm(self, name: str) -> None:
        """404 for a model Triton does not know or that is not an LLM; 503 for one not ready."""
        if not await self._call(self.client.is_model_ready(name, client_timeout=UNARY_TIMEOUT_S)):
            index = await self._call(self.client.get_model_repository_index(as_json=True,
                                                                            client_timeout=UNARY_TIMEOUT_S))
            if any(m["name"] == name for m in index.get("models", [])):
                raise unavailable(f"The model '{name}' is not ready")
            raise model_not_found(name)
        if not await self._llm(name):
            raise model_not_found(name)

    async def chat_input_ids(self, messages: list[dict], enable_thinking: bool | None) -> list[int]:
        """Prompt ids of a conversation, from the tokenizer model's chat template."""
        tensors = [self._batch1("messages", json.dumps(messages, ensure_ascii=False).encode(), "BYTES"),
                   self._batch1("add_generation_prompt", True, "BOOL")]
        if enable_thinking is not None:
            tensors.append(self._batch1("enable_thinking", enable_thinking, "BOOL"))
        try:
            result = await self.client.infer(TOKENIZER_MODEL, tensors, client_timeout=UNARY_TIMEOUT_S)
        except InferenceServerException as exc:
            if "NOT_FOUND" in str(exc.status() or "") or "unknown model" in exc.message().lower():
                raise unavailable(f"the tokenizer model '{TOKENIZER_MODEL}' is not served") from None
            raise _transport_error(exc) from None
        return result.as_numpy("input_ids")[0].tolist()

    @staticmethod
    def _batch1(name: str, value, dtype: str):
        """A [1, 1] tensor: the tokenizer model batches (max_batch_size > 0)."""
        arr = np.array([[value]], dtype=bool if dtype == "BOOL" else np.object_)
        tensor = grpcclient.InferInput(name, list(arr.shape), dtype)
        tensor.set_data_from_numpy(arr)
        return tensor

    def stream(self, model: str, inputs: list) -> TritonStream:
        return TritonStream(self.client, model, inputs)
