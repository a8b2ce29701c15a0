"""One generation from request to response: the Triton stream as SSE chunks or one whole object.

Errors before the first token (bad fields, unknown model) become HTTP statuses; a client that goes
away, mid-stream or while waiting for a whole response, aborts the Triton request (TritonStream.close:
an abort request on the same gRPC stream, never a cancellation).
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from .errors import APIError
from .formats import SSE_DONE, ResponseFormat, sse, usage
from .gateway import Delta, TritonGateway
from .params import Generation

# Triton finish reasons -> OpenAI's; a request ended early (cancelled, or aborted: by a client's abort
# request or a model unload) reads as vLLM's "abort"
FINISH_REASONS = {"stop": "stop", "length": "length", "cancelled": "abort", "abort": "abort"}


class ClientGone(Exception):
    """The HTTP client disconnected before the response was ready."""


@dataclass
class Tally:
    """What a generation produced so far."""
    text: list[str] = field(default_factory=list)
    entries: list[dict] = field(default_factory=list)
    prompt_tokens: int = 0
    completion_tokens: int = 0
    finish_reason: str | None = None

    def add(self, delta: Delta) -> None:
        self.text.append(delta.text)
        self.entries.extend(delta.logprobs)
        self.prompt_tokens = max(self.prompt_tokens, delta.num_input_tokens)
        self.completion_tokens += len(delta.ids)
        self.finish_reason = delta.finish_reason or self.finish_reason

    @property
    def reason(self) -> str:
        return FINISH_REASONS.get(self.finish_reason or "stop", self.finish_reason)

    @property
    def usage(self) -> dict:
        return usage(self.prompt_tokens, self.completion_tokens)


class SSEResponse(StreamingResponse):
    """Server-sent events; `on_close` runs however the response ends (done, error, client gone)."""

    def __init__(self, events, on_close):
        super().__init__(events, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._on_close = on_close

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def until_disconnect(request: Request, awaitable, cancel: bool = True):
    """Awaits `awaitable`, raising ClientGone if the client disconnects first. `awaitable` is then cancelled
    (its generator's cleanup aborts the Triton request), or with cancel=False left to finish on its own
    (a unary gRPC call: cancelling it would be a gRPC cancellation) and its outcome dropped."""
    work = asyncio.ensure_future(awaitable)
    watch = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
        if work.done():
            return work.result()
        raise ClientGone()
    finally:
        watch.cancel()
        if cancel:
            work.cancel()   # no-op when done
        elif not work.done():
            _background.add(work)
            work.add_done_callback(_drop)


_background: set[asyncio.Future] = set()


def _drop(work: asyncio.Future) -> None:
    _background.discard(work)
    if not work.cancelled():
        work.exception()   # retrieved: an error nobody waits for is not logged as "never retrieved"


async def _chain(first: Delta, rest):
    yield first
    if not first.final:
        async for delta in rest:
            yield delta


async def _events(gen: Generation, fmt: ResponseFormat, deltas):
    tally = Tally()
    for chunk in fmt.first_chunks():
        yield sse(chunk)
    try:
        async for delta in deltas:
            tally.add(delta)
            for chunk in fmt.delta_chunks(delta, gen.logprobs is not None):
                yield sse(chunk)
    except APIError as exc:   # after the headers went out, an error is an event
        yield sse(exc.body())
        yield SSE_DONE
        return
    for chunk in fmt.final_chunks(tally.reason):
        yield sse(chunk)
    if gen.include_usage:
        yield sse(fmt.usage_chunk(tally.usage))
    yield SSE_DONE


async def _whole(gen: Generation, fmt: ResponseFormat, deltas) -> dict:
    tally = Tally()
    async for delta in deltas:
        tally.add(delta)
    entries = tally.entries if gen.logprobs is not None else None
    return fmt.result("".join(tally.text), entries, tally.reason, tally.usage)


async def respond(request: Request, gateway: TritonGateway, gen: Generation, fmt: ResponseFormat) -> Response:
    """Runs `gen` on Triton and answers in `fmt` (completion or chat), streamed or whole."""
    await gateway.loras.route(gateway, gen)   # a LoRA adapter's name: its parent model, with the adapter
    await gateway.require_llm(gen.model)
    input_ids = None
    if gen.messages is not None:
        tools = gen.tools.tools if gen.tools is not None else None
        input_ids = await until_disconnect(request, gateway.chat_input_ids(gen.messages, gen.enable_thinking, tools),
                                           cancel=False)
    stream = gateway.stream(gen.model, gen.triton_inputs(input_ids))
    try:
        deltas = stream.__aiter__()
        first = await until_disconnect(request, deltas.__anext__())   # errors here are HTTP statuses
        deltas = _chain(first, deltas)
        if gen.stream:
            return SSEResponse(_events(gen, fmt, deltas), on_close=stream.close)
        return JSONResponse(await until_disconnect(request, _whole(gen, fmt, deltas)))
    except BaseException:
        stream.close()
        raise

