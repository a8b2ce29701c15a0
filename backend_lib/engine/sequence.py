"""One request's state in the engine: tokens, KV pages, sampling state (text state: OutputProcessor)."""
from __future__ import annotations

import enum
import os

import torch

from ..kv_cache.prefix import extend_hashes, tail_hash
from ..sampling.params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = 0
    RUNNING = 1
    FINISHED = 2


class Sequence:
    def __init__(self, request_id: str, prompt_ids: list[int], params: SamplingParams, max_tokens: int,
                 end_ids: set[int], grammar=None):
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
        self.grammar = grammar                 # structured output: a GrammarState, or None
        self.finish_reason: str | None = None
        self.failure: str | None = None        # a per-request fault found outside sampling (fails it alone)
        # prompt_logprobs: one entry per prompt token, filled during the prefill (by OutputProcessor, which
        # builds the entries; the first has no context and names the token)
        self.prompt_logprobs: list[dict] = []
        self.prompt_logprobs_sent = False
        self.arrival = 0                       # admission order (the scheduler's tie-break)
        self.num_cached_tokens: int | None = None   # prompt tokens served from the prefix cache (admission)
        self.cache_root: bytes | None = None   # prefix caching on: the root of this request's page hashes
        self.page_hashes: list[bytes] = []     # hashes of the first full pages of `tokens` (a chain)
        self.num_registered = 0                # pages of block_table recorded in the prefix cache
        self.tail_registered = False           # its prompt's partial last page recorded (for copies)
        self.lora = None                       # its LoRA adapter (backend_lib.lora), None for the base model
        self.spec_tokens: list[int] = []       # [spec] this step's draft tokens (not yet emitted), backend_lib/spec
        self.spec_state = None                 # [spec] its proposer index and acceptance (spec.decoder.SpecState)

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)

    @property
    def scoring(self) -> bool:
        """Whether prompt rows of it are still to be scored (prompt_logprobs asked for, not all recorded): each
        such row it computes costs the full vocabulary's logits (the scheduler bounds them per step)."""
        return self.params.prompt_logprobs is not None and len(self.prompt_logprobs) < len(self.prompt_ids)

    @property
    def num_pending(self) -> int:
        """Tokens still to be computed before the next sample."""
        return len(self.tokens) - self.num_computed

    def append(self, token_id: int) -> None:
        self.output_ids.append(token_id)
        self.tokens.append(token_id)

    def full_page_hashes(self, num_pages: int, page_size: int) -> list[bytes]:
        """Hashes of the first `num_pages` full pages (computed once; full pages never change)."""
        extend_hashes(self.page_hashes, self.cache_root, self.tokens, page_size, num_pages)
        return self.page_hashes[:num_pages]

    def tail_page_hash(self, page_size: int, num_tokens: int | None = None) -> bytes:
        """The hash of the partial last page of the first `num_tokens` tokens (default: all): the tokens
        after the last full page that leaves at least one token to compute, 1 to page_size of them."""
        n = self.num_tokens if num_tokens is None else num_tokens
        full = (n - 1) // page_size
        chain = self.full_page_hashes(full, page_size)
        return tail_hash(chain[-1] if chain else self.cache_root, self.tokens[full * page_size:n])

    def reset_for_recompute(self) -> None:
        """After preemption: the pages are released (cached ones may be found again), prompt + output so
        far will be prefilled again."""
        self.num_computed = 0
        self.num_registered = 0
        self.spec_tokens = []                  # [spec]
        self.status = SequenceStatus.WAITING
