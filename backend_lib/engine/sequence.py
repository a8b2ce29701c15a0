"""One request's state in the engine: tokens, KV pages, sampling state (text state: OutputProcessor)."""
from __future__ import annotations

import enum
import os

import torch

from ..sampling.params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = 0
    RUNNING = 1
    FINISHED = 2


class Sequence:
    def __init__(self, request_id: str, prompt_ids: list[int], params: SamplingParams, max_tokens: int,
                 end_ids: set[int]):
        self.request_id = request_id
        self.prompt_ids = list(prompt_ids)
        self.output_ids: list[int] = []
        self.tokens = list(prompt_ids)         # prompt + output, what the model computes over
        self.params = params
        self.max_tokens = max_tokens
        self.status = SequenceStatus.WAITING
        self.block_table: list[int] = []
        self.num_computed = 0                  # tokens whose K/V are in the cache
        self.stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else set(end_ids))
        self.min_tokens_blocked_ids = sorted(set(end_ids) | set(params.stop_token_ids))
        seed = params.seed if params.seed is not None else int.from_bytes(os.urandom(8), "little")
        self.generator = torch.Generator(device="cpu")
        self.generator.manual_seed(seed % 2**64)
        self.cumulative_logprob = 0.0
        self.finish_reason: str | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)

    @property
    def num_pending(self) -> int:
        """Tokens still to be computed before the next sample."""
        return len(self.tokens) - self.num_computed

    def append(self, token_id: int) -> None:
        self.output_ids.append(token_id)
        self.tokens.append(token_id)

    def reset_for_recompute(self) -> None:
        """After preemption: the pages are gone, prompt + output so far will be prefilled again."""
        self.num_computed = 0
        self.status = SequenceStatus.WAITING
