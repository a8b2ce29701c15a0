"""What passes between the scheduler, the runner and the output processor in one step: the scheduler's plan,
the runner's result (tensors and samples; the API's shapes are the output processor's)."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..sampling.sampler import Sample, SampleError
from .sequence import Sequence


@dataclass
class StepPlan:
    """What the scheduler decided for one step: (sequence, tokens to compute) pairs, and the pages to copy
    before the forward (a cached partial prompt page into a new request's page: source, destination)."""
    seqs: list[tuple[Sequence, int]]
    page_copies: list[tuple[int, int]] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.seqs)


@dataclass
class PromptLogprobs:
    """prompt_logprobs of one sequence's prompt chunk, as tensors (CPU): prompt tokens first .. first + n - 1,
    each token's logprob given those before it, its rank (1 = the most likely) and the top-k ids and logprobs
    ([n, k], None when k is 0); or the error that fails the request."""
    first: int = 0
    token_ids: list[int] = field(default_factory=list)
    logprobs: torch.Tensor | None = None
    ranks: torch.Tensor | None = None
    top_ids: torch.Tensor | None = None
    top_logprobs: torch.Tensor | None = None
    error: str | None = None


@dataclass
class StepResult:
    """What a step computed: a sample (or its row's error) per sequence that reached its end, and the prompt
    chunks' prompt_logprobs."""
    samples: list[tuple[Sequence, Sample | SampleError]] = field(default_factory=list)
    prompt_logprobs: list[tuple[Sequence, PromptLogprobs]] = field(default_factory=list)
    # [spec] EAGLE-3: the target's aux hidden states of the rows of sequences whose head reads them
    # (sequence, first position, [n, 3 * hidden])
    hidden: list[tuple[Sequence, int, torch.Tensor]] = field(default_factory=list)
