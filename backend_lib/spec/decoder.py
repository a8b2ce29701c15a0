"""Speculative decoding whose output is the output of plain decoding, token for token.

THE PROPOSER INTERFACE (what a method implements; all calls in the engine thread)

    class Proposer(Protocol):
        def new_state(self, seq) -> object            # its per-sequence state, kept on seq.spec_state.proposer
        def propose(self, rows: list[DraftRow]) -> list[list[int]]
                                                      # rows: (seq, state, room); up to `room` drafts to follow
                                                      # seq.tokens for each row, [] for none (one call per step,
                                                      # all speculating rows together: a model batches them)
        def commit(self, seq, state, accepted: int)   # after verification: `accepted` of the drafts it proposed
                                                      # for seq were accepted; seq.tokens now holds them plus the
                                                      # target's own next token (roll back what lies past them)
        def free(self, seq, state)                    # seq finished, was aborted or preempted: give back what it
                                                      # holds (pages of a KV cache of its own); `state` stays on
                                                      # seq and is reused if seq runs again (after a preemption)

A proposer is free to ignore a hook (n-gram: its index only grows with committed tokens). What it must not
assume: that commit follows every propose (the scheduler may trim a row's drafts, to none, when the step's
budget or pages are short; a row whose request ended in the run gets no commit but a free). A proposer with
its own KV therefore compares what it fed with seq.tokens when it next proposes (or rolls back in commit and
treats a missing commit as "nothing accepted"). Drafts need not be right: verification is exact whatever they
are; a proposer that fails raises nothing into the step (it proposes [] for the rows it cannot serve).

SpecDecoder (below) owns the method-independent part: which rows draft (opt-outs, auto-disable,
the batch gate (gate.py), disable_by_batch_size, room before max_tokens / max_model_len), the acceptance walk and the commit of the
target's KV, the counters. `make_proposer(cfg, ctx)` builds the configured method's proposer from a
ProposerContext (the engine's configuration, the target's model config, device, dtype, kernels and runner).
Proposers: ngram.NgramMethod (prompt lookup); draft_model (a smaller Qwen3 with its own paged KV cache).

Why it can be exact here: the kernels are batch invariant (backend_lib/kernels/contract.py), so the logits
of a row depend on that row and its context only. Verifying k drafts is therefore just scheduling the
sequence with k + 1 new tokens (its last sampled token and the drafts) through the chunked-prefill path
and taking the logits of all k + 1 rows: row i holds the bits that the (i + 1)-th of k + 1 plain decode
steps would compute, as long as drafts 0..i-1 were the tokens those steps emitted.

The acceptance rule (`verify`) then walks the rows in order and, at row i, samples the target's token
exactly as plain decoding does at that point: the same sampler call on the same logits, with the request's
state after the tokens emitted so far (penalties, min_tokens, bad words and the grammar see them; the
seeded generator has made one draw per emitted token). Each token goes through the output processor at
once (stop ids, stop strings, max_tokens, the grammar advancing), so a request ends exactly where plain
decoding ends it, never a token later. Draft i is accepted iff it equals the sampled token; the first
mismatch emits the target's token and ends the run (no more draws: the generator advanced once per
emitted token, as in plain decoding).

Rollback: only the accepted prefix is committed (`num_computed`); the KV slots of the rejected positions
lie past it and are overwritten when those positions are computed again (attention reads a sequence's
first num_computed positions only, dense and TurboQuant caches alike), pages that hold only rejected
positions go back to the pool, and the prefix cache only ever registers pages of committed tokens.

Per-request auto-disable: over each window of drafted tokens, an acceptance below min_acceptance pauses
that request's drafts (32 output tokens, doubling each time it happens again, up to 1024), so a request
whose text does not repeat itself costs (almost) nothing; `speculative: "off"` in a request opts out.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch

from ..sampling.params import SPECULATIVE_VALUES  # noqa: F401 (the per-request field `speculative`)
from .config import SpeculativeConfig
from .gate import PLAIN, BatchGate
from .ngram import NgramMethod

PAUSE_MIN, PAUSE_MAX = 32, 1024


@dataclass
class DraftRow:
    """One speculating sequence of this step, as the proposer sees it: the sequence (its tokens are prompt +
    output so far), its proposer state, and how many drafts it may take (>= 1)."""
    seq: object
    state: object
    room: int


class Proposer(Protocol):
    """See the module docstring."""

    def new_state(self, seq) -> object: ...

    def propose(self, rows: list[DraftRow]) -> list[list[int]]: ...

    def commit(self, seq, state, accepted: int) -> None: ...

    def free(self, seq, state) -> None: ...


@dataclass
class ProposerContext:
    """What a model-based proposer is built from (the engine builds it, in the engine thread)."""
    engine_config: object = None     # backend_lib.config.EngineConfig
    model_config: object = None      # the target's checkpoint.ModelConfig (vocab_size, ...)
    device: object = None
    dtype: object = None
    kernels: object = None
    max_model_len: int = 0
    runner: object = None            # the target's ModelRunner (a method reading the target's hidden states)


def check_proposer(cfg: SpeculativeConfig, model_config, max_model_len: int) -> None:
    """What a method needs of the target, checked before the target is built (errors name the key)."""
    if cfg.method == "draft_model":
        from .draft_model import check_draft

        check_draft(cfg.model, model_config, max_model_len)
    elif cfg.method == "eagle3":
        from .eagle3 import check_head

        check_head(cfg.model, model_config)


def make_proposer(cfg: SpeculativeConfig, ctx: ProposerContext | None = None) -> Proposer:
    """The configured method's proposer (ctx: what a model-based one needs)."""
    if cfg.method == "ngram":
        return NgramMethod(cfg.num_speculative_tokens, cfg.prompt_lookup_min, cfg.prompt_lookup_max)
    if cfg.method == "draft_model":
        from .draft_model import DraftModelMethod

        return DraftModelMethod(cfg.num_speculative_tokens, cfg.model, ctx)
    if cfg.method == "eagle3":   # an EAGLE-3 head over the target's hidden states (spec/eagle3.py)
        from .eagle3 import Eagle3Method

        return Eagle3Method.build(cfg, ctx)
    raise ValueError(f"speculative_config.method: {cfg.method!r} has no proposer")


