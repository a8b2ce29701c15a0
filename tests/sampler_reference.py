"""The host sampler as it was before the one sampling pipeline (sampling/sampler.py, commit 9cbc7b8), frozen: the
exactness tests compare the pipeline with it bit for bit (ids, logprobs, ranks, top-N, error messages)."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from backend_lib.contract.errors import RequestError
from backend_lib.sampling.structured import apply_mask


@dataclass
class Sample:
    token_id: int
    logprob: float | None = None
    rank: int | None = None                # of the sampled token among all, 1 = the most likely
    top_logprobs: list[tuple[int, float]] | None = None


# A grammar whose every allowed token the request's other rules forbid (one message for both samplers)
GRAMMAR_BLOCKED = ("structured_outputs: no token is allowed here (the grammar is complete but min_tokens, "
                   "stop_token_ids, allowed_token_ids or bad_words forbid every token it allows)")


@dataclass
class SampleError:
    """Sampling failed for this row's request alone."""
    message: str


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


def has_token_masks(params) -> bool:
    return bool(params.allowed_token_ids or params.bad_words_ids or params.logit_bias)


def apply_token_masks(row: torch.Tensor, output_ids: list[int], params) -> None:
    """In place, as vLLM orders them: allowed_token_ids (everything else -inf), bad_words (the last token
    of a bad word whose other tokens end the output so far), then logit_bias added to the logits."""
    if params.allowed_token_ids:
        ids = torch.tensor(params.allowed_token_ids, dtype=torch.long, device=row.device)
        keep = row[ids].clone()
        row.fill_(float("-inf"))
        row[ids] = keep
    for word in params.bad_words_ids:
        prefix = len(word) - 1
        if prefix > len(output_ids):
            continue
        if prefix == 0 or output_ids[-prefix:] == word[:prefix]:
            row[word[-1]] = float("-inf")
    if params.logit_bias:
        ids = torch.tensor(list(params.logit_bias), dtype=torch.long, device=row.device)
        row[ids] += torch.tensor(list(params.logit_bias.values()), dtype=row.dtype, device=row.device)


def _finite(row: torch.Tensor) -> torch.Tensor:
    """Overflowed values (penalties, tiny temperatures) clamped to the largest finite ones; NaN dropped."""
    big = torch.finfo(row.dtype).max
    return torch.nan_to_num(row, nan=float("-inf"), posinf=big, neginf=float("-inf"))


def sample_row(row: torch.Tensor, params, generator: torch.Generator) -> int:
    """One token from processed logits `row` with temperature, top-k, min-p and top-p; inverse-CDF draw.
    The most likely token always stays a candidate, so no filter can leave the row empty."""
    row = _finite(row / params.temperature)
    idx = None
    if params.top_k and params.top_k < row.shape[0]:
        row, idx = torch.topk(row, params.top_k)
    if params.min_p > 0 or params.top_p < 1.0:
        if idx is None:
            row, idx = torch.sort(row, descending=True)
        probs = torch.softmax(row, dim=-1)
        keep = torch.ones_like(probs, dtype=torch.bool)
        if params.min_p > 0:
            keep &= probs >= params.min_p * probs[0]
        if params.top_p < 1.0:
            keep &= (probs.cumsum(0) - probs) < params.top_p
        keep[0] = True
        row = row[keep]
        idx = idx[keep]
    probs = torch.softmax(row, dim=-1)
    cdf = probs.cumsum(0)
    u = torch.rand(1, generator=generator, dtype=torch.float64).item() * cdf[-1].item()
    j = int(torch.searchsorted(cdf, torch.tensor([u], dtype=cdf.dtype, device=cdf.device), right=True).item())
    j = min(j, row.shape[0] - 1)
    return int(idx[j]) if idx is not None else j


def nonfinite_rows(logits: torch.Tensor) -> list[int]:
    """Rows of fp32 [B, V] logits holding a NaN or an infinity. A row's sum is non-finite whenever the row is
    (and, rarely, when finite values overflow it): one summing pass instead of a [B, V] mask, then the exact
    check on the rows it flags (torch's isfinite + all is ~50x slower than the sum over 151,936 logits here)."""
    suspects = (~torch.isfinite(logits.sum(dim=-1))).nonzero().flatten().tolist()
    return [b for b in suspects if not bool(torch.isfinite(logits[b]).all())]


def greedy_picks(logits: torch.Tensor, rows: list[int]) -> list[int]:
    """The first index of each row's maximum (torch.argmax's rule), through numpy's vectorized argmax: torch's
    CPU argmax over 151,936 fp32 logits took ~0.2-0.3 ms a row here, numpy's ~7 us."""
    x = logits.detach().cpu().numpy()
    return [int(i) for i in np.argmax(x[rows] if len(rows) != x.shape[0] else x, axis=-1)]


