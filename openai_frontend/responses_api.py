"""The OpenAI Responses API: POST /v1/responses (whole or streamed with its typed events), GET and DELETE
/v1/responses/{id}.

A request runs the chat path (responses_params turns it into a chat Generation; the gateway renders the template
and streams from the LLM model; a client that goes away aborts the Triton request as in chat). The generated text
goes through the same parsers as chat's: Qwen3's think block becomes a `reasoning` output item, `<tool_call>`
blocks become `function_call` items, the rest an assistant `message`. Streamed, the events are OpenAI's:
response.created, response.in_progress, then per item response.output_item.added, its deltas
(response.reasoning_text.delta, response.content_part.added + response.output_text.delta,
response.function_call_arguments.delta), their .done events and response.output_item.done, and last
response.completed (response.incomplete when max_output_tokens cut it; response.failed on an error).
A whole response is the same run with the events dropped, so both agree by construction.
"""
from __future__ import annotations

import json
import time
import uuid

from fastapi import APIRouter, Request
from starlette.responses import JSONResponse

from backend_lib.contract.finish import FinishReason
from .errors import APIError
from .gateway import Delta, TritonGateway
from .generation import SSEResponse, Tally, until_disconnect
from .reasoning import Qwen3ReasoningParser
from .protocol import CreateResponseRequest, json_body, request_body
from .responses_params import ResponsesRequest, renamed, responses_request
from .responses_store import ResponseStore
from .tool_calls import ToolCallStream


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _sse(event: dict) -> str:
    return f"event: {event['type']}\ndata: {json.dumps(event, ensure_ascii=False)}\n\n"


