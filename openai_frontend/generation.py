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

from backend_lib.contract.finish import FinishReason
from .errors import APIError, bad_request
from .formats import SSE_DONE, ResponseFormat, sse, usage
from .gateway import Delta, TritonGateway
from .params import Generation
from .protocol import MAX_PROMPT_SCORING

# Triton finish reasons -> OpenAI's; a request ended early (cancelled, or aborted: by a client's abort
# request or a model unload) reads as vLLM's "abort"
FINISH_REASONS = {FinishReason.STOP: FinishReason.STOP, FinishReason.LENGTH: FinishReason.LENGTH,
                  FinishReason.CANCELLED: FinishReason.ABORT, FinishReason.ABORT: FinishReason.ABORT}


class ClientGone(Exception):
    """The HTTP client disconnected before the response was ready."""


@dataclass
class Tally:
    """What a generation produced so far."""
    text: list[str] = field(default_factory=list)
    entries: list[dict] = field(default_factory=list)
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    finish_reason: str | None = None

    def add(self, delta: Delta) -> None:
        self.text.append(delta.text)
        self.entries.extend(delta.logprobs)
        self.prompt_tokens = max(self.prompt_tokens, delta.num_input_tokens)
        self.cached_tokens = max(self.cached_tokens, delta.num_cached_tokens)
        self.completion_tokens += len(delta.ids)
        self.finish_reason = delta.finish_reason or self.finish_reason

    @property
    def reason(self) -> str:
        return FINISH_REASONS.get(self.finish_reason or FinishReason.STOP, self.finish_reason)

    @property
    def usage(self) -> dict:
        return usage(self.prompt_tokens, self.completion_tokens, self.cached_tokens)


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


@dataclass
class Choice:
    """One choice of a response: its formatter (own parser state), its Triton stream and deltas, its tally."""
    fmt: ResponseFormat
    stream: object
    deltas: object = None
    tally: Tally = field(default_factory=Tally)
    prompt_entries: list | None = None


def _summed(choices: list[Choice], n: int) -> dict:
    """OpenAI's usage of several choices: each prompt counted once (not per choice), every completion token."""
    prompt = sum(c.tally.prompt_tokens for i, c in enumerate(choices) if i % n == 0)
    cached = sum(c.tally.cached_tokens for i, c in enumerate(choices) if i % n == 0)
    return usage(prompt, sum(c.tally.completion_tokens for c in choices), cached)


def _keep_top(delta: Delta, n: int | None) -> Delta:
    """The top-n alternatives of each token's logprobs (the model lists the sampled token beside them)."""
    for e in delta.logprobs:
        e["top"] = e.get("top", [])[:n or 0]
    return delta


async def _merged(choices: list[Choice]):
    """(choice number, delta) from every choice's stream as they come; a stream's error is raised."""
    # bounded: a consumer that stops (a client that stopped reading) stops the pumps, and each choice's own stream
    # then ends its request at gateway.MAX_UNREAD responses unread
    queue: asyncio.Queue = asyncio.Queue(maxsize=4 * len(choices))
    done = object()

    async def pump(i: int, choice: Choice):
        try:
            async for delta in choice.deltas:
                await queue.put((i, delta))
        except BaseException as exc:   # noqa: BLE001  handed to the consumer
            await queue.put((i, exc))
        finally:
            await queue.put((i, done))

    tasks = [asyncio.ensure_future(pump(i, c)) for i, c in enumerate(choices)]
    try:
        open_ = len(tasks)
        while open_:
            i, item = await queue.get()
            if item is done:
                open_ -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()


async def _events(gen: Generation, choices: list[Choice]):
    fmt = choices[0].fmt
    for c in choices:
        for chunk in c.fmt.first_chunks():
            yield sse(chunk)
    top_n = gen.logprobs if gen.echo else None
    try:
        async for i, delta in _merged(choices):
            c = choices[i]
            _keep_top(delta, gen.logprobs)
            c.tally.add(delta)
            if gen.continuous_usage:
                c.fmt.chunk_usage = _summed(choices, gen.n)
            for chunk in c.fmt.delta_chunks(delta, gen.logprobs is not None, top_n):
                yield sse(chunk)
            if delta.final:
                for chunk in c.fmt.final_chunks(c.tally.reason):
                    yield sse(chunk)
    except APIError as exc:   # after the headers went out, an error is an event
        yield sse(exc.body())
        yield SSE_DONE
        return
    if gen.include_usage:
        yield sse(fmt.usage_chunk(_summed(choices, gen.n)))
    yield SSE_DONE


