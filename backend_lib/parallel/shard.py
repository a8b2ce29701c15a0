"""How Qwen3's weights split across tensor-parallel ranks, as the peers split them: q/k/v and gate/up by output
rows (column parallel: whole heads, whole intermediate columns), o_proj and down_proj by input columns (row
parallel), KV heads replicated when there are fewer than ranks. Errors name the dimension that does not split."""
from __future__ import annotations

from dataclasses import dataclass


def split(n: int, rank: int, size: int, what: str) -> slice:
    """The rank's contiguous share of n."""
    if n % size:
        raise ValueError(f"tensor_parallel_size: {what} ({n}) is not divisible by {size}")
    step = n // size
    return slice(rank * step, (rank + 1) * step)


@dataclass(frozen=True)
class HeadShard:
    heads: slice        # this rank's query heads
    kv_heads: slice     # the KV heads they read (one replicated head when KV heads < ranks)

    @property
    def num_heads(self) -> int:
        return self.heads.stop - self.heads.start

    @property
    def num_kv_heads(self) -> int:
        return self.kv_heads.stop - self.kv_heads.start


def shard_heads(num_heads: int, num_kv_heads: int, rank: int, size: int) -> HeadShard:
    heads = split(num_heads, rank, size, "num_attention_heads")
    if num_kv_heads >= size:
        return HeadShard(heads, split(num_kv_heads, rank, size, "num_key_value_heads"))
    if size % num_kv_heads:
        raise ValueError(f"tensor_parallel_size: {size} ranks cannot share {num_kv_heads} KV heads evenly "
                         "(the ranks must be a multiple of num_key_value_heads)")
    group = num_heads // num_kv_heads             # query heads per KV head
    kv = heads.start // group                      # every head of this rank reads the same KV head
    return HeadShard(heads, slice(kv, kv + 1))


def head_rows(heads: slice, head_dim: int) -> slice:
    return slice(heads.start * head_dim, heads.stop * head_dim)
