"""Triton over asyncio gRPC: health, the LLM models, the chat template, and abortable token streams."""
from __future__ import annotations

import asyncio
import json
import logging
import uuid
from dataclasses import dataclass, field

import grpc
import numpy as np
import tritonclient.grpc as grpcclient
import tritonclient.grpc.aio as aio
from tritonclient.utils import InferenceServerException

from client.triton_inputs import is_final, response_text
from .errors import APIError, from_triton, model_not_found, unavailable

TOKENIZER_MODEL = "qwen3_tokenizer"
log = logging.getLogger("openai_frontend")
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
    prompt_logprobs: list[dict] | None = None   # every prompt token's entry (prompt_logprobs), once
    num_cached_tokens: int = 0


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
    plp = result.as_numpy("prompt_logprobs")
    return Delta(text, ids, [e for x in logprobs for e in _entries(json.loads(x))] if logprobs is not None else [],
                 reason.decode() if reason is not None else None, int(first("num_input_tokens")), is_final(result),
                 [json.loads(x) for x in plp] if plp is not None else None, int(first("num_cached_tokens")))


def _entries(tokens: list[dict] | None) -> list[dict]:
    """The LLM model's logprobs (vllm_backend's shape: per token {id: {logprob, rank, decoded_token}}, the
    sampled token first) as entries {id, logprob, text, top: every listed token by rank}; the front keeps
    the top N it was asked for."""
    out = []
    for d in tokens or []:
        items = [{"id": int(k), "logprob": v["logprob"], "rank": v.get("rank"), "text": v.get("decoded_token")}
                 for k, v in d.items()]
        if not items:
            continue
        first = items[0]
        top = sorted(items, key=lambda t: (t["logprob"] is None, -(t["logprob"] or 0.0)))
        out.append({**first, "top": top})
    return out


GENERATE, EMBED, RERANK = "generate", "embed", "rerank"


def model_kind(config: dict) -> str | None:
    """What a served model does, from its config: GENERATE (a streaming LLM: takes input_ids, returns text_output,
    not an ensemble), EMBED (returns embedding), RERANK (returns score), or None (the tokenizer, ensembles)."""
    if config.get("platform") == "ensemble":
        return None
    inputs = {t["name"] for t in config.get("input", [])}
    outputs = {t["name"] for t in config.get("output", [])}
    if "input_ids" in inputs and "text_output" in outputs:
        return GENERATE
    return EMBED if "embedding" in outputs else RERANK if "score" in outputs else None


ABORT_WAIT_S = 10.0   # an aborted request's final response comes in milliseconds after its abort; past this, cancel
# a close() before the abort token came: the abort is sent when the token does (the model returns it at admission,
# which a request queued behind a full batch may wait for); the stream is cancelled only if none came in this time
TOKEN_WAIT_S = 120.0
# responses a consumer may leave unread (a stream whose client stopped reading: its response is paused at the
# socket's bound, connections.py); past this the request is aborted, so it never holds the model's slot
MAX_UNREAD = 128
SHUTDOWN_WAIT_S = 2.0   # at shutdown the streams were aborted at the signal: they are over or never will be
_END = object()