async def _whole(gen: Generation, choices: list[Choice]) -> dict:
    async def run(c: Choice):
        async for delta in c.deltas:
            c.tally.add(_keep_top(delta, gen.logprobs))
            if delta.prompt_logprobs is not None:
                c.prompt_entries = delta.prompt_logprobs

    await asyncio.gather(*(run(c) for c in choices))
    counts = _summed(choices, gen.n)
    bodies = []
    for c in choices:
        entries = c.tally.entries if gen.logprobs is not None else None
        bodies.append(c.fmt.result("".join(c.tally.text), entries, c.tally.reason, counts, c.prompt_entries,
                                   gen.logprobs if gen.echo else None,
                                   gen.prompt_logprobs if gen.messages is None else None))
    body = bodies[0]
    body["choices"] = [b["choices"][0] for b in bodies]
    if gen.messages is not None and gen.prompt_logprobs is not None:   # vLLM: chat's are on the response
        body["prompt_logprobs"] = choices[0].fmt.vllm_prompt_logprobs(choices[0].prompt_entries or [],
                                                                      gen.prompt_logprobs)
    return body


async def _check_scoring(gateway: TritonGateway, gen: Generation, input_ids: list[int] | None) -> None:
    """Prompt scoring (prompt_logprobs, echo with logprobs) is bounded per request: every choice's prompt tokens x
    (top N + 1) entries, summed over the prompts and n, at most MAX_PROMPT_SCORING; else a 400 naming the field
    before any work starts (a text prompt is tokenized for the count)."""
    top = [k for k in (gen.prompt_logprobs, gen.logprobs if gen.echo else None) if k is not None]
    if not top:
        return
    k, lengths, total = max(top), {}, 0
    for prompt, _ in gen.choices():
        if input_ids is not None:
            n = len(input_ids)
        elif isinstance(prompt, list) or (prompt is None and gen.prompt_ids is not None):
            n = len(prompt if prompt is not None else gen.prompt_ids)
        else:
            text = prompt if prompt is not None else gen.prompt
            if text not in lengths:
                lengths[text] = len(await gateway.text_input_ids(text))
            n = lengths[text]
        total += n * (k + 1)
    if total > MAX_PROMPT_SCORING:
        field = "prompt_logprobs" if gen.prompt_logprobs is not None else "logprobs"
        raise bad_request(f"{field}: scoring the prompts of this request ({len(gen.choices())} choices, top {k}) is "
                          f"{total} entries (prompt tokens x (top N + 1), summed over prompts and n), over the "
                          f"budget of {MAX_PROMPT_SCORING} per request", field)


async def respond(request: Request, gateway: TritonGateway, gen: Generation, make_format) -> Response:
    """Runs `gen` on Triton and answers in the format `make_format(prompt)` builds (completion or chat),
    streamed or whole: one Triton stream per choice (each prompt x n), the first responses awaited before
    the answer starts, so that a refused request is an HTTP status."""
    await gateway.loras.route(gateway, gen)   # a LoRA adapter's name: its parent model, with the adapter
    await gateway.require_llm(gen.model)
    input_ids = None
    if gen.messages is not None:
        tools = gen.tools.tools if gen.tools is not None else None
        input_ids = await until_disconnect(request, gateway.chat_input_ids(gen.messages, gen.enable_thinking, tools),
                                           cancel=False)
    await _check_scoring(gateway, gen, input_ids)
    choices: list[Choice] = []
    try:
        first_fmt = None
        for index, (prompt, j) in enumerate(gen.choices()):
            fmt = make_format(prompt) if first_fmt is None else first_fmt.for_choice(index, lambda p=prompt:
                                                                                    make_format(p))
            first_fmt = first_fmt or fmt
            stream = gateway.stream(gen.model, gen.triton_inputs(input_ids, prompt, j))
            choices.append(Choice(fmt, stream))
        firsts = []
        for c in choices:
            c.deltas = c.stream.__aiter__()
            firsts.append(c.deltas.__anext__())
        got = await until_disconnect(request, asyncio.gather(*firsts))   # errors here are HTTP statuses
        for c, first in zip(choices, got):
            c.deltas = _chain(first, c.deltas)
        if gen.stream:
            return SSEResponse(_events(gen, choices), on_close=lambda: [c.stream.close() for c in choices])
        return JSONResponse(await until_disconnect(request, _whole(gen, choices)))
    except BaseException:
        for c in choices:
            c.stream.close()
        raise