class ReferenceSampler:
    def __init__(self):
        self._mask = torch.empty(0, dtype=torch.int32)

    def _mask_buffer(self, vocab: int) -> torch.Tensor:
        """One bitmask row reused for every constrained row (filled and applied one row at a time)."""
        if self._mask.numel() != (vocab + 31) // 32:
            self._mask = torch.empty((vocab + 31) // 32, dtype=torch.int32)
        return self._mask

    @staticmethod
    def _plain_greedy(s) -> bool:
        """A row __call__ would only argmax: greedy, no penalty, no min_tokens block, no grammar, no logprobs."""
        p = s.params
        return (p.greedy and p.repetition_penalty == 1.0 and not p.presence_penalty and not p.frequency_penalty
                and len(s.output_ids) >= p.min_tokens and p.logprobs is None
                and not (s.grammar is not None and s.grammar.active))

    def greedy_on_device(self, logits: torch.Tensor, seqs: list) -> list[Sample] | None:
        """Where every row is plain greedy and finite, __call__'s result computed where the logits are: only B
        token ids (and B finiteness flags) travel to the host instead of B x vocab logits. None otherwise
        (the caller then runs __call__ on the host copy, which also words any non-finite row's error)."""
        if not seqs or not all(self._plain_greedy(s) for s in seqs):
            return None
        logits = logits.float()
        picks = torch.stack([logits.argmax(dim=-1), torch.isfinite(logits).all(dim=-1).long()]).cpu()
        if not bool(picks[1].all()):
            return None
        return [Sample(int(t)) for t in picks[0].tolist()]

    def __call__(self, logits: torch.Tensor, seqs: list) -> list[Sample | SampleError]:
        """logits: fp32 [B, V], row b belongs to seqs[b]."""
        logits = logits.float()
        out: list[Sample | SampleError | None] = [None] * len(seqs)
        bad = nonfinite_rows(logits)
        for b in bad:   # the model's own output (not a parameter) is broken for this row
            bad_value = logits[b][~torch.isfinite(logits[b])][0].item()
            out[b] = SampleError(f"the model produced a non-finite logit ({bad_value}) for this request")
        processed = logits
        touched = False
        for b, s in enumerate(seqs):
            p = s.params
            needs_penalty = p.repetition_penalty != 1.0 or p.presence_penalty or p.frequency_penalty
            suppress = len(s.output_ids) < p.min_tokens
            grammar = s.grammar if s.grammar is not None and s.grammar.active else None
            masks = has_token_masks(p)
            if out[b] is None and (needs_penalty or suppress or grammar or masks):
                if not touched:
                    processed, touched = logits.clone(), True
                try:
                    if grammar:   # first, as vLLM does: the penalties then see only what the grammar allows
                        mask = self._mask_buffer(logits.shape[-1])
                        grammar.fill_mask(mask)
                        apply_mask(processed[b], mask)
                except RequestError as exc:   # names the request's own field
                    out[b] = SampleError(str(exc))
                    continue
                except Exception as exc:
                    out[b] = SampleError(f"structured_outputs: the grammar failed ({exc})")
                    continue
                try:
                    if masks:
                        apply_token_masks(processed[b], s.output_ids, p)
                except Exception as exc:
                    out[b] = SampleError(f"logit_bias / allowed_token_ids / bad_words: applying them failed ({exc})")
                    continue
                try:
                    if needs_penalty:
                        apply_penalties(processed[b], s.prompt_ids, s.output_ids, p)
                    if suppress:
                        processed[b, list(s.min_tokens_blocked_ids)] = float("-inf")
                except Exception as exc:
                    out[b] = SampleError(f"sampling: applying penalties failed ({exc})")
                    continue
                if (grammar or masks) and not np.isfinite(processed[b].numpy()).any():
                    if grammar:
                        out[b] = SampleError(GRAMMAR_BLOCKED)
                    else:
                        out[b] = SampleError("allowed_token_ids: no token is allowed here (min_tokens, bad_words or "
                                             "stop_token_ids forbid every allowed token)")
        greedy = [b for b, s in enumerate(seqs) if s.params.greedy and out[b] is None]
        if greedy:
            picks = greedy_picks(processed, greedy)
            for b, t in zip(greedy, picks):
                out[b] = Sample(int(t))
        for b, s in enumerate(seqs):
            if out[b] is None:
                try:
                    out[b] = Sample(sample_row(processed[b], s.params, s.generator))
                except Exception as exc:
                    out[b] = SampleError(f"sampling failed ({exc})")
        lp_rows = [b for b, s in enumerate(seqs) if s.params.logprobs is not None and isinstance(out[b], Sample)]
        if lp_rows:
            logprobs = torch.log_softmax(logits[lp_rows], dim=-1)
            for r, b in enumerate(lp_rows):
                row = logprobs[r]
                sample = out[b]
                sample.logprob = float(row[sample.token_id])
                sample.rank = int((row > row[sample.token_id]).sum()) + 1
                n = seqs[b].params.logprobs
                if n:
                    vals, ids = torch.topk(row, n)
                    sample.top_logprobs = list(zip(ids.tolist(), vals.tolist()))
                else:
                    sample.top_logprobs = []
        return out