class TritonStream:
    """One streaming LLM request. Iterate it for Deltas; close() stops the request early.

    A task of its own reads the gRPC stream (a consumer that is cancelled, e.g. by a client that went away,
    only stops waiting on a queue: cancelling a task that awaits a gRPC read would cancel the call).
    close() never cancels the call, which would hit Triton 2.51's gRPC stream-cancellation race (a server
    segfault, fixed upstream only in 24.12/25.03). It sends, on the same stream, a second request that
    carries only `abort_request_id` = this request's id and `abort_token`, the capability the model returned
    in the request's first response (`return_abort_token`; an id alone aborts nothing, so no client can end
    another's request): the model aborts the request, which frees its KV pages and ends it with a final
    response (finish_reason "abort"). A close() before that first response arrived sends the abort as soon
    as it does. The reader reads on until the generation's final response, then ends the request side
    (half-close), so the stream finishes normally. Only when that takes longer than ABORT_WAIT_S is the
    call cancelled.

    Responses are told apart by their id: the abort request's own (empty, final) response is not the
    generation's; the abort-token response is consumed here, never yielded."""

    def __init__(self, client: aio.InferenceServerClient, model: str, inputs: list,
                 abort_wait_s: float = ABORT_WAIT_S, token_wait_s: float = TOKEN_WAIT_S):
        self.model = model
        self.request_id = uuid.uuid4().hex
        self.abort_id = f"{self.request_id}-abort"
        self.aborted = False          # an abort request was sent
        self.abort_token: str | None = None   # from the first response (return_abort_token)
        self._abort_pending = False   # close() came before the abort token
        self.fell_back_to_cancel = False
        self.unread_abort = False     # aborted because its consumer left MAX_UNREAD responses unread
        self._abort_wait_s = abort_wait_s
        self._token_wait_s = token_wait_s
        self._watchdog_s = 0.0
        self._outbox: asyncio.Queue = asyncio.Queue()   # requests to send; None ends the request side
        self._deltas: asyncio.Queue = asyncio.Queue()   # Delta | APIError | _END
        self._generation_done = False   # its final response (or an error) arrived: nothing left to abort
        self._closing = False
        self._half_closed = False
        self._watchdog: asyncio.TimerHandle | None = None
        self._outbox.put_nowait({"model_name": model, "inputs": inputs, "request_id": self.request_id})
        self._call = client.stream_infer(self._requests())
        self._reader = asyncio.ensure_future(self._read())   # referenced by the gateway while it runs

    async def _requests(self):
        while (request := await self._outbox.get()) is not None:
            yield request

    def _half_close(self) -> None:
        if not self._half_closed:
            self._half_closed = True
            self._outbox.put_nowait(None)
            self._arm_watchdog()   # the stream now ends as soon as Triton has answered everything

    def _arm_watchdog(self, seconds: float | None = None) -> None:
        """Cancels the call unless the stream ends within `seconds` (default ABORT_WAIT_S) from now; a watchdog
        already armed for longer is brought forward (the abort was sent at last), never pushed back."""
        seconds = self._abort_wait_s if seconds is None else seconds
        if self._watchdog is not None:
            if self._watchdog_s <= seconds:
                return
            self._watchdog.cancel()
        self._watchdog_s = seconds
        self._watchdog = asyncio.get_running_loop().call_later(seconds, self._expire)

    def _expire(self) -> None:
        """The stream did not finish in time (the abort was not honoured, or no abort token came to send it
        with): cancel it after all."""
        if not self._reader.done():
            if self.abort_token is None and self.aborted:
                log.warning("Triton request %s sent no abort token within %g s of its close; cancelling the stream",
                            self.request_id, self._watchdog_s)
            else:
                log.warning("Triton request %s did not end within %g s of its abort; cancelling the stream",
                            self.request_id, self._watchdog_s)
            self.fell_back_to_cancel = True
            self._call.cancel()

    def _generation_ended(self) -> None:
        self._generation_done = True
        self._half_close()

    async def _read(self) -> None:
        try:
            async for result, error in self._call:
                if error is not None:
                    # errors carry no response id. Before an abort only the generation is in flight, so
                    # this is its final answer; after one it may be either, and the half-close below ends
                    # the stream once the generation is over too (or the watchdog cancels it).
                    if not self._closing:
                        self._deltas.put_nowait(from_triton(error.message()))
                    self._generation_ended()
                    continue
                if result.get_response().id != self.request_id:
                    continue   # the abort request's empty final response
                token = result.as_numpy("abort_token")
                if token is not None and token.size:
                    self.abort_token = token.reshape(-1)[0].decode()
                    if self._abort_pending:
                        self._send_abort()
                    if not is_final(result):
                        continue
                delta = _delta(result)
                if not self._closing:
                    self._deltas.put_nowait(delta)
                    if self._deltas.qsize() >= MAX_UNREAD and not delta.final and not self.aborted:
                        log.warning("Triton request %s: %d responses unread (the client stopped reading); aborting it",
                                    self.request_id, MAX_UNREAD)
                        self.unread_abort = True
                        self.abort()
                if delta.final:
                    self._generation_ended()
        except (grpc.RpcError, InferenceServerException) as exc:
            if not self._closing:
                self._deltas.put_nowait(_transport_error(exc))
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if task is not None and task.cancelling():   # this task was cancelled: the loop is shutting down
                self._call.cancel()
                raise
            # else the call was cancelled (the watchdog): the stream is over
        except Exception as exc:   # never leave a consumer waiting
            log.exception("reading Triton stream %s failed", self.request_id)
            self._deltas.put_nowait(APIError(500, f"Triton stream failed: {exc}", type="server_error"))
        finally:
            self._generation_done = True
            if self._watchdog is not None:
                self._watchdog.cancel()
            self._deltas.put_nowait(_END)

    async def __aiter__(self):
        try:
            while True:
                item = await self._deltas.get()
                if item is _END:
                    if not self._closing:
                        raise APIError(502, "the Triton stream ended before the final response",
                                       type="server_error")
                    return
                if isinstance(item, APIError):
                    raise item
                yield item
                if item.final:
                    return
        finally:
            self.close()   # aborts the request unless its final response arrived

    def close(self) -> None:
        """The consumer is gone: stops the request if it is still running (an abort request on the same stream,
        see the class); nothing more is delivered."""
        if self._closing:
            return
        self._closing = True
        self.abort()

    def abort(self) -> None:
        """Ends the request early (a stop signal) while the consumer still reads: the final response, with
        finish_reason "abort", is delivered as usual."""
        if self._generation_done or self.aborted:
            return
        self.aborted = True
        if self.abort_token is None:
            self._abort_pending = True   # sent when the token arrives (the model sends it at admission)
            self._arm_watchdog(self._token_wait_s)
        else:
            self._send_abort()

    def _send_abort(self) -> None:
        self._abort_pending = False
        if self._half_closed:
            return
        self._arm_watchdog()   # from the abort's sending: the fallback means "the abort was not honoured"
        inputs = []
        for name, value in (("abort_request_id", self.request_id), ("abort_token", self.abort_token)):
            tensor = grpcclient.InferInput(name, [1], "BYTES")
            tensor.set_data_from_numpy(np.array([value.encode()], dtype=np.object_))
            inputs.append(tensor)
        self._outbox.put_nowait({"model_name": self.model, "inputs": inputs, "request_id": self.abort_id})

    @property
    def finished(self) -> asyncio.Task:
        """Done once the gRPC stream has ended."""
        return self._reader


