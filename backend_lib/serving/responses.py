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


def output_arrays(text: str, ids: list[int], *, finish_reason: str | None, num_input_tokens: int,
                  num_output_tokens: int, cumulative_logprob: float | None, logprobs: list[dict] | None,
                  flags, prompt_logprobs: list | None = None) -> dict[str, np.ndarray]:
    """flags: the ParsedRequest; only the outputs it asked for are included (text and ids always)."""
    out = {"text_output": _array("text_output", [text]), "output_ids": _array("output_ids", ids)}
    if flags.return_finish_reason:
        out["finish_reason"] = _array("finish_reason", [finish_reason] if finish_reason else [])
    if flags.return_num_input_tokens:
        out["num_input_tokens"] = _array("num_input_tokens", [num_input_tokens])
    if flags.return_num_output_tokens:
        out["num_output_tokens"] = _array("num_output_tokens", [num_output_tokens])
    if flags.return_logprobs or logprobs is not None:
        out["cumulative_logprob"] = _array("cumulative_logprob", [] if cumulative_logprob is None
                                           else [cumulative_logprob])
        out["logprobs"] = _array("logprobs", [json.dumps(lp) for lp in logprobs or []])
    if prompt_logprobs is not None:
        out["prompt_logprobs"] = _array("prompt_logprobs", [json.dumps(lp) for lp in prompt_logprobs])
    return out
