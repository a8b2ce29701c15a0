"""The tensor-parallel process group: torch.distributed with the backend of the device (gloo on the CPU, NCCL on
CUDA, HCCL on the NPU through torch_npu), set up from the standard env rendezvous (MASTER_ADDR, MASTER_PORT,
RANK, WORLD_SIZE) or from explicit values, so ranks may live on other hosts. No home-made transport."""
from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

BACKENDS = {"cpu": "gloo", "cuda": "nccl", "npu": "hccl"}


def backend_for(device: torch.device | str) -> str:
    kind = torch.device(device).type
    if kind not in BACKENDS:
        raise ValueError(f"tensor_parallel_size: no torch.distributed backend for device {kind!r} "
                         f"(known: {', '.join(BACKENDS)})")
    if kind == "npu":
        import torch_npu  # noqa: F401  (registers the hccl backend)
    return BACKENDS[kind]


def shm_slot_bytes(tokens: int, hidden: int, cap: int = 16 << 20, logits_rows: int = 0, vocab_share: int = 0) -> int:
    """A slot holding one step's row-parallel partial sums ([tokens, hidden] int32 / fp32) and a rank's fp32 logits
    of logits_rows rows (its vocab_share columns), at most cap bytes (a larger message goes through the backend;
    logits rows are gathered in chunks that fit)."""
    return min(cap, max(tokens * hidden * 4, logits_rows * vocab_share * 4))


@dataclass
class TPGroup:
    """rank / size of this process in its tensor-parallel group; size 1 is the unsharded model (no collectives)."""
    rank: int = 0
    size: int = 1
    group: object = None
    shm: object = None      # ShmExchange: the ranks of one host exchange small tensors through shared memory

    def enable_shm(self, name: str, slot_bytes: int, timeout_s: float = 120.0) -> None:
        """Collectives that fit slot_bytes go through shared memory (parallel/shm.py); rank 0 creates the file
        and every rank opens it after a barrier. Only for ranks on one host."""
        from .shm import ShmExchange

        path = f"/dev/shm/{name}"
        if self.rank == 0:
            self.shm = ShmExchange(path, 0, self.size, slot_bytes, True, timeout_s)
        dist.barrier(group=self.group)
        if self.rank != 0:
            self.shm = ShmExchange(path, self.rank, self.size, slot_bytes, False, timeout_s)
        dist.barrier(group=self.group)
        if self.rank == 0:
            os.unlink(path)     # the mappings stay; nothing is left in /dev/shm whatever happens next

    @classmethod
    def init(cls, rank: int, size: int, master_addr: str, master_port: int, device="cpu",
             timeout_s: float = 300.0) -> "TPGroup":
        if not 0 <= rank < size:
            raise ValueError(f"rank {rank} is outside the group of {size}")
        if size == 1:
            return cls()
        if not dist.is_initialized():
            dist.init_process_group(backend_for(device), init_method=f"tcp://{master_addr}:{int(master_port)}",
                                    rank=rank, world_size=size, timeout=datetime.timedelta(seconds=timeout_s))
        return cls(rank, size, dist.group.WORLD)

    @classmethod
    def from_env(cls, device="cpu", env=os.environ, timeout_s: float = 300.0) -> "TPGroup":
        """The env rendezvous torchrun and Kubernetes LeaderWorkerSet set; a missing variable is named."""
        missing = [k for k in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE") if k not in env]
        if missing:
            raise ValueError(f"tensor parallel rendezvous: {', '.join(missing)} not set")
        return cls.init(int(env["RANK"]), int(env["WORLD_SIZE"]), env["MASTER_ADDR"], int(env["MASTER_PORT"]),
                        device, timeout_s)

    def all_reduce_max_(self, t: torch.Tensor) -> torch.Tensor:
        if self.shm is not None and self.shm.fits(t):
            parts = self.shm.exchange(t)
            out = parts[0].clone()
            for p in parts[1:]:
                torch.maximum(out, p, out=out)
            return t.copy_(out)
        if self.size > 1:
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        return t

    def all_reduce_sum_(self, t: torch.Tensor) -> torch.Tensor:
        """In place; exact for integer tensors (the A8W8 partial sums)."""
        if self.shm is not None and self.shm.fits(t):
            parts = self.shm.exchange(t)
            out = parts[0].clone()
            for p in parts[1:]:
                out += p
            return t.copy_(out)
        if self.size > 1:
            dist.all_reduce(t, op=dist.ReduceOp.SUM, group=self.group)
        return t

    def all_gather(self, t: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's tensor of the same shape, in rank order."""
        if self.size == 1:
            return [t]
        if self.shm is not None and self.shm.fits(t):
            return [p.clone() for p in self.shm.exchange(t)]
        parts = [torch.empty_like(t) for _ in range(self.size)]
        dist.all_gather(parts, t.contiguous(), group=self.group)
        return parts

    def gather_to_0(self, t: torch.Tensor) -> list[torch.Tensor] | None:
        """Every rank's tensor of the same shape, in rank order, on rank 0; None on the others."""
        if self.size == 1:
            return [t]
        t = t.contiguous()
        if self.shm is not None and self.shm.fits(t):
            parts = self.shm.exchange(t)
            return [p.clone() for p in parts] if self.rank == 0 else None
        parts = [torch.empty_like(t) for _ in range(self.size)] if self.rank == 0 else None
        dist.gather(t, parts, dst=0, group=self.group)
        return parts

    def sum_in_rank_order(self, t: torch.Tensor) -> torch.Tensor:
        """The ranks' tensors added in rank order (0 + 1 + ...): the same bits on every rank and for every batch
        composition, unlike a backend's all-reduce, whose order may depend on the message size."""
        parts = self.all_gather(t)
        out = parts[0].clone()
        for p in parts[1:]:
            out += p
        return out

    def cat(self, t: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """The ranks' shards concatenated along dim, in rank order."""
        return t if self.size == 1 else torch.cat(self.all_gather(t), dim=dim)

    def destroy(self) -> None:
        if self.shm is not None:
            self.shm.close()
            self.shm = None
        if self.size > 1 and dist.is_initialized():
            dist.destroy_process_group()