class ResponseRun:
    """One response being generated: its output items, built from text deltas, and the events that tell it."""

    def __init__(self, req: ResponsesRequest, reasoning: bool):
        gen = req.gen
        self.req = req
        self.response = {"id": _id("resp"), "object": "response", "created_at": int(time.time()), "status": "in_progress",
                         "error": None, "incomplete_details": None, "model": gen.model, "output": [], "usage": None,
                         **req.echo}
        self._reasoning = Qwen3ReasoningParser(gen.enable_thinking is not False).stream() if reasoning else None
        self._tools = ToolCallStream() if gen.tools is not None and gen.tools.parse_calls else None
        self._seq = 0
        self._thinking_item: dict | None = None   # the reasoning item while it grows
        self._message: dict | None = None          # the message item while it grows
        self._answer_started = False
        self.reasoning_tokens = 0

    def _event(self, kind: str, **fields) -> dict:
        event = {"type": kind, "sequence_number": self._seq, **fields}
        self._seq += 1
        return event

    def _snapshot(self) -> dict:
        return json.loads(json.dumps(self.response))

    def start(self) -> list[dict]:
        return [self._event("response.created", response=self._snapshot()),
                self._event("response.in_progress", response=self._snapshot())]

    def _add(self, item: dict) -> list[dict]:
        self.response["output"].append(item)
        return [self._event("response.output_item.added", output_index=len(self.response["output"]) - 1,
                            item=json.loads(json.dumps(item)))]

    def _index(self, item: dict) -> int:
        return next(i for i, it in enumerate(self.response["output"]) if it is item)

    # ----- reasoning item
    def _think(self, text: str) -> list[dict]:
        events = []
        if self._thinking_item is None:
            self._thinking_item = {"id": _id("rs"), "type": "reasoning", "summary": [],
                                   "content": [{"type": "reasoning_text", "text": ""}], "status": "in_progress"}
            events += self._add(self._thinking_item)
        self._thinking_item["content"][0]["text"] += text
        events.append(self._event("response.reasoning_text.delta", item_id=self._thinking_item["id"],
                                  output_index=self._index(self._thinking_item), content_index=0, delta=text))
        return events

    def _end_thinking(self) -> list[dict]:
        item, self._thinking_item = self._thinking_item, None
        if item is None:
            return []
        item["status"] = "completed"
        i = self._index(item)
        return [self._event("response.reasoning_text.done", item_id=item["id"], output_index=i, content_index=0,
                            text=item["content"][0]["text"]),
                self._event("response.output_item.done", output_index=i, item=json.loads(json.dumps(item)))]

    # ----- message item
    def _say(self, text: str) -> list[dict]:
        events = self._end_thinking()
        if self._message is None:
            self._message = {"id": _id("msg"), "type": "message", "role": "assistant", "status": "in_progress",
                             "content": []}
            events += self._add(self._message)
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            self._message["content"].append(part)
            events.append(self._event("response.content_part.added", item_id=self._message["id"],
                                      output_index=self._index(self._message), content_index=0,
                                      part=json.loads(json.dumps(part))))
        self._message["content"][0]["text"] += text
        events.append(self._event("response.output_text.delta", item_id=self._message["id"],
                                  output_index=self._index(self._message), content_index=0, delta=text, logprobs=[]))
        return events

    def _end_message(self, status: str) -> list[dict]:
        item, self._message = self._message, None
        if item is None:
            return []
        item["status"] = status
        i, part = self._index(item), item["content"][0]
        return [self._event("response.output_text.done", item_id=item["id"], output_index=i, content_index=0,
                            text=part["text"], logprobs=[]),
                self._event("response.content_part.done", item_id=item["id"], output_index=i, content_index=0,
                            part=json.loads(json.dumps(part))),
                self._event("response.output_item.done", output_index=i, item=json.loads(json.dumps(item)))]

    def _content(self, text: str, final: bool) -> list[dict]:
        """Answer text after the reasoning: through the tool-call parser when tools are parsed."""
        if self._tools is None:
            return self._say(text) if text else []
        parts = self._tools.feed(text) if text else []
        if final:
            parts += self._tools.finish()
        events, calls = [], {}
        for p in parts:
            if p.get("content"):
                events += self._say(p["content"])
            for tc in p.get("tool_calls", []):
                call = calls.setdefault(tc["index"], {"call_id": "", "name": "", "arguments": ""})
                call["call_id"] = tc.get("id") or call["call_id"]
                call["name"] += tc.get("function", {}).get("name") or ""
                call["arguments"] += tc.get("function", {}).get("arguments") or ""
        if calls:
            events += self._end_thinking() + self._end_message("completed")
        for _, call in sorted(calls.items()):
            item = {"id": _id("fc"), "type": "function_call", "status": "in_progress", "arguments": "",
                    "call_id": call["call_id"], "name": call["name"]}
            events += self._add(item)
            i = self._index(item)
            events.append(self._event("response.function_call_arguments.delta", item_id=item["id"], output_index=i,
                                      delta=call["arguments"]))
            item.update(arguments=call["arguments"], status="completed")
            events += [self._event("response.function_call_arguments.done", item_id=item["id"], output_index=i,
                                   name=item["name"], arguments=item["arguments"]),
                       self._event("response.output_item.done", output_index=i, item=json.loads(json.dumps(item)))]
        return events

    def feed(self, delta: Delta) -> list[dict]:
        r, c = self._reasoning.feed(delta.text) if self._reasoning is not None else ("", delta.text)
        if self._reasoning is not None and not self._answer_started and not c:
            self.reasoning_tokens += len(delta.ids)   # tokens before the answer began: the think block
        self._answer_started |= bool(c)
        return (self._think(r) if r else []) + self._content(c, final=False)

    def finish(self, tally: Tally) -> list[dict]:
        r, c = self._reasoning.finish() if self._reasoning is not None else ("", "")
        events = (self._think(r) if r else []) + self._content(c, final=True)
        cut = tally.reason == FinishReason.LENGTH
        aborted = tally.reason == FinishReason.ABORT
        events += self._end_thinking() + self._end_message("incomplete" if cut else "completed")
        self.response["usage"] = {
            "input_tokens": tally.prompt_tokens,
            "input_tokens_details": {"cached_tokens": tally.cached_tokens},   # served by the prefix cache
            "output_tokens": tally.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": self.reasoning_tokens},
            "total_tokens": tally.prompt_tokens + tally.completion_tokens}
        if aborted:
            self.response["status"] = "failed"
            self.response["error"] = {"code": "server_error", "message": "the generation was aborted (the model was "
                                      "stopped or unloaded)"}
            return events + [self._event("response.failed", response=self._snapshot())]
        if cut:
            self.response["status"] = "incomplete"
            self.response["incomplete_details"] = {"reason": "max_output_tokens"}
            return events + [self._event("response.incomplete", response=self._snapshot())]
        self.response["status"] = "completed"
        return events + [self._event("response.completed", response=self._snapshot())]

    def fail(self, exc: APIError) -> list[dict]:
        self.response["status"] = "failed"
        self.response["error"] = {"code": exc.code or exc.type, "message": exc.message}
        return [self._event("response.failed", response=self._snapshot())]

    def conversation(self) -> list[dict]:
        """The chat conversation this response ends: its history plus its output as the assistant's turn."""
        msg: dict = {"role": "assistant", "content": ""}
        for item in self.response["output"]:
            if item["type"] == "reasoning":
                msg["reasoning_content"] = item["content"][0]["text"]
            elif item["type"] == "message":
                msg["content"] = item["content"][0]["text"]
            elif item["type"] == "function_call":
                msg.setdefault("tool_calls", []).append({"id": item["call_id"], "type": "function", "function": {
                    "name": item["name"], "arguments": item["arguments"]}})
        return self.req.history + [msg]