@dataclass
class SpecState:
    """One request's speculation state (on Sequence.spec_state)."""
    proposer: object               # the proposer's own per-sequence state (Proposer.new_state)
    window_drafted: int = 0
    window_accepted: int = 0
    paused_until: int = 0          # no drafts before the request has this many output tokens
    pause: int = PAUSE_MIN
    num_drafts: int = 0            # verifications with at least one draft (this request's)
    num_draft_tokens: int = 0
    num_accepted: int = 0


@dataclass
class SpecCounters:
    """Totals over the engine's life (vLLM's spec_decode metrics)."""
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)


@dataclass
class VerifyRows:
    """A verification row group of one sequence: fp32 logits [k + 1, vocab] for its last token + k drafts, or, from
    a screened greedy head (layers/greedy_head.py), the k + 1 samples plain greedy takes there (logits None)."""
    logits: torch.Tensor | None
    picks: list | None = None


class SpecDecoder:
    def __init__(self, cfg: SpeculativeConfig, max_model_len: int, proposer: Proposer | None = None):
        """proposer: built by make_proposer(cfg) when not given (the engine gives it, with its context)."""
        self.cfg = cfg
        self.max_model_len = max_model_len
        self.proposer = proposer if proposer is not None else make_proposer(cfg)
        self.counters = SpecCounters(accepted_per_pos=[0] * cfg.num_speculative_tokens)
        frm = cfg.auto_disable_from_batch
        self.gate = BatchGate(frm) if frm is not None else None
        self._arm = None   # the coming step's (decoding sequences, gate arm); None: the gate did not choose it

    # ----- before the schedule: drafts ----------------------------------------------------------------
    def state(self, seq) -> SpecState:
        if seq.spec_state is None:
            seq.spec_state = SpecState(self.proposer.new_state(seq))
        return seq.spec_state

    def propose(self, running) -> None:
        """Sets seq.spec_tokens (possibly []) for every running sequence: drafts for those that decode."""
        off = self.cfg.disable_by_batch_size is not None and len(running) >= self.cfg.disable_by_batch_size
        self._arm = None
        if self.gate is not None and not off:
            n = sum(1 for s in running if self._decodes(s))
            self._arm = (n, self.gate.choose(n))
            off = self._arm[1] == PLAIN
        rows = []
        for seq in running:
            seq.spec_tokens = []
            if off or not self._decodes(seq) or seq.params.speculative == "off":
                continue
            st = self.state(seq)
            n_out = len(seq.output_ids)
            if n_out < st.paused_until:
                continue
            # never more positions than plain decoding would compute: k + 1 tokens emitted at most
            room = min(self.cfg.num_speculative_tokens, seq.max_tokens - n_out - 1,
                       self.max_model_len - seq.num_tokens - 1)
            if room > 0:
                rows.append(DraftRow(seq, st.proposer, room))
        if rows:
            for row, drafts in zip(rows, self.proposer.propose(rows)):
                row.seq.spec_tokens = list(drafts[:row.room])

    @staticmethod
    def _decodes(seq) -> bool:
        """A sequence whose next step is one decode row (the rows that may draft, and that the gate counts)."""
        return seq.num_pending == 1 and seq.failure is None

    def step_done(self, decode_only: bool, tokens: int, seconds: float) -> None:
        """After a step: its emitted tokens and wall time, to the batch gate if it chose this step's arm (only a
        step without a prefill chunk measures decoding)."""
        if self._arm is not None and decode_only:
            self.gate.record(self._arm[0], self._arm[1], tokens, seconds)

    @staticmethod
    def grant(seq, n: int, spare_tokens: int, bm, reserve_pages: int) -> int:
        """In the scheduler, for a decode planned with n tokens: how many of its drafts ride along (trimmed in
        place) within the step's spare token budget and the free pages beyond `reserve_pages` (what the
        decodes still to be planned may need): drafts never cost another request its step or its pages."""
        k = max(0, min(len(seq.spec_tokens), spare_tokens))
        while k and bm.extra_pages(seq.block_table, seq.num_computed + n + k) > bm.num_free - reserve_pages:
            k -= 1
        del seq.spec_tokens[k:]
        return k

    # ----- in the runner: the step's logits rows ----------------------------------------------------------
    @staticmethod
    def row_groups(seqs: list):
        """(first row, rows, seq) of each sampled sequence in step order: one row, or a verifying one's k + 1
        consecutive rows (seqs holds the sequence once per row)."""
        i = 0
        while i < len(seqs):
            s = seqs[i]
            m = len(s.spec_tokens) + 1 if s.spec_tokens else 1
            yield i, m, s
            i += m

    @staticmethod
    def split_rows(logits: torch.Tensor, seqs: list):
        """The plain rows (logits, seqs) for the sampler, and [(seq, VerifyRows)] for the verification."""
        if not any(s.spec_tokens for s in seqs):
            return logits, seqs, []
        keep, plain, verify = [], [], []
        for i, m, s in SpecDecoder.row_groups(seqs):
            if s.spec_tokens:
                verify.append((s, VerifyRows(logits[i:i + m])))
            else:
                keep.append(i)
                plain.append(s)
        return logits[keep], plain, verify

    @staticmethod
    def split_picks(picks: list, seqs: list):
        """split_rows for a step whose rows a screened greedy head has picked (a Sample per row): [(seq, Sample)] of
        the plain rows and [(seq, VerifyRows(None, its k + 1 samples))]."""
        plain, verify = [], []
        for i, m, s in SpecDecoder.row_groups(seqs):
            if s.spec_tokens:
                verify.append((s, VerifyRows(None, picks[i:i + m])))
            else:
                plain.append((s, picks[i]))
        return plain, verify

    # ----- after the forward: acceptance ------------------------------------------------------------------
    def verify(self, seq, rows: VerifyRows, sample, process) -> tuple[list, int]:
        """Walks the k + 1 rows: sample(logits [1, V], seq) -> Sample | SampleError as plain decoding samples
        that row; process(seq, sample) -> RequestOutput emits it (appending, stop checks; it finishes the
        request on an error). Returns the outputs (one per emitted token, in order) and the accepted drafts."""
        drafts = list(seq.spec_tokens)
        k = len(drafts)
        logits = rows.logits
        outputs, accepted = [], 0
        for i in range(k + 1):
            # picked rows: a plain-greedy sequence stays one at every position (its min_tokens only passes)
            s = sample(logits[i:i + 1], seq) if rows.picks is None else rows.picks[i]
            out = process(seq, s)
            outputs.append(out)
            if out.finished or i == k or s.token_id != drafts[i]:
                break
            accepted += 1
        self._count(seq, k, accepted)
        return outputs, accepted

    def commit(self, seq, accepted: int, bm) -> None:
        """The accepted drafts' KV become the sequence's (the engine has counted its last token already);
        pages holding only rejected positions go back to the pool; the proposer rolls back its own."""
        self.proposer.commit(seq, self.state(seq).proposer, accepted)
        seq.num_computed += accepted
        seq.spec_tokens = []
        keep = bm.pages_for(seq.num_tokens)
        if len(seq.block_table) > keep:
            tail = seq.block_table[keep:]
            del seq.block_table[keep:]
            bm.free(tail)

    def observe(self, seq, start: int, rows: torch.Tensor) -> None:
        """[eagle3] The target's aux hidden states of seq's positions start .. start + n - 1 (this step's rows)."""
        self.proposer.observe(seq, self.state(seq).proposer, start, rows)

    def free(self, seq) -> None:
        """seq finished, was aborted or preempted: the proposer gives back what it holds for it."""
        if seq.spec_state is not None:
            self.proposer.free(seq, seq.spec_state.proposer)

    def _count(self, seq, k: int, accepted: int) -> None:
        c = self.counters
        c.num_drafts += 1
        c.num_draft_tokens += k
        c.num_accepted_tokens += accepted
        for i in range(accepted):
            c.accepted_per_pos[i] += 1
        st = self.state(seq)
        st.num_drafts += 1
        st.num_draft_tokens += k
        st.num_accepted += accepted
        st.window_drafted += k
        st.window_accepted += accepted
        if st.window_drafted >= self.cfg.acceptance_window:
            if st.window_accepted < self.cfg.min_acceptance * st.window_drafted:
                st.paused_until = len(seq.output_ids) + st.pause
                st.pause = min(PAUSE_MAX, st.pause * 2)
            else:
                st.pause = PAUSE_MIN
            st.window_drafted = st.window_accepted = 0

    def stats(self) -> dict:
        """EngineStats fields (vLLM's spec_decode counters)."""
        c = self.counters
        return {"spec_num_drafts": c.num_drafts, "spec_num_draft_tokens": c.num_draft_tokens,
                "spec_num_accepted_tokens": c.num_accepted_tokens,
                "spec_accepted_per_pos": tuple(c.accepted_per_pos),
                "spec_gated_steps": self.gate.gated_steps if self.gate is not None else 0}
