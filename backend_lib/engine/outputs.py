from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RequestOutput:
    """What one engine step produced for one request: the delta since its previous output."""

    request_id: str
    new_token_ids: list[int] = field(default_factory=list)
    new_text: str = ""
    finished: bool = False
    finish_reason: str | None = None      # stop | length | cancelled | error
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    new_logprobs: list[dict] | None = None
    cumulative_logprob: float | None = None
    error: str | None = None
    num_cached_tokens: int = 0            # of the prompt's, served from the prefix cache
    prompt_logprobs: list[dict | None] | None = None   # requested: every prompt token's, in the first output