async def _prepend(first: Delta, rest):
    yield first
    if not first.final:
        async for delta in rest:
            yield delta


def responses_routes(gateway: TritonGateway, store: ResponseStore, reasoning: bool, dependencies: list) -> APIRouter:
    """dependencies: the API-key check."""
    router = APIRouter(prefix="/v1", dependencies=dependencies)

    def history_of(response_id: str) -> list[dict]:
        stored = store.get(response_id)
        if stored is None:
            raise APIError(404, f"previous_response_id: no stored response '{response_id}' (never stored, stored with "
                           "store false, or evicted)", param="previous_response_id", code="not_found")
        return stored.conversation

    def keep(run: ResponseRun, final: dict | None) -> None:
        """Stores a finished response; one the store cannot hold (larger than its byte bound alone) is answered
        `store: false`, in the response and in its final event, so no client is told it was stored."""
        if run.req.store and run.response["status"] in ("completed", "incomplete"):
            if not store.put(run.response, run.conversation()):
                run.response["store"] = False
                if final is not None and isinstance(final.get("response"), dict):
                    final["response"]["store"] = False

    async def events(run: ResponseRun, deltas):
        tally = Tally()
        for event in run.start():
            yield _sse(event)
        try:
            async for delta in deltas:
                tally.add(delta)
                for event in run.feed(delta):
                    yield _sse(event)
        except APIError as exc:   # after the headers went out, an error is an event
            for event in run.fail(renamed(exc, run.req.structured)):
                yield _sse(event)
            return
        finished = run.finish(tally)
        keep(run, finished[-1] if finished else None)
        for event in finished:
            yield _sse(event)

    async def whole(run: ResponseRun, deltas) -> dict:
        tally = Tally()
        async for delta in deltas:
            tally.add(delta)
            run.feed(delta)
        run.finish(tally)
        keep(run, None)
        return run.response

    @router.post("/responses", openapi_extra=request_body(CreateResponseRequest))
    async def create(request: Request, body: CreateResponseRequest = json_body(CreateResponseRequest)):
        req = responses_request(body, history_of)
        gen = req.gen
        try:
            await gateway.loras.route(gateway, gen)   # a LoRA adapter's name: its parent model, with the adapter
            await gateway.require_llm(gen.model)
            tools = gen.tools.tools if gen.tools is not None else None
            input_ids = await until_disconnect(
                request, gateway.chat_input_ids(gen.messages, gen.enable_thinking, tools), cancel=False)
        except APIError as exc:
            raise renamed(exc, req.structured) from None
        stream = gateway.stream(gen.model, gen.triton_inputs(input_ids))
        run = ResponseRun(req, reasoning)
        try:
            deltas = stream.__aiter__()
            try:
                first = await until_disconnect(request, deltas.__anext__())   # errors here are HTTP statuses
            except APIError as exc:
                raise renamed(exc, req.structured) from None
            deltas = _prepend(first, deltas)
            if req.stream:
                return SSEResponse(events(run, deltas), on_close=stream.close)
            return JSONResponse(await until_disconnect(request, whole(run, deltas)))
        except BaseException:
            stream.close()
            raise

    @router.get("/responses/{response_id}")
    async def retrieve(response_id: str):
        stored = store.get(response_id)
        if stored is None:
            raise APIError(404, f"No response with id '{response_id}' is stored", param="response_id",
                           code="not_found")
        return stored.response

    @router.delete("/responses/{response_id}")
    async def delete(response_id: str):
        if not store.delete(response_id):
            raise APIError(404, f"No response with id '{response_id}' is stored", param="response_id",
                           code="not_found")
        return {"id": response_id, "object": "response.deleted", "deleted": True}

    return router
