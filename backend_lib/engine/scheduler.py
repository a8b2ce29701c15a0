"""Continuous batching: which sequences run in the next step and how many tokens each computes.

Each step first gives every running decode its one token, then continues chunked prefills, then
admits waiting requests, all within a token budget, so a long prompt never stalls the decoding of
others. A request for prompt_logprobs (scoring) computes at most max_scoring_tokens_per_step of its prompt rows
a step (shared by every scoring sequence, as each of its rows costs the full vocabulary's logits), and a waiting
scoring request that finds that share spent lets the requests behind it be admitted: however big a scoring
request, the others keep the rest of every step. With prefix caching, an admitted request first takes the cached pages that hold the longest
run of its full pages (at least its last token is computed, for its logits), and every page that
becomes full is recorded in the cache; a request whose next full page a running prefill is computing
waits for it (one prefill for n choices or concurrent requests of one prompt). A prompt's partial last
page is recorded too: a request with that whole prompt gets a copy of it (`page_copies`, handed to the
runner in the step's plan and done before its forward; the source stays pinned until `update`) and computes its
last token only, so n choices cost one prefill. When the page pool runs
dry the newest running sequence (with scheduling_policy priority: the lowest-priority one) is preempted
(its pages freed, recomputed later from its prompt and the tokens it already produced); nothing is ever
dropped.

The engine's step is `plan = next_step()`, `result = runner.execute(plan)`, `update(plan, result)`: the scheduler
owns the plan's page copies and pins, and after the step advances the sequences and records the pages that became
full in the prefix cache.
"""
from __future__ import annotations

from collections import deque

from contextlib import contextmanager

from ..kv_cache.block_manager import BlockManager
from ..spec.decoder import SpecDecoder
from .step import StepPlan
from .sequence import Sequence, SequenceStatus


