from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    """Where the step's tokens go in the paged cache and what each sequence attends to.

    slot_mapping     [T] int64   page * page_size + offset of each new token's K/V row
    block_tables     [B, P] int32 page ids of each sequence (padded)
    query_start_loc  [B + 1] int32 offsets of each sequence's rows in the step's tokens
    seq_lens         [B] int32   tokens of the sequence in the cache after this step
    """

    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor

    @classmethod
    def for_decode(cls, block_tables: torch.Tensor, context_lens: torch.Tensor,
                   page_size: int) -> tuple["AttentionMetadata", torch.Tensor]:
        """A decode step (one new token per sequence) built on the tensors' device from the block tables and
        the tokens already cached ([B] int32), with no host round trip: (metadata, positions int64 [B]).
        The same integers the host-side construction gives; the form a captured decode graph replays.
        A negative cached length marks a padding row of a graph's batch bucket: slot -1 (the Triton KV writes
        skip it), position 0, one key of its table's first page to read."""
        pad = context_lens < 0
        positions = context_lens.long().clamp(min=0)
        pages = block_tables.gather(1, (positions // page_size).unsqueeze(1)).squeeze(1).long()
        b = block_tables.shape[0]
        meta = cls(slot_mapping=(pages * page_size + positions % page_size).masked_fill(pad, -1),
                   block_tables=block_tables,
                   query_start_loc=torch.arange(b + 1, dtype=torch.int32, device=block_tables.device),
                   seq_lens=(positions + 1).to(torch.int32))
        return meta, positions

    @classmethod
    def for_decode_host(cls, tables: list[list[int]], context: list[int], block_tables: torch.Tensor,
                        page_size: int) -> tuple["AttentionMetadata", torch.Tensor]:
        """for_decode's integers computed from the host's lists (each sequence's pages and tokens cached; no padding
        rows), for a step whose tensors stay on the CPU: four small tensors instead of for_decode's ~10 tensor ops
        (~0.1 ms a batch-1 step on the 2-core VMs here). block_tables: `tables` already as the padded [B, P] tensor."""
        slots = [t[c // page_size] * page_size + c % page_size for t, c in zip(tables, context)]
        meta = cls(slot_mapping=torch.tensor(slots, dtype=torch.int64), block_tables=block_tables,
                   query_start_loc=torch.arange(len(context) + 1, dtype=torch.int32),
                   seq_lens=torch.tensor([c + 1 for c in context], dtype=torch.int32))
        return meta, torch.tensor(context, dtype=torch.int64)