class TritonGateway:
    def __init__(self, url: str):
        self.url = url
        self._client: aio.InferenceServerClient | None = None
        self._kinds: dict[str, str | None] = {}
        self._streams: set[TritonStream] = set()
        from .lora import LoraAdapters

        self.loras = LoraAdapters()   # LoRA adapters served as models (create_app sets the configured ones)

    @property
    def client(self) -> aio.InferenceServerClient:
        if self._client is None:   # created lazily, inside the server's event loop
            self._client = aio.InferenceServerClient(self.url)
        return self._client

    def abort_all(self) -> None:
        """Aborts every open Triton stream (a stop signal): each ends with its final response at once."""
        for stream in list(self._streams):
            stream.abort()

    async def close(self) -> None:
        """Shutdown: aborts the streams still open and waits (bounded) for them to end before the channel
        closes, which would cancel them (a gRPC cancellation, see TritonStream)."""
        streams = list(self._streams)
        for stream in streams:
            stream.close()
        if streams:
            await asyncio.wait([s.finished for s in streams], timeout=SHUTDOWN_WAIT_S)
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

    async def model_kind(self, name: str) -> str | None:
        """model_kind() of a model Triton knows (its config read once)."""
        if name not in self._kinds:
            config = await self._call(self.client.get_model_config(name, as_json=True,
                                                                   client_timeout=UNARY_TIMEOUT_S))
            self._kinds[name] = model_kind(config.get("config", {}))
        return self._kinds[name]

    async def _llm(self, name: str) -> bool:
        return await self.model_kind(name) == GENERATE

    async def served_models(self, *kinds: str) -> list[str]:
        """The ready models of these kinds (default: every kind /v1/models lists), sorted by name."""
        index = await self._call(self.client.get_model_repository_index(as_json=True,
                                                                        client_timeout=UNARY_TIMEOUT_S))
        ready = sorted({m["name"] for m in index.get("models", []) if m.get("state") == "READY"})
        kinds = kinds or (GENERATE, EMBED, RERANK)
        return [name for name in ready if await self.model_kind(name) in kinds]

    async def llm_models(self) -> list[str]:
        """The ready models that are streaming LLMs (not ensembles, not the tokenizer, not embedding models)."""
        return await self.served_models(GENERATE)

    async def model_names(self) -> set[str]:
        """Every model of Triton's repository, whatever its state or kind."""
        index = await self._call(self.client.get_model_repository_index(as_json=True,
                                                                        client_timeout=UNARY_TIMEOUT_S))
        return {m["name"] for m in index.get("models", [])}

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

    async def model_parameters(self, name: str) -> dict[str, str]:
        """The string parameters of a model's config (checkpoint, max_model_len, ...)."""
        config = await self._call(self.client.get_model_config(name, as_json=True, client_timeout=UNARY_TIMEOUT_S))
        return {k: v.get("string_value", "") for k, v in config.get("config", {}).get("parameters", {}).items()}

    async def text_input_ids(self, text: str) -> list[int]:
        """A text's ids from the tokenizer model (the models' own tokenizer)."""
        return await self._tokenize([self._batch1("text_input", text.encode(), "BYTES")])

    async def chat_input_ids(self, messages: list[dict], enable_thinking: bool | None,
                             tools: list[dict] | None = None, add_generation_prompt: bool = True) -> list[int]:
        """Prompt ids of a conversation (and its tools), from the tokenizer model's chat template."""
        tensors = [self._batch1("messages", json.dumps(messages, ensure_ascii=False).encode(), "BYTES"),
                   self._batch1("add_generation_prompt", add_generation_prompt, "BOOL")]
        if enable_thinking is not None:
            tensors.append(self._batch1("enable_thinking", enable_thinking, "BOOL"))
        if tools:
            tensors.append(self._batch1("tools", json.dumps(tools, ensure_ascii=False).encode(), "BYTES"))
        return await self._tokenize(tensors)

    async def _tokenize(self, tensors: list) -> list[int]:
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
        stream = TritonStream(self.client, model, inputs)
        self._streams.add(stream)   # also the strong reference that keeps its reader task alive
        stream.finished.add_done_callback(lambda _task: self._streams.discard(stream))
        return stream
