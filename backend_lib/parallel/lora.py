"""LoRA at tensor_parallel_size > 1: every rank applies the adapters of the step's rows to its own shard, and a row
gets TP = 1's bits.

- Column-parallel layers (qkv, gate_up): the input is whole on every rank; A is kept whole, B keeps the rows of
  the rank's output rows (its heads, its intermediate columns), sharded exactly as the base layer is. Every output
  element's update is computed whole on one rank by the same batch-invariant float_linear (whose result for an
  output row does not depend on the other rows it is computed with): TP = 1's bits.
- Row-parallel layers (o_proj, down_proj): the input is split by columns. Splitting A the same way would sum the
  ranks' partial x A^T in another order than TP = 1 (not bit-equal); instead the adapted rows' input shards are
  gathered (the rows with an adapter only, in rank order: TP = 1's input exactly) and every rank computes the
  whole update with whole A and B and adds it to the reduced base output, as TP = 1 does. One extra exchange of
  [adapted rows, K] per row-parallel layer, only in steps with adapted rows.

Rank 0 resolves adapters as without TP (lora/registry.py, keeping the fp32 A and B) and ships each to the workers
the first time a step uses it (one message per fused linear over the step channel); when the adapter object is
gone (evicted and no sequence holds it) the workers drop their shard at the next message.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass, field

import torch
from torch import nn

from ..lora.adapter import FusedDelta
from ..lora.layer import LoraBatch, LoraLinear, apply_delta
from .shard import head_rows, shard_heads, split

FUSED = ("qkv", "o", "gate_up", "down")
ROW_PARALLEL = frozenset({"o", "down"})


@dataclass
class ShardedAdapter:
    """One rank's share of an adapter: what LoraLinear reads (delta(layer, fused), scaling)."""
    scaling: float
    deltas: dict[tuple[int, str], FusedDelta] = field(default_factory=dict)

    def delta(self, layer: int, fused: str) -> FusedDelta | None:
        return self.deltas.get((layer, fused))


class LoraSharder:
    """Which rows of each fused linear's B this rank keeps (those of its base shard)."""

    def __init__(self, cfg, group, kernels, device):
        self.kernels, self.device = kernels, device
        d, h, kvh = cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
        hs = shard_heads(h, kvh, group.rank, group.size)
        q, kv = head_rows(hs.heads, d), head_rows(hs.kv_heads, d)
        ar = lambda s, off=0: torch.arange(s.start + off, s.stop + off)  # noqa: E731
        self.rows = {"qkv": torch.cat([ar(q), ar(kv, h * d), ar(kv, h * d + kvh * d)])}
        if cfg.intermediate_size:
            f = split(cfg.intermediate_size, group.rank, group.size, "intermediate_size")
            self.rows["gate_up"] = torch.cat([ar(f), ar(f, cfg.intermediate_size)])

    def shard(self, fused: str, a: torch.Tensor, b: torch.Tensor) -> FusedDelta:
        if fused not in ROW_PARALLEL:
            b = b.index_select(0, self.rows[fused])
        k = self.kernels
        return FusedDelta(None, None, k.float_prepare(a.float().contiguous().to(self.device)),
                          k.float_prepare(b.float().contiguous().to(self.device)))


