"""Collectives through shared memory between the ranks of one host: the CPU's fast path beside gloo (whose TCP
loopback costs ~0.8 ms per small all-reduce here, bench.tp). Written here because torch.distributed has no
shared-memory backend for CPU tensors (vLLM's CPU backend writes its own in C++ for the same reason).

Each rank owns one slot per buffer (two buffers, alternated step by step) and one counter, written by that rank
only: it copies its tensor into its slot, then publishes the step number; every rank waits for all counters to
reach the step and reads every slot. Before a rank writes a buffer again (two steps later) it waits until every
rank has published the step in between, which each does only after it has read that buffer. Stores are seen in
program order on x86-64 (and the counter is written after the data), so no lock is needed. Every rank then
reduces the slots in rank order itself: MAX and integer SUM are exact, a float sum is the same bits on every rank
(TPGroup.sum_in_rank_order's order). A peer that stops publishing fails the wait after the group's timeout.
"""
from __future__ import annotations

import mmap
import os
import time

import numpy as np
import torch

LINE = 64   # one cache line per counter


class ShmExchange:
    def __init__(self, path: str, rank: int, size: int, slot_bytes: int, create: bool, timeout_s: float):
        self.rank, self.size, self.slot_bytes, self.timeout_s = rank, size, slot_bytes, timeout_s
        header = LINE * size
        total = header + 2 * size * slot_bytes
        if create:
            with open(path, "wb") as f:
                f.truncate(total)
        fd = os.open(path, os.O_RDWR)
        try:
            self._map = mmap.mmap(fd, total)
        finally:
            os.close(fd)
        self.path = path
        self._counters = np.frombuffer(self._map, dtype=np.int64, count=size * LINE // 8).reshape(size, LINE // 8)
        raw = torch.frombuffer(self._map, dtype=torch.uint8, offset=header, count=2 * size * slot_bytes)
        self._slots = raw.view(2, size, slot_bytes)
        self.step = 0

    def _wait(self, at_least: int) -> None:
        c, me = self._counters, self.rank
        others = [j for j in range(self.size) if j != me]
        spins = 0
        deadline = None
        while True:
            if all(c[j, 0] >= at_least for j in others):
                return
            spins += 1
            if spins % 4096 == 0:
                now = time.monotonic()
                deadline = deadline or now + self.timeout_s
                if now > deadline:
                    raise RuntimeError(f"shared-memory collective: a rank did not reach step {at_least} within "
                                       f"{self.timeout_s:.0f} s")
                if spins > 1 << 16:
                    time.sleep(0)   # a long wait (the peer computes): let the OS run it

    def fits(self, t: torch.Tensor) -> bool:
        return t.numel() * t.element_size() <= self.slot_bytes

    def exchange(self, t: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's tensor (same shape and dtype as t), in rank order; valid until the next exchange but one."""
        s = self.step = self.step + 1
        buf = s % 2
        self._wait(s - 1)                      # every rank is done reading this buffer (its use two steps ago)
        n = t.numel() * t.element_size()
        self._slots[buf, self.rank, :n].copy_(t.contiguous().view(-1).view(torch.uint8))
        self._counters[self.rank, 0] = s
        self._wait(s)
        return [self._slots[buf, j, :n].view(t.dtype).view(t.shape) for j in range(self.size)]

    def close(self, unlink: bool = False) -> None:
        self._counters = self._slots = None
        try:
            self._map.close()
        except BufferError:   # a view still alive: the mapping goes with the process
            pass
        if unlink:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass
