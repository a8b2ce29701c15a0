"""Output tensors of an LLM response (numpy), for one streamed delta or the whole non-streamed result."""
from __future__ import annotations

import json

import numpy as np


def output_arrays(text: str, ids: list[int], *, finish_reason: str | None, num_input_tokens: int,
                  num_output_tokens: int, cumulative_logprob: float | None, logprobs: list[dict] | None,
                  flags) -> dict[str, np.ndarray]:
    """flags: the ParsedRequest; only the outputs it asked for are included (text and ids always)."""
    out = {
        "text_output": np.array([text.encode("utf-8")], dtype=np.object_),
        "output_ids": np.array(ids, dtype=np.int32),
    }
    if flags.return_finish_reason:
        out["finish_reason"] = np.array([finish_reason.encode()] if finish_reason else [], dtype=np.object_)
    if flags.return_num_input_tokens:
        out["num_input_tokens"] = np.array([num_input_tokens], dtype=np.uint32)
    if flags.return_num_output_tokens:
        out["num_output_tokens"] = np.array([num_output_tokens], dtype=np.uint32)
    if flags.return_logprobs or logprobs is not None:
        out["cumulative_logprob"] = np.array([] if cumulative_logprob is None else [cumulative_logprob],
                                             dtype=np.float32)
        out["logprobs"] = np.array([json.dumps(lp).encode() for lp in logprobs or []], dtype=np.object_)
    return out