class RowParallelLora(nn.Module):
    """A row-parallel base (parallel/linear.py) plus the step's adapters, computed whole from the gathered input."""

    def __init__(self, base: nn.Module, layer: int, fused: str, ctx, kernels, group):
        super().__init__()
        self.base, self.layer, self.fused, self.ctx, self.kernels, self.group = base, layer, fused, ctx, kernels, group

    def forward(self, x: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        y = self.base.forward(x, out_dtype)
        batch = self.ctx.batch
        if batch is None:
            return y
        groups = [(a, rows, d) for a, rows in batch.groups if (d := a.delta(self.layer, self.fused)) is not None]
        if not groups:
            return y
        x_rows = self.group.cat(x.index_select(0, torch.cat([rows for _, rows, _ in groups])).contiguous(), dim=-1)
        off = 0
        for adapter, rows, d in groups:
            xr = x_rows[off:off + rows.numel()]
            off += rows.numel()
            y.index_copy_(0, rows, apply_delta(self.kernels, xr, y.index_select(0, rows), d, adapter.scaling))
        return y


def attach(model, ctx, kernels, group) -> None:
    """Wraps every decoder layer's fused linears of this rank's shard (lora/layer.py's attach, sharded)."""
    for i, layer in enumerate(model.layers):
        attn, mlp = layer.self_attn, layer.mlp
        attn.qkv_proj = LoraLinear(attn.qkv_proj, i, "qkv", ctx, kernels)
        attn.o_proj = RowParallelLora(attn.o_proj, i, "o", ctx, kernels, group)
        if not hasattr(mlp, "gate_up_proj"):
            continue
        mlp.gate_up_proj = LoraLinear(mlp.gate_up_proj, i, "gate_up", ctx, kernels)
        mlp.down_proj = RowParallelLora(mlp.down_proj, i, "down", ctx, kernels, group)


class LoraShipper:
    """Rank 0: each adapter's slot on the workers, shipped on first use, dropped once the adapter object is gone."""

    def __init__(self, sharder: LoraSharder):
        self.sharder = sharder
        self.live: dict[int, tuple[int, ShardedAdapter]] = {}    # id(adapter) -> (slot, rank 0's shard)
        self.gone: list[int] = []                                 # slots to drop (appended by finalizers)
        self.next_slot = 0

    def messages(self, batch: LoraBatch | None, send) -> tuple[LoraBatch | None, torch.Tensor | None]:
        """Sends the drops and the adapters the workers lack (send(op, a, b, tensors)); returns rank 0's batch of
        shards and the step's LoRA tensor for the workers: [groups, (slot, rows) per group, the rows]."""
        from .runtime import LORA_DELTA, LORA_DROP, LORA_META
        from .channel import float_word

        while self.gone:
            send(LORA_DROP, self.gone.pop())
        if batch is None:
            return None, None
        groups, head, rows = [], [len(batch.groups)], []
        for adapter, r in batch.groups:
            entry = self.live.get(id(adapter))
            if entry is None:
                slot, self.next_slot = self.next_slot, self.next_slot + 1
                shard = ShardedAdapter(adapter.scaling)
                send(LORA_META, slot, float_word(adapter.scaling))
                for (layer, fused), d in sorted(adapter.deltas.items()):
                    if d.a is None:
                        raise RuntimeError(f"LoRA adapter {adapter.name!r}: its A and B were not kept for the "
                                           "tensor-parallel ranks")
                    send(LORA_DELTA, slot, layer * len(FUSED) + FUSED.index(fused), (d.a, d.b))
                    shard.deltas[(layer, fused)] = self.sharder.shard(fused, d.a, d.b)
                entry = self.live[id(adapter)] = (slot, shard)
                key = id(adapter)
                weakref.finalize(adapter, self._gone, key, slot)
            slot, shard = entry
            groups.append((shard, r))
            head += [slot, r.numel()]
            rows.append(r.cpu())
        return LoraBatch(tuple(groups)), torch.cat([torch.tensor(head, dtype=torch.int64), *rows])

    def _gone(self, key: int, slot: int) -> None:
        self.live.pop(key, None)
        self.gone.append(slot)


class LoraReceiver:
    """A worker: the adapters' shards by slot, and each step's batch from its LoRA tensor."""

    def __init__(self, sharder: LoraSharder):
        self.sharder, self.slots = sharder, {}

    def meta(self, slot: int, scaling: float) -> None:
        self.slots[slot] = ShardedAdapter(scaling)

    def delta(self, slot: int, code: int, a: torch.Tensor, b: torch.Tensor) -> None:
        layer, fused = divmod(code, len(FUSED))
        self.slots[slot].deltas[(layer, FUSED[fused])] = self.sharder.shard(FUSED[fused], a, b)

    def drop(self, slot: int) -> None:
        self.slots.pop(slot, None)

    def batch(self, t: torch.Tensor | None, device) -> LoraBatch | None:
        if t is None:
            return None
        v = t.tolist()
        n, groups, off = v[0], [], 1 + 2 * v[0]
        for g in range(n):
            slot, count = v[1 + 2 * g], v[2 + 2 * g]
            groups.append((self.slots[slot], t[off:off + count].to(device)))
            off += count
        return LoraBatch(tuple(groups))
