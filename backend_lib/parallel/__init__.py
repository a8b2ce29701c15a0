"""Tensor parallelism over torch.distributed: the process group (group.py), how Qwen3's weights split across
ranks (shard.py), the parallel linear layers (linear.py) and a sharded Qwen3 model (model.py).

Exactness is the design rule: an A8W8 row-parallel layer takes its per-token activation scale from an
all-reduce MAX of the ranks' partial maxima (max is exact) and all-reduces its int32 partial sums (integer
addition is exact and associative), so TP = N computes TP = 1's bits; column-parallel layers compute whole
output elements on one rank, exact by construction. Float row-parallel layers gather the ranks' fp32 partial
sums and add them in rank order: deterministic and batch invariant, but a different summation order than
TP = 1's single K loop (within fp32 rounding of it, not bit-equal).
"""
from .group import TPGroup

__all__ = ["TPGroup"]
