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
