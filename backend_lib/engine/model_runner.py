"""The device side of the engine: builds and owns the model, the KV cache and the sampler; turns a
scheduled step into tensors, runs the model and samples the sequences that reached their end."""
from __future__ import annotations

import logging

import torch

from ..checkpoint import WeightStore
from ..kv_cache import allocate_kv_cache
from ..kv_cache.metadata import AttentionMetadata
from ..models import Qwen3ForCausalLM
from ..sampling.sampler import Sample, SampleError, Sampler
from .sequence import Sequence

log = logging.getLogger(__name__)


class InjectedFault(RuntimeError):
    """Raised by the fault-injection test hook."""


class ModelRunner:
    def __init__(self, cfg, model_config, scheme, device: torch.device, dtype: torch.dtype, kernels,
                 max_model_len: int, fault_every: int | None = None):
        self.device, self.page_size = device, cfg.page_size
        self.model = Qwen3ForCausalLM.from_checkpoint(WeightStore(cfg.checkpoint), model_config, scheme, dtype,
                                                      device, kernels, max_model_len)
        self.kv_cache = allocate_kv_cache(cfg.kv_cache, model_config, dtype, device, kernels, cfg.kv_cache_memory,
                                          cfg.page_size, max_model_len, cfg.max_num_seqs, seed=cfg.tq_seed)
        self.sampler = Sampler()
        self.fault_every = fault_every
        self.steps = 0

    def prepare(self, plan: list[tuple[Sequence, int]]):
        S = self.page_size
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        qsl, lens, tables, sample_rows, sample_seqs = [0], [], [], [], []
        for seq, n in plan:
            start = seq.num_computed
            ids.extend(seq.tokens[start:start + n])
            positions.extend(range(start, start + n))
            bt = seq.block_table
            slots.extend(bt[p // S] * S + p % S for p in range(start, start + n))
            qsl.append(qsl[-1] + n)
            lens.append(start + n)
            tables.append(bt)
            if start + n == seq.num_tokens:
                sample_rows.append(qsl[-1] - 1)
                sample_seqs.append(seq)
        width = max(len(t) for t in tables)
        block_tables = torch.zeros((len(tables), width), dtype=torch.int32)
        for b, t in enumerate(tables):
            block_tables[b, :len(t)] = torch.tensor(t, dtype=torch.int32)
        dev = self.device
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
            block_tables=block_tables.to(dev),
            query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=dev),
            seq_lens=torch.tensor(lens, dtype=torch.int32, device=dev),
        )
        return (torch.tensor(ids, dtype=torch.int64, device=dev), torch.tensor(positions, dtype=torch.int64, device=dev),
                meta, sample_rows, sample_seqs)

    @torch.inference_mode()
    def execute(self, plan: list[tuple[Sequence, int]]) -> list[tuple[Sequence, Sample | SampleError]]:
        """Runs the step; a raise here is a fault of the whole forward. Sampling faults are per row."""
        self.steps += 1
        if self.fault_every and self.steps % self.fault_every == 0:
            raise InjectedFault(f"injected fault at step {self.steps} (fault_injection every:{self.fault_every})")
        input_ids, positions, meta, rows, seqs = self.prepare(plan)
        hidden = self.model(input_ids, positions, self.kv_cache, meta)
        self._record_prompt_logprobs(plan, hidden)
        if not seqs:
            return []
        logits = self.model.logits(hidden[rows])
        samples = self.sampler(logits.cpu() if logits.device.type != "cpu" else logits, seqs)
        return list(zip(seqs, samples))

    def _record_prompt_logprobs(self, plan: list[tuple[Sequence, int]], hidden: torch.Tensor) -> None:
        """prompt_logprobs from this step's forward (no second pass): the logits of every row of a
        sequence's prompt chunk, computed over the chunk's rows as LLMEngine.score computes them, so the
        values are score's. A failure fails that request alone (seq.failure)."""
        off = 0
        for seq, n in plan:
            rows, off = slice(off, off + n), off + n
            k = seq.params.prompt_logprobs
            if k is None or seq.failure is not None:
                continue
            start, num_prompt, done = seq.num_computed, len(seq.prompt_ids), len(seq.prompt_logprobs)
            if start + n < done or done >= num_prompt:   # recomputed after a preemption: recorded already
                continue
            try:
                logp = torch.log_softmax(self.model.logits(hidden[rows]).float(), dim=-1).cpu()
                top = torch.topk(logp, k, dim=-1) if k else None
                for i in range(n):
                    t = start + i + 1                   # the prompt token that row i predicts
                    if t < done or t >= num_prompt:
                        continue
                    tok = seq.prompt_ids[t]
                    lp = logp[i, tok]
                    seq.prompt_logprobs.append({
                        "id": tok, "logprob": lp.item(), "rank": int((logp[i] > lp).sum()) + 1,
                        "top": [] if top is None else [{"id": j, "logprob": v} for j, v in
                                                       zip(top.indices[i].tolist(), top.values[i].tolist())]})
            except Exception as exc:
                seq.failure = f"prompt_logprobs: computing them failed ({exc})"

    @torch.inference_mode()
    def prompt_logprobs(self, seq: Sequence, chunk: int) -> tuple[list[float | None], list[int]]:
        """Log-probability of every token given those before it (first entry None), chunk by chunk,
        and the model's top-1 prediction after each position."""
        out: list[float | None] = [None]
        top1: list[int] = []
        while seq.num_pending > 0:
            n = min(chunk, seq.num_pending)
            input_ids, positions, meta, _, _ = self.prepare([(seq, n)])
            hidden = self.model(input_ids, positions, self.kv_cache, meta)
            logp = torch.log_softmax(self.model.logits(hidden).float(), dim=-1).cpu()
            start = seq.num_computed
            nxt = seq.tokens[start + 1:start + n + 1]
            out.extend(logp[i, t].item() for i, t in enumerate(nxt))
            top1.extend(logp.argmax(dim=-1).tolist())
            seq.num_computed += n
        return out, top1
