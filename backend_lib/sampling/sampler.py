"""Turns a step's logits into next tokens, one row per sequence, with per-request parameters.

Each row is processed on its own values only (penalties, temperature, top-k/top-p, one uniform
draw from the request's own torch.Generator), so a seeded request samples the same tokens
whatever else shares its batch.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Sample:
    token_id: int
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] | None = None


def apply_penalties(row: torch.Tensor, prompt_ids: list[int], output_ids: list[int], params) -> None:
    """In place: vLLM's repetition (prompt + output), presence and frequency (output) penalties."""
    vocab = row.shape[0]
    if params.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(prompt_ids) | set(output_ids)), dtype=torch.long, device=row.device)
        if seen.numel():
            vals = row[seen]
            row[seen] = torch.where(vals > 0, vals / params.repetition_penalty, vals * params.repetition_penalty)
    if (params.presence_penalty or params.frequency_penalty) and output_ids:
        counts = torch.bincount(torch.tensor(output_ids, dtype=torch.long, device=row.device), minlength=vocab)
        counts = counts[:vocab].to(row.dtype)
        row -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0).to(row.dtype)


def sample_row(row: torch.Tensor, params, generator: torch.Generator) -> int:
    """One token from processed logits `row` with temperature, top-k and top-p; inverse-CDF draw."""
    row = row / params.temperature
    idx = None
    if params.top_k and params.top_k < row.shape[0]:
        row, idx = torch.topk(row, params.top_k)
    if params.top_p < 1.0:
        if idx is None:
            row, idx = torch.sort(row, descending=True)
        probs = torch.softmax(row, dim=-1)
        keep = (probs.cumsum(0) - probs) < params.top_p   # always keeps the first token
        row = row[keep]
        idx = idx[keep]
    probs = torch.softmax(row, dim=-1)
    cdf = probs.cumsum(0)
    u = torch.rand(1, generator=generator, dtype=torch.float64).item() * cdf[-1].item()
    j = int(torch.searchsorted(cdf, torch.tensor([u], dtype=cdf.dtype, device=cdf.device), right=True).item())
    j = min(j, row.shape[0] - 1)
    return int(idx[j]) if idx is not None else j


class Sampler:
    def __call__(self, logits: torch.Tensor, seqs: list) -> list[Sample]:
        """logits: fp32 [B, V], row b belongs to seqs[b]."""
        logits = logits.float()
        out: list[Sample | None] = [None] * len(seqs)
        lp_rows = [b for b, s in enumerate(seqs) if s.params.logprobs is not None]
        logprobs = torch.log_softmax(logits[lp_rows], dim=-1) if lp_rows else None
        processed = logits
        touched = False
        for b, s in enumerate(seqs):
            p = s.params
            needs_penalty = p.repetition_penalty != 1.0 or p.presence_penalty or p.frequency_penalty
            suppress = len(s.output_ids) < p.min_tokens
            if needs_penalty or suppress:
                if not touched:
                    processed, touched = logits.clone(), True
                if needs_penalty:
                    apply_penalties(processed[b], s.prompt_ids, s.output_ids, p)
                if suppress:
                    processed[b, list(s.min_tokens_blocked_ids)] = float("-inf")
        greedy = [b for b, s in enumerate(seqs) if s.params.greedy]
        if greedy:
            picks = processed[greedy].argmax(dim=-1).tolist()
            for b, t in zip(greedy, picks):
                out[b] = Sample(int(t))
        for b, s in enumerate(seqs):
            if out[b] is None:
                out[b] = Sample(sample_row(processed[b], s.params, s.generator))
        for r, b in enumerate(lp_rows):
            row = logprobs[r]
            sample = out[b]
            sample.logprob = float(row[sample.token_id])
            n = seqs[b].params.logprobs
            if n:
                vals, ids = torch.topk(row, n)
                sample.top_logprobs = list(zip(ids.tolist(), vals.tolist()))
            else:
                sample.top_logprobs = []
        return out
