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
SPIN_S = 50e-6        # spin this long before yielding the core at each check
IDLE_S = 2e-3         # an idle wait (the next step's message) sleeps between checks past this
IDLE_SLEEP_S = 2e-4


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
        self._others = [j for j in range(size) if j != rank]
        self.alive = None     # a callable that raises when a peer process is known to be gone

    def _wait(self, at_least: int, idle: bool = False, ranks=None) -> None:
        """Until every other rank (or those of `ranks`) has published at_least. The policy: spin (a partner on its own core answers
        within microseconds), then yield the core at every check (SPIN_S on: a partner the OS descheduled gets
        to run), and, idle (a worker waiting for rank 0's next step, for as long as the server idles), sleep
        between checks past IDLE_S, with no deadline. A model collective fails past timeout_s, or at once when
        `alive` (rank 0's supervisor check) raises because a peer process is gone."""
        c = self._counters
        others = self._others if ranks is None else ranks
        if all(c[j, 0] >= at_least for j in others):
            return
        spins = 0
        waited, last = 0.0, time.monotonic()
        while True:
            if all(c[j, 0] >= at_least for j in others):
                return
            spins += 1
            if spins & 63 == 0:
                now = time.monotonic()
                waited += min(now - last, 0.1)   # a gap (this process stopped or descheduled) is not the peer's
                last = now
                if waited > SPIN_S:
                    if idle and waited > IDLE_S:
                        time.sleep(IDLE_SLEEP_S)
                    else:
                        os.sched_yield()
                if spins & 4095 == 0 and not idle:
                    if self.alive is not None:
                        self.alive()
                    if waited > self.timeout_s:
                        raise RuntimeError(f"shared-memory collective: a rank did not reach step {at_least} within "
                                           f"{self.timeout_s:.0f} s")

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

    def broadcast(self, data: torch.Tensor | None, idle: bool = False) -> torch.Tensor:
        """Rank 0's bytes (a uint8 tensor, at most slot_bytes; None on the other ranks) to every rank: its slot of
        this step's buffer (valid until this rank's next call). Rank 0 does not wait for the readers (the next
        call's buffer wait orders them); the others wait for rank 0, idle: as long as it takes."""
        s = self.step = self.step + 1
        buf = s % 2
        if self.rank == 0:
            self._wait(s - 1)
            self._slots[buf, 0, :data.numel()].copy_(data)
            self._counters[0, 0] = s
            return self._slots[buf, 0]
        self._counters[self.rank, 0] = s      # done with the buffers before this one (callers copy out)
        self._wait(s, idle, (0,))
        return self._slots[buf, 0]

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
