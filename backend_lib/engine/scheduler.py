"""Continuous batching: which sequences run in the next step and how many tokens each computes.

Each step first gives every running decode its one token, then continues chunked prefills, then
admits waiting requests, all within a token budget, so a long prompt never stalls the decoding of
others. When the page pool runs dry the newest running sequence is preempted (its pages freed,
recomputed later from its prompt and the tokens it already produced); nothing is ever dropped.
"""
from __future__ import annotations

from collections import deque

from ..kv_cache.block_manager import BlockManager
from .sequence import Sequence, SequenceStatus


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int):
        self.bm = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def remove(self, seq: Sequence) -> None:
        """Takes a sequence out (finished or aborted) and frees its pages at once."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.bm.free(seq.block_table)
        seq.status = SequenceStatus.FINISHED

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.bm.free(seq.block_table)
        seq.reset_for_recompute()
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def schedule(self) -> list[tuple[Sequence, int]]:
        budget = self.max_num_batched_tokens
        plan: dict[Sequence, int] = {}
        preempted = False
        decodes = [s for s in self.running if s.num_pending == 1]
        prefills = [s for s in self.running if s.num_pending > 1]
        for seq in decodes + prefills:
            if seq.status is not SequenceStatus.RUNNING or budget <= 0:
                continue
            n = min(seq.num_pending, budget)
            while not self.bm.can_grow(seq.block_table, seq.num_computed + n):
                victim = self.running[-1]
                if victim in plan:
                    budget += plan.pop(victim)
                self._preempt(victim)
                preempted = True
                if victim is seq:
                    break
            if seq.status is not SequenceStatus.RUNNING:
                continue
            self.bm.grow(seq.block_table, seq.num_computed + n)
            plan[seq] = n
            budget -= n
        while not preempted and self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            n = min(seq.num_pending, budget)
            if not self.bm.can_grow(seq.block_table, seq.num_computed + n):
                break
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            self.bm.grow(seq.block_table, seq.num_computed + n)
            plan[seq] = n
            budget -= n
        return list(plan.items())