PRIORITY_AGING = 64     # later arrivals that make up one priority unit (scheduling_policy priority)
PRIORITY_SPAN = 1000    # priorities beyond +-PRIORITY_SPAN age as +-PRIORITY_SPAN (they still order among equals)


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 policy: str = "fcfs", max_scoring_tokens: int | None = None):
        self.bm = block_manager
        self.priority = policy == "priority"
        self._arrivals = 0
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        # prompt rows scored per step over all sequences (EngineConfig.max_scoring_tokens_per_step)
        self.max_scoring_tokens = min(max_scoring_tokens or max_num_batched_tokens, max_num_batched_tokens)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.prefix_queries = 0    # tokens of admitted requests looked up in the prefix cache
        self.prefix_hits = 0       # of those, tokens found cached
        self.page_copies: list[tuple[int, int]] = []   # (cached partial page, new page) to copy before this step
        self.on_preempt = None     # [spec] called with a preempted sequence (its proposer's pages go back too)

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        seq.arrival = self._arrivals
        self._arrivals += 1
        self._enqueue(seq)

    @staticmethod
    def _rank(seq: Sequence) -> tuple[int, int, int]:
        """Priority order with aging: lower `priority` first, then earlier arrival, and every PRIORITY_AGING later
        arrivals weigh one priority unit: a waiting request is overtaken by at most PRIORITY_AGING x (its priority
        minus theirs) later arrivals, so a flood of higher-priority requests delays it, never starves it (priorities are
        clamped to +-PRIORITY_SPAN for the aging, so that bound holds for any value a client sends). A static key:
        the age of every waiting request grows alike, so the order of those already waiting never changes."""
        p = seq.params.priority
        return (max(-PRIORITY_SPAN, min(PRIORITY_SPAN, p)) * PRIORITY_AGING + seq.arrival, p, seq.arrival)

    def _enqueue(self, seq: Sequence, front: bool = False) -> None:
        if not self.priority:
            self.waiting.appendleft(seq) if front else self.waiting.append(seq)
            return
        key = self._rank(seq)
        i = next((i for i, s in enumerate(self.waiting) if self._rank(s) > key), len(self.waiting))
        self.waiting.insert(i, seq)

    def _victim(self) -> Sequence:
        """The running sequence to preempt: the newest (fcfs), or the lowest priority, newest among equals."""
        return max(self.running, key=self._rank) if self.priority else self.running[-1]

    def remove(self, seq: Sequence) -> None:
        """Takes a sequence out (finished or aborted) and frees its pages at once."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self._drop_copies(seq)
        self.bm.free(seq.block_table)
        seq.status = SequenceStatus.FINISHED

    def _drop_copies(self, seq: Sequence) -> None:
        """Cancels the pending copies into seq's pages (seq leaves before the step that would copy)."""
        mine = set(seq.block_table)
        for src, dst in [c for c in self.page_copies if c[1] in mine]:
            self.page_copies.remove((src, dst))
            self.bm.unpin(src)

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self._drop_copies(seq)
        self.bm.free(seq.block_table)
        if self.on_preempt is not None:
            self.on_preempt(seq)
        seq.reset_for_recompute()
        self._enqueue(seq, front=True)
        self.num_preemptions += 1

    def schedule(self) -> list[tuple[Sequence, int]]:
        budget = self.max_num_batched_tokens
        scoring = self.max_scoring_tokens   # what is left of this step's share of scored prompt rows
        plan: dict[Sequence, int] = {}
        preempted = False

        def give_back(victim: Sequence) -> None:
            nonlocal budget, scoring
            if victim in plan:
                n = plan.pop(victim)
                budget += n
                if victim.scoring:
                    scoring += n

        def grant(seq: Sequence, n: int) -> int:
            return min(n, scoring) if seq.scoring else n

        decodes = [s for s in self.running if s.num_pending == 1]
        prefills = [s for s in self.running if s.num_pending > 1]
        for i, seq in enumerate(decodes + prefills):
            if seq.status is not SequenceStatus.RUNNING or budget <= 0:
                continue
            n = grant(seq, min(seq.num_pending, budget))
            if n <= 0:   # a scoring prefill whose share of this step is spent: it goes on next step
                continue
            if seq.spec_tokens:   # [spec] a decode's drafts ride along where budget and pages spare them
                later = max(0, len(decodes) - 1 - i)
                n += SpecDecoder.grant(seq, n, budget - n - later, self.bm, later)
            while not self.bm.can_grow(seq.block_table, seq.num_computed + n):
                victim = self._victim()
                give_back(victim)
                self._preempt(victim)
                preempted = True
                if victim is seq:
                    break
            if seq.status is not SequenceStatus.RUNNING:
                continue
            self.bm.grow(seq.block_table, seq.num_computed + n)
            plan[seq] = n
            budget -= n
            if seq.scoring:
                scoring -= n
        while not preempted and self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = next((s for s in self.waiting if not self._follows_a_prefill(s) and not (s.scoring and scoring <= 0)),
                       None)
            if seq is None:
                break
            cached = self._cached_prefix(seq)
            start = len(cached) * self.bm.page_size
            tail = self._cached_tail(seq, cached)
            if tail is not None:    # the partial last page too, by copy: only the last token to compute
                start = seq.num_tokens - 1
            n = grant(seq, min(seq.num_tokens - start, budget))
            need = lambda: self.bm.extra_pages(cached, start + n) + self.bm.cost_of(  # noqa: E731
                cached + ([tail] if tail is not None else []))
            while self.priority and need() > self.bm.num_free and self.running and \
                    self._rank(self._victim()) > self._rank(seq):   # a lower-priority request gives way
                victim = self._victim()
                give_back(victim)
                self._preempt(victim)
                preempted = True
                n = grant(seq, min(seq.num_tokens - start, budget))
            if need() > self.bm.num_free:
                break
            self.waiting.remove(seq)
            if self.bm.caching:
                self.prefix_queries += seq.num_tokens
                self.prefix_hits += start
                if seq.num_cached_tokens is None:   # at first admission (a preempted one recomputes)
                    seq.num_cached_tokens = start
                self.bm.acquire(cached)
                seq.block_table, seq.num_computed, seq.num_registered = cached, start, len(cached)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            if tail is not None:
                self.bm.pin(tail)   # kept from eviction until the engine has copied it
            held = len(seq.block_table)   # (seq.block_table is `cached` itself when caching)
            self.bm.grow(seq.block_table, seq.num_computed + n)
            if tail is not None:
                self.page_copies.append((tail, seq.block_table[held]))
            plan[seq] = n
            budget -= n
            if seq.scoring:
                scoring -= n
        return list(plan.items())

    def _cached_tail(self, seq: Sequence, cached: list[int]) -> int | None:
        """The cached page holding seq's partial last page (its tokens after the `cached` full pages but
        the last one), when every full page before it is cached and there is more than one token left."""
        ps = self.bm.page_size
        if not self.bm.caching or seq.num_computed or seq.params.prompt_logprobs is not None or \
                len(cached) != (seq.num_tokens - 1) // ps or seq.num_tokens - len(cached) * ps < 2:
            return None
        return self.bm.match_tail(seq.tail_page_hash(ps))

    def take_page_copies(self) -> list[tuple[int, int]]:
        """The copies this step's admissions need (source, destination); their sources stay pinned until
        `update` (the runner copies them before the step's forward)."""
        copies, self.page_copies = self.page_copies, []
        return copies

    def next_step(self) -> StepPlan:
        """The next step's plan: what each sequence computes and the page copies to do before it."""
        seqs = self.schedule()
        return StepPlan(seqs, self.take_page_copies())

    def update(self, plan: StepPlan, result) -> None:
        """After the step (result None: its forward failed): the copies' sources unpinned; the sequences
        advanced past what they computed and their newly full pages recorded in the prefix cache."""
        for src, _ in plan.page_copies:
            self.bm.unpin(src)
        if result is None:
            return
        for seq, n in plan.seqs:
            seq.num_computed += n - len(seq.spec_tokens)   # [spec] drafts count once accepted (the engine commits)
            self.cache_full_pages(seq)

    @contextmanager
    def scratch_pages(self, seq: Sequence, num_tokens: int):
        """Pages for `num_tokens` of a sequence outside the running batch (scoring), freed on exit."""
        try:
            self.bm.grow(seq.block_table, num_tokens)
            yield seq
        finally:
            self.bm.free(seq.block_table)

    def _follows_a_prefill(self, seq: Sequence) -> bool:
        """Whether seq's next uncached full page is one that a running prefill is computing now (the same
        prompt prefix, n > 1 or concurrent requests): seq then waits for it, and the prefix cache hands it
        the pages instead of a second prefill."""
        if not self.bm.caching or seq.num_computed or seq.params.prompt_logprobs is not None:
            return False
        ps = self.bm.page_size
        full = (seq.num_tokens - 1) // ps
        have = len(self._cached_prefix(seq))
        if have >= full:   # every full page cached: wait only for a running prefill of the same whole prompt
            if seq.num_tokens - have * ps < 2 or self.bm.match_tail(seq.tail_page_hash(ps)) is not None:
                return False
            want = seq.tail_page_hash(ps)
            return any(r.num_pending > 1 and not r.tail_registered and r.cache_root == seq.cache_root
                       and len(r.prompt_ids) == seq.num_tokens and r.tail_page_hash(ps, len(r.prompt_ids)) == want
                       for r in self.running)
        want = seq.full_page_hashes(full, ps)[have]
        for r in self.running:
            if r.num_pending > 1 and r.num_registered <= have and r.cache_root == seq.cache_root \
                    and (r.num_tokens - 1) // ps > have and r.full_page_hashes(have + 1, ps)[have] == want:
                return True
        return False

    def _cached_prefix(self, seq: Sequence) -> list[int]:
        """Cached pages holding the longest run of seq's full pages, leaving at least one token to compute.
        A request for prompt_logprobs takes none: its whole prompt is computed (the pages it fills are still
        recorded for others)."""
        if not self.bm.caching or seq.num_computed or seq.params.prompt_logprobs is not None:
            return []
        return self.bm.match(seq.full_page_hashes((seq.num_tokens - 1) // self.bm.page_size, self.bm.page_size))

    def cache_full_pages(self, seq: Sequence) -> None:
        """After a step: records seq's pages that are now full (all their K/V computed) in the prefix cache."""
        if not self.bm.caching:
            return
        ps = self.bm.page_size
        full = seq.num_computed // ps
        if full > seq.num_registered:
            for i, h in enumerate(seq.full_page_hashes(full, self.bm.page_size)[seq.num_registered:],
                                  seq.num_registered):
                self.bm.register(seq.block_table[i], h)
            seq.num_registered = full
        prompt = len(seq.prompt_ids)
        if not seq.tail_registered and seq.num_computed >= prompt and prompt - (prompt - 1) // ps * ps >= 2:
            seq.tail_registered = True   # the prompt's partial last page, for later requests of the same prompt
            self.bm.register_tail(seq.block_table[(prompt - 1) // ps], seq.tail_page_hash(ps, prompt))
