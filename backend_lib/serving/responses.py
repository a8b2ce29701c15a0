"""Output tensors of an LLM response (numpy), for one streamed delta or the whole non-streamed result."""
from __future__ import annotations

import json

import numpy as np

from .schema import LLM_OUTPUT


def _array(name: str, values: list) -> np.ndarray:
    f = LLM_OUTPUT[name]
    if f.type == "TYPE_STRING":
        values = [v.encode("utf-8") if isinstance(v, str) else v for v in values]
    return np.array(values, dtype=f.np_dtype)


def abort_token_arrays(token: str) -> dict[str, np.ndarray]:
    """The response sent at admission to a request that asked for its abort token: no text, no ids."""
    return {"text_output": _array("text_output", [""]), "output_ids": _array("output_ids", []),
            "abort_token": _array("abort_token", [token])}


def vllm_logprobs(entries: list[dict], token_text) -> list[dict]:
    """vllm_backend's logprobs of new tokens: per token {token id: {logprob, rank, decoded_token}}, the
    sampled token first, then its top-N alternatives (each once)."""
    out = []
    for e in entries:
        d = {str(e["id"]): {"logprob": e["logprob"], "rank": e.get("rank"), "decoded_token": token_text(e["id"])}}
        for r, t in enumerate(e.get("top", []), 1):
            d.setdefault(str(t["id"]), {"logprob": t["logprob"], "rank": r, "decoded_token": token_text(t["id"])})
        out.append(d)
    return out


def output_arrays(text: str, ids: list[int], *, finish_reason: str | None, num_input_tokens: int,
                  num_output_tokens: int, cumulative_logprob: float | None, logprobs: list[dict] | None,
                  flags, prompt_logprobs: list | None = None, token_text=None,
                  num_cached_tokens: int = 0) -> dict[str, np.ndarray]:
    """flags: the ParsedRequest; only the outputs it asked for are included (text and ids always).
    num_output_tokens: the tokens of this response. token_text: id -> its text (logprobs' decoded_token)."""
    out = {"text_output": _array("text_output", [text]), "output_ids": _array("output_ids", ids)}
    if flags.return_finish_reason:
        out["finish_reason"] = _array("finish_reason", [finish_reason] if finish_reason else [])
    if flags.return_num_input_tokens:
        out["num_input_tokens"] = _array("num_input_tokens", [num_input_tokens])
    if getattr(flags, "return_num_cached_tokens", False):
        out["num_cached_tokens"] = _array("num_cached_tokens", [num_cached_tokens])
    if flags.return_num_output_tokens:
        out["num_output_tokens"] = _array("num_output_tokens", [num_output_tokens])
    if flags.return_logprobs or getattr(flags, "return_cumulative_logprob", False) or logprobs is not None:
        out["cumulative_logprob"] = _array("cumulative_logprob", [] if cumulative_logprob is None
                                           else [cumulative_logprob])
    if flags.return_logprobs or logprobs is not None:
        text_of = token_text or (lambda i: f"token_id:{i}")
        out["logprobs"] = _array("logprobs", [json.dumps(vllm_logprobs(logprobs or [], text_of))])
    if prompt_logprobs is not None:
        text_of = token_text or (lambda i: f"token_id:{i}")
        out["prompt_logprobs"] = _array("prompt_logprobs", [json.dumps(
            {**lp, "decoded_token": text_of(lp["id"]),
             "top": [{**t, "decoded_token": text_of(t["id"])} for t in lp["top"]]}) for lp in prompt_logprobs])
    return out
