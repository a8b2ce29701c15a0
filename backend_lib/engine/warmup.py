"""Warm-up before the KV pool is sized: with the model loaded, one prefill step of max_num_batched_tokens tokens and
one decode step of max_num_seqs rows (and the sampler over them) run against a throw-away cache of the
few pages they need, so that the pool is sized from what is free once the weights, the kernels' first launches
(Triton compiles them there) and the widest steps' activations have taken their share, not from what was free
before any of it.

On CUDA (`CudaMemory`, torch.cuda's allocator statistics and `mem_get_info`) ModelRunner always warms up. The
memory reader is an argument, so the CPU tests run the same code path with a fake reader.
"""
from __future__ import annotations

import logging

import torch

from ..kv_cache.base import cache_class
from ..kv_cache.metadata import AttentionMetadata
from ..kv_cache.pool import parse_memory_budget
from ..contract.fields import SamplingLimits
from ..sampling.params import SamplingParams
from ..sampling.sampler import Sampler

log = logging.getLogger(__name__)


class CudaMemory:
    """What warm-up reads of a CUDA device (bytes)."""

    def __init__(self, device: torch.device):
        self.device = device

    def free(self) -> int:
        return torch.cuda.mem_get_info(self.device)[0]

    def allocated(self) -> int:
        return torch.cuda.memory_allocated(self.device)

    def peak(self) -> int:
        return torch.cuda.max_memory_allocated(self.device)

    def reset_peak(self) -> None:
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)

    def release_cached(self) -> None:
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()


def kv_budget_after_warmup(budget, free_bytes: int, activation_bytes: int) -> int:
    """Bytes for the KV pool: `free_bytes` (the device's free memory after warm-up, cached blocks released) less
    `activation_bytes` (the warm-up steps' peak above what was allocated before them, their cache excluded: what
    serving steps need beside the pool). A fraction budget takes its share of that; a byte budget is capped by it."""
    usable = max(0, free_bytes - activation_bytes)
    b = parse_memory_budget(budget)
    if isinstance(b, float):
        return int(b * usable)
    if b > usable:
        log.warning("kv_cache_memory: %.1f MiB asked, %.1f MiB free after warm-up; the pool takes what is free",
                    b / 2**20, usable / 2**20)
    return min(b, usable)


class _WarmSeq:
    """A sampled row with every filter, penalties and the widest logprobs: the sampler's largest footprint."""

    def __init__(self, vocab: int, limits: SamplingLimits):
        self.params = SamplingParams(temperature=1.0, top_k=vocab // 2, top_p=0.9, min_p=0.01, repetition_penalty=1.1,
                                     presence_penalty=0.1, logprobs=limits.max_logprobs)
        self.prompt_ids, self.output_ids, self.min_tokens_blocked_ids = [0], [0], []
        self.generator = torch.Generator().manual_seed(0)
        self.grammar = None


def sample(logits: torch.Tensor, seqs: list) -> list:
    """The sampler's pass over the warm-up step's logits (as serving runs it: off the CPU without a host sync)."""
    return Sampler()(logits, seqs)


def warm_up(runner, cfg, model_config, dtype: torch.dtype, kernels, max_model_len: int, memory) -> int:
    """Runs the widest prefill and decode steps; returns their activation bytes (see kv_budget_after_warmup)."""
    S, dev, model = cfg.page_size, runner.device, runner.model
    n = max(1, min(cfg.max_num_batched_tokens, max_model_len - 1))
    B = cfg.max_num_seqs
    pages = max(-(-n // S), B) + 1
    memory.release_cached()
    memory.reset_peak()
    before = memory.allocated()
    cache = cache_class(cfg.kv_cache)(model_config.num_layers, pages, S, model_config.num_kv_heads,
                                      model_config.head_dim, dtype, dev, kernels, seed=cfg.tq_seed)
    cache_bytes = memory.allocated() - before
    with torch.inference_mode():
        # prefill: one sequence of n tokens over pages 0.. (its last row's logits, as a prompt's end)
        table = torch.arange(-(-n // S), dtype=torch.int32, device=dev).unsqueeze(0)
        meta = AttentionMetadata(slot_mapping=torch.arange(n, dtype=torch.int64, device=dev), block_tables=table,
                                 query_start_loc=torch.tensor([0, n], dtype=torch.int32, device=dev),
                                 seq_lens=torch.tensor([n], dtype=torch.int32, device=dev))
        hidden = model(torch.zeros(n, dtype=torch.int64, device=dev), torch.arange(n, device=dev), cache, meta)
        model.logits(hidden.narrow(0, n - 1, 1))
        del hidden
        # decode: B rows, one page each, one cached token, then the sampler over their logits
        tables = torch.arange(B, dtype=torch.int32, device=dev).unsqueeze(1)
        cached = torch.ones(B, dtype=torch.int32, device=dev)
        meta, positions = AttentionMetadata.for_decode(tables, cached, S)
        logits = model.logits(model(torch.zeros(B, dtype=torch.int64, device=dev), positions, cache, meta))
        sample(logits, [_WarmSeq(logits.shape[-1], cfg.limits) for _ in range(B)])
        del logits
    peak = memory.peak()
    del cache
    memory.release_cached()
    activation = max(0, peak - before - cache_bytes)
    log.info("warm-up: prefill of %d tokens and decode of %d rows need %.1f MiB beside the weights and the pool",
             n, B, activation / 2**20)
    return activation
