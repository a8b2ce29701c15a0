"""Vocab parallel: the embedding and the head split by vocabulary rows across the ranks (rank r holds the rows
[r * share, (r + 1) * share), share = ceil(vocab / ranks); a tied embedding is read from the head's own rows, so
each rank holds 1 / N of the largest tensor of a small model), as the peers split them.

- Embedding: each rank looks up the ids it holds (zero rows elsewhere); the ranks' rows are gathered and each
  token's row is taken from the rank that holds its id: the checkpoint's row exactly (no sum: x + 0 would turn a
  -0.0 into +0.0).
- Head: each rank computes the logits of its rows, whole (the kernel's result for a row of the weight does not
  depend on the other rows it is computed with), and they are gathered in rank order to rank 0, which samples:
  TP = 1's logits bits. Rows are gathered in chunks that fit the shared-memory slot.
"""
from __future__ import annotations

import torch

from ..models.qwen3 import Qwen3ForCausalLM
from .group import TPGroup


def vocab_share(vocab: int, size: int) -> int:
    return -(-vocab // size)


def vocab_rows(vocab: int, rank: int, size: int) -> slice:
    share = vocab_share(vocab, size)
    lo = min(vocab, rank * share)
    return slice(lo, min(vocab, lo + share))


class VocabParallelQwen3(Qwen3ForCausalLM):
    """A sharded Qwen3 whose embedding and head hold this rank's vocabulary rows (lm_head: those rows; embed: the
    same rows of the embedding, or None when tied to a float head)."""

    def __init__(self, *args, group: TPGroup, vocab: int, **kw):
        super().__init__(*args, **kw)
        self.group, self.vocab = group, vocab
        self.share = vocab_share(vocab, group.size)
        self.rows = vocab_rows(vocab, group.rank, group.size)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        lo, n = self.rows.start, self.rows.stop - self.rows.start
        local = input_ids - lo
        idx = ((local >= 0) & (local < n)).nonzero().squeeze(1)
        out = torch.zeros((input_ids.numel(), self.cfg.hidden_size), dtype=self.dtype, device=input_ids.device)
        if idx.numel():
            ids = local.index_select(0, idx)
            rows = self.lm_head.rows(ids) if self.embed_tokens is None else self.embed_tokens.index_select(0, ids)
            out.index_copy_(0, idx, rows.to(self.dtype))
        if self.group.size == 1:
            return out
        parts = torch.stack(self.group.all_gather(out))                         # [ranks, T, hidden]
        owner = torch.div(input_ids, self.share, rounding_mode="floor").clamp_(max=self.group.size - 1)
        return parts[owner, torch.arange(input_ids.numel(), device=input_ids.device)]

    def logits(self, hidden: torch.Tensor, everywhere: bool = False) -> torch.Tensor | None:
        """fp32 logits [n, vocab] of the hidden rows, on rank 0 (None on the others; everywhere: on every rank).
        Every rank must call it with the same rows (rank 0's runtime sends them first)."""
        shm = self.group.shm
        chunk = max(1, shm.slot_bytes // (self.share * 4)) if shm is not None else max(1, hidden.shape[0])
        outs = []
        for r0 in range(0, hidden.shape[0], chunk):
            local = self.lm_head(hidden[r0:r0 + chunk], torch.float32)
            if local.shape[1] < self.share:      # the last rank's share may be shorter: padded for the gather
                local = torch.nn.functional.pad(local, (0, self.share - local.shape[1]))
            parts = self.group.all_gather(local.contiguous()) if everywhere else self.group.gather_to_0(local)
            if parts is not None:
                outs.append(torch.cat(parts, dim=1)[:, :self.vocab])
        if not outs:
            return None if hidden.shape[0] else torch.empty((0, self.vocab), device=hidden.device)
        return outs[0] if len(outs) == 1 else torch.cat(outs)
