"""OpenAI response objects: completion and chat.completion, their stream chunks, usage and logprobs."""
from __future__ import annotations

import json
import time
import uuid

from backend_lib.contract.finish import FinishReason

from . import tool_calls
from .gateway import Delta
from .reasoning import Qwen3ReasoningParser

SSE_DONE = "data: [DONE]\n\n"


def sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int | None = None) -> dict:
    out = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
           "total_tokens": prompt_tokens + completion_tokens}
    if cached_tokens is not None:   # OpenAI's: the prompt tokens the prefix cache served
        out["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
    return out


class TokenNames:
    """Token strings for logprobs: the tokenizer's bytes of each id (--tokenizer), else the text the LLM
    model sent with the id (its decoded_token, from the model's own tokenizer), learned as entries pass."""

    def __init__(self, tokenizer=None):
        self.tokenizer = tokenizer
        self._learned: dict[int, bytes] = {}

    def learn(self, entries) -> None:
        if self.tokenizer is not None:
            return
        for e in entries or []:
            for t in [e, *e.get("top", [])]:
                text = t.get("text", t.get("decoded_token"))
                if isinstance(text, str) and not text.startswith("token_id:"):
                    self._learned[t["id"]] = text.encode()

    def bytes(self, token_id: int) -> bytes:
        table = self.tokenizer.token_bytes if self.tokenizer is not None else None
        if table is not None and 0 <= token_id < len(table):
            return table[token_id]
        return self._learned.get(token_id) or f"token_id:{token_id}".encode()

    def text(self, token_id: int) -> str:
        return self.bytes(token_id).decode("utf-8", errors="replace")


class ResponseFormat:
    """Shared state of one response: id, creation time, model, and whether usage is streamed."""
    object_name = chunk_name = prefix = ""

    def __init__(self, model: str, names: TokenNames, include_usage: bool = False):
        self.id = f"{self.prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.model, self.names, self.include_usage = model, names, include_usage
        self.index = 0                  # the choice this object formats (n > 1, several prompts)
        self.chunk_usage: dict | None = None   # continuous_usage_stats: the usage so far, on each chunk

    def for_choice(self, index: int, make) -> "ResponseFormat":
        """A formatter of choice `index` of the same response (own parser state, same id and time)."""
        other = make()
        other.id, other.created, other.index = self.id, self.created, index
        return other

    def _envelope(self, object_name: str, choices: list) -> dict:
        return {"id": self.id, "object": object_name, "created": self.created, "model": self.model,
                "system_fingerprint": None, "choices": choices}

    def chunk(self, choice: dict) -> dict:
        obj = self._envelope(self.chunk_name, [{"index": self.index, **choice}])
        if self.chunk_usage is not None:
            obj["usage"] = self.chunk_usage
        elif self.include_usage:
            obj["usage"] = None
        return obj

    def usage_chunk(self, counts: dict) -> dict:
        return {**self._envelope(self.chunk_name, []), "usage": counts}

    def whole(self, choice: dict, counts: dict) -> dict:
        return {**self._envelope(self.object_name, [{"index": self.index, **choice}]), "usage": counts}

    def vllm_prompt_logprobs(self, entries: list[dict], n: int) -> list:
        """vLLM's prompt_logprobs: None for the first token, then {token id: {logprob, rank, decoded_token}}
        holding the prompt token and its top-n alternatives."""
        self.names.learn(entries)
        out = [None]
        for e in entries[1:]:
            text = self.names.text
            d = {str(e["id"]): {"logprob": e["logprob"], "rank": e.get("rank"), "decoded_token": text(e["id"])}}
            for r, t in enumerate(e.get("top", [])[:n], 1):
                d.setdefault(str(t["id"]), {"logprob": t["logprob"], "rank": r, "decoded_token": text(t["id"])})
            out.append(d)
        return out


class CompletionFormat(ResponseFormat):
    """text_completion objects. With `echo`, the prompt comes first (its text; with logprobs, its tokens with
    their logprobs, the first one null, as OpenAI's legacy API and vLLM do)."""
    object_name = chunk_name = "text_completion"
    prefix = "cmpl"

    def __init__(self, *args, echo: bool = False, prompt=None, **kw):
        super().__init__(*args, **kw)
        self._offset = 0   # text_offset of the next token
        self.echo, self.prompt = echo, prompt
        self._echoed = False

    def prompt_text(self, entries: list[dict] | None) -> str:
        if isinstance(self.prompt, str):
            return self.prompt
        ids = self.prompt or [e["id"] for e in entries or []]
        return b"".join(self.names.bytes(i) for i in ids).decode("utf-8", errors="replace")

    def logprobs(self, entries: list[dict], top_n: int | None = None) -> dict:
        self.names.learn(entries)
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for e in entries:
            token = self.names.text(e["id"])
            out["tokens"].append(token)
            out["token_logprobs"].append(e["logprob"])
            if e["logprob"] is None:   # the prompt's first token: no context, no distribution
                out["top_logprobs"].append(None)
            else:
                top = {self.names.text(t["id"]): t["logprob"] for t in e.get("top", [])[:top_n]}
                if top_n is not None:   # a prompt token: itself among its alternatives, as vLLM's echo
                    top.setdefault(token, e["logprob"])
                out["top_logprobs"].append(top)
            out["text_offset"].append(self._offset)
            self._offset += len(token)
        return out

    def _echo_logprobs(self, prompt_entries, n: int | None) -> dict:
        lp = self.logprobs(prompt_entries or [], n)
        return lp

    def first_chunks(self) -> list[dict]:
        return []

    def delta_chunks(self, delta: Delta, with_logprobs: bool, top_n: int | None = None) -> list[dict]:
        chunks = []
        if self.echo and not self._echoed and (delta.ids or delta.final):
            self._echoed = True
            lp = self._echo_logprobs(delta.prompt_logprobs, top_n) if with_logprobs else None
            chunks.append(self.chunk({"text": self.prompt_text(delta.prompt_logprobs), "logprobs": lp,
                                      "finish_reason": None}))
        if not delta.text and not (with_logprobs and delta.logprobs):
            return chunks
        lp = self.logprobs(delta.logprobs) if with_logprobs else None
        return chunks + [self.chunk({"text": delta.text, "logprobs": lp, "finish_reason": None})]

    def final_chunks(self, reason: str) -> list[dict]:
        return [self.chunk({"text": "", "logprobs": None, "finish_reason": reason})]

    def result(self, text: str, entries: list[dict] | None, reason: str, counts: dict,
               prompt_entries: list[dict] | None = None, top_n: int | None = None,
               prompt_logprobs: int | None = None) -> dict:
        lp = None
        if self.echo:
            if entries is not None:
                lp = self._echo_logprobs(prompt_entries, top_n)
            text = self.prompt_text(prompt_entries) + text
        if entries is not None:
            gen_lp = self.logprobs(entries)
            lp = gen_lp if lp is None else {k: lp[k] + gen_lp[k] for k in lp}
        choice = {"text": text, "logprobs": lp, "finish_reason": reason}
        if prompt_logprobs is not None:
            choice["prompt_logprobs"] = self.vllm_prompt_logprobs(prompt_entries or [], prompt_logprobs)
        return self.whole(choice, counts)


class ChatFormat(ResponseFormat):
    """chat.completion objects. With `reasoning` on, Qwen3's think block becomes `reasoning_content` (dropped
    with include_reasoning false); with `parse_tools`, <tool_call> blocks become `tool_calls` and the finish
    reason `tool_calls`. Streamed, text passes the reasoning parser, then its content the tool-call parser."""
    object_name, chunk_name = "chat.completion", "chat.completion.chunk"
    prefix = "chatcmpl"

    def __init__(self, model: str, names: TokenNames, include_usage: bool = False, reasoning: bool = False,
                 thinking: bool = True, include_reasoning: bool = True, parse_tools: bool = False,
                 forced_tools: bool = False):
        super().__init__(model, names, include_usage)
        self.reasoning = Qwen3ReasoningParser(thinking) if reasoning else None
        self.include_reasoning = include_reasoning
        self.parse_tools = parse_tools
        self._reasoning_stream = self.reasoning.stream() if self.reasoning else None
        self.forced_tools = forced_tools   # tool_choice required / named: a call cut by max_tokens is dropped alone
        self._tool_stream = tool_calls.ToolCallStream(forced_tools) if parse_tools else None
        self.called = False   # tool calls were returned: the finish reason is tool_calls

    def _parsed(self, text: str, final: bool) -> list[dict]:
        """Stream deltas ({reasoning_content} / {content} / {tool_calls}) of new text, or of the end."""
        out = []
        r, c = (self._reasoning_stream.finish() if final else self._reasoning_stream.feed(text)) \
            if self._reasoning_stream else ("", text)
        if r and self.include_reasoning:   # current vLLM's name and the older one: clients read either
            out.append({"reasoning": r, "reasoning_content": r})
        if self._tool_stream is not None:
            parts = self._tool_stream.feed(c) if c else []
            if final:
                parts += self._tool_stream.finish()
            self.called |= any("tool_calls" in p for p in parts)
            out += parts
        elif c:
            out.append({"content": c})
        return out

    def reason(self, reason: str) -> str:
        return FinishReason.TOOL_CALLS if self.called and reason == FinishReason.STOP else reason

    def _entry(self, token_id: int, logprob: float) -> dict:
        raw = self.names.bytes(token_id)
        return {"token": raw.decode("utf-8", errors="replace"), "logprob": logprob, "bytes": list(raw)}

    def logprobs(self, entries: list[dict]) -> dict:
        self.names.learn(entries)
        return {"content": [{**self._entry(e["id"], e["logprob"]),
                             "top_logprobs": [self._entry(t["id"], t["logprob"]) for t in e.get("top", [])]}
                            for e in entries], "refusal": None}

    def first_chunks(self) -> list[dict]:
        return [self.chunk({"delta": {"role": "assistant", "content": ""}, "logprobs": None,
                            "finish_reason": None})]

    def delta_chunks(self, delta: Delta, with_logprobs: bool, top_n: int | None = None) -> list[dict]:
        parts = self._parsed(delta.text, False) if delta.text else []
        if with_logprobs and delta.logprobs:   # the token's logprobs ride on its first part
            parts = parts or [{"content": ""}]
            first = self.chunk({"delta": parts[0], "logprobs": self.logprobs(delta.logprobs), "finish_reason": None})
            return [first] + [self.chunk({"delta": p, "logprobs": None, "finish_reason": None}) for p in parts[1:]]
        return [self.chunk({"delta": p, "logprobs": None, "finish_reason": None}) for p in parts]

    def final_chunks(self, reason: str) -> list[dict]:
        tail = [self.chunk({"delta": p, "logprobs": None, "finish_reason": None}) for p in self._parsed("", True)]
        return tail + [self.chunk({"delta": {}, "logprobs": None, "finish_reason": self.reason(reason)})]

    def result(self, text: str, entries: list[dict] | None, reason: str, counts: dict,
               prompt_entries: list[dict] | None = None, top_n: int | None = None,
               prompt_logprobs: int | None = None) -> dict:
        lp = self.logprobs(entries) if entries is not None else None
        reasoning, content = self.reasoning.split(text) if self.reasoning else (None, text)
        message = {"role": "assistant", "content": content, "refusal": None}
        if self.reasoning and self.include_reasoning:
            message["reasoning"] = message["reasoning_content"] = reasoning
        if self.parse_tools and content:
            content, calls = tool_calls.parse(content, self.forced_tools)
            if calls:
                self.called = True
                message["content"] = content
                message["tool_calls"] = [c.to_openai() for c in calls]
        return self.whole({"message": message, "logprobs": lp, "finish_reason": self.reason(reason)}, counts)
