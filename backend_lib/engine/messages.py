"""Typed messages into the engine thread, and the stats snapshot it publishes after each step."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from ..contract.finish import FinishReason
from ..sampling.params import SamplingParams
from ..sampling.structured import GrammarState
from .outputs import RequestOutput

Callback = Callable[[RequestOutput], None]


@dataclass(frozen=True)
class Request:
    """A validated request (LLMEngine.make_request): the engine admits it without checking again."""
    request_id: str
    prompt_ids: tuple[int, ...]
    params: SamplingParams
    max_tokens: int            # resolved: explicit or default, capped by max_model_len
    grammar: GrammarState | None = None   # structured output: compiled at validation, owned by the engine after
    lora: object | None = None            # its LoRA adapter (backend_lib.lora.LoraAdapter), resolved at validation


@dataclass(frozen=True)
class AddRequest:
    request: Request
    callback: Callback


@dataclass(frozen=True)
class AbortRequest:
    request_id: str
    reason: str = FinishReason.CANCELLED


@dataclass(frozen=True)
class AbortAll:
    """Finish every request in flight (the server is going away); the engine keeps running."""
    reason: str = FinishReason.ABORT


@dataclass(frozen=True)
class EngineStats:
    """What the engine thread publishes each step; the only engine state other threads read."""
    running: int = 0
    waiting: int = 0
    pages_used: int = 0
    pages_total: int = 0
    pages_cached: int = 0          # full pages held in the prefix cache (in use or evictable)
    prefix_cache_queries: int = 0  # tokens of admitted requests looked up in the prefix cache
    prefix_cache_hits: int = 0     # of those, tokens served from cached pages
    num_preemptions: int = 0
    num_failed_steps: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    lora_running: tuple[str, ...] = ()   # LoRA adapters of the running requests (sorted names), when LoRA is on
    lora_waiting: tuple[str, ...] = ()   # and of the waiting ones
    # [spec] speculative decoding (vLLM's spec_decode counters): verifications, drafted and accepted tokens,
    # and accepted tokens per draft position
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_accepted_per_pos: tuple[int, ...] = ()
    spec_gated_steps: int = 0      # steps the batch gate kept from drafting (spec/gate.py)
