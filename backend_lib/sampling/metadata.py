"""A step's sampling inputs, built once on the host from its rows (vLLM v1's SamplingMetadata): what the one
sampling pipeline (sampler.py) applies, op after op, to the step's logits wherever they are.

A *row* is one row of the logits: a sequence at one position. A sequence samples one position per step in plain
decoding (offset 0: its next token); speculative verification scores k + 1 positions of a sequence in one step,
offset p being the position after its first p draft tokens. Each position carries the sequence's state *at that
position*: the output so far plus the first p draft tokens (for the penalties, bad words and the min_tokens
block), the grammar's mask after those tokens, and its own draw from the sequence's generator (drawn in position
order, one float64 per sampled position, as p successive plain steps would draw them). So position p of a
multi-position row samples exactly what the plain step after accepting the first p drafts would sample.

The sequence interface (duck-typed, `engine.sequence.Sequence` has it): `params`, `prompt_ids`, `output_ids`,
`generator`, `grammar` (None or an object with `active`, `fill_mask(out)` and, for multi-position rows,
`fill_masks(draft, out)`), `min_tokens_blocked_ids`.

Isolation: a row whose inputs cannot be built (its grammar fails while its mask is filled, a parameter that
cannot be applied) carries its SampleError from here; the other rows are not touched.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..contract.errors import RequestError

# A grammar whose every allowed token the request's other rules forbid
GRAMMAR_BLOCKED = ("structured_outputs: no token is allowed here (the grammar is complete but min_tokens, "
                   "stop_token_ids, allowed_token_ids or bad_words forbid every token it allows)")
ALLOWED_BLOCKED = ("allowed_token_ids: no token is allowed here (min_tokens, bad_words or stop_token_ids forbid "
                   "every allowed token)")


@dataclass
class SampleError:
    """Sampling failed for this row's request alone."""
    message: str


@dataclass
class SamplingRow:
    """One logits row: sequence `seq` (its index in the step's sequences) at position `offset`.

    greedy: argmax instead of a draw; uniform: the row's one draw in [0, 1) (0.0 for greedy rows and rows that
    failed before their draw); top_k: 0 when off (or >= the vocabulary); mask: the row's index into
    SamplingMetadata.mask when a grammar masks it; allowed / banned / bias: allowed_token_ids, the bad words'
    tokens banned at this position, logit_bias items; seen: repetition's prompt + output ids (sorted, unique),
    counts: presence / frequency's (token, count) pairs of the output; blocked: min_tokens' blocked ids;
    logprobs: N of the top-N logprobs wanted (None: none)."""
    seq: int
    offset: int = 0
    greedy: bool = True
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    uniform: float = 0.0
    error: SampleError | None = None
    mask: int | None = None
    allowed: list[int] | None = None
    banned: list[int] | None = None
    bias: tuple[list[int], list[float]] | None = None
    repetition: float = 1.0
    seen: list[int] | None = None
    presence: float = 0.0
    frequency: float = 0.0
    counts: tuple[list[int], list[float]] | None = None
    blocked: list[int] | None = None
    logprobs: int | None = None
    token_masks: bool = False     # the request has allowed_token_ids, bad words or logit_bias

    @property
    def processed(self) -> bool:
        """Whether any op changes this row's logits before the greedy pick or the draw."""
        return bool(self.mask is not None or self.allowed or self.banned or self.bias or self.seen or self.counts
                    or self.blocked)

    @property
    def constrained(self) -> bool:
        """A grammar or a token mask may leave this row no finite logit (then it fails, naming which)."""
        return self.mask is not None or self.token_masks


@dataclass
class SamplingMetadata:
    """rows: one per logits row, in the logits' order; seq_rows[i]: the rows of sequence i (its positions in
    order); mask: int32 [M, ceil(V / 32)] grammar bitmask rows (bit t % 32 of word t // 32, 1 = allowed) that
    rows' `mask` index, or None; draw_states[i]: sequence i's generator state before this step's draws, kept
    for multi-position rows only (`rewind_draws`)."""
    rows: list[SamplingRow]
    seq_rows: list[range]
    vocab: int
    mask: torch.Tensor | None = None
    draw_states: list = field(default_factory=list)

    @classmethod
    def build(cls, seqs: list, vocab: int, drafts: list[list[int]] | None = None,
              mask_buffer=None) -> "SamplingMetadata":
        """The rows of `seqs`: one position each, or with `drafts` (a list of draft token ids per sequence)
        len(drafts[i]) + 1 positions for sequence i. `mask_buffer(n)` returns an int32 [n, W] buffer to fill
        the grammar masks into (the sampler reuses one across steps)."""
        rows: list[SamplingRow] = []
        seq_rows: list[range] = []
        states: list = []
        grammar_rows = []            # (row index, seq, draft or None)
        for i, s in enumerate(seqs):
            draft = drafts[i] if drafts is not None else None
            start = len(rows)
            if draft is None:
                rows.append(_row(i, 0, s, s.output_ids))
            else:
                states.append(s.generator.get_state())
                history = list(s.output_ids)
                for p in range(len(draft) + 1):
                    rows.append(_row(i, p, s, history))
                    if p < len(draft):
                        history.append(draft[p])
            seq_rows.append(range(start, len(rows)))
            g = s.grammar
            if g is not None and (g.active or draft):
                grammar_rows.append((i, draft))
        mask = None
        if grammar_rows:
            W = (vocab + 31) // 32
            n = sum(len(seq_rows[i]) for i, _ in grammar_rows)
            mask = mask_buffer(n) if mask_buffer is not None else torch.empty((n, W), dtype=torch.int32)
            m = 0
            for i, draft in grammar_rows:
                _fill_grammar(seqs[i].grammar, draft, mask, m, [rows[r] for r in seq_rows[i]])
                m += len(seq_rows[i])
        for i, s in enumerate(seqs):     # the draws, in position order, for the rows that sample
            for r in seq_rows[i]:
                row = rows[r]
                if not row.greedy and row.error is None:
                    row.uniform = torch.rand(1, generator=s.generator, dtype=torch.float64).item()
        return cls(rows, seq_rows, vocab, mask, states)

    def subset(self, picked: list[int]) -> "SamplingMetadata":
        """The metadata of rows `picked` alone (their draws and masks kept: nothing is drawn again)."""
        rows = [self.rows[r] for r in picked]
        return SamplingMetadata(rows, [range(k, k + 1) for k in range(len(rows))], self.vocab, self.mask)

    def rewind_draws(self, seqs: list, used: list[int]) -> None:
        """Multi-position rows: sequence i's generator as if only its first used[i] sampled positions had drawn
        (the positions past the first rejected draft give their draws back)."""
        for i, (s, state) in enumerate(zip(seqs, self.draw_states)):
            s.generator.set_state(state)
            for r in list(self.seq_rows[i])[:used[i]]:
                row = self.rows[r]
                if not row.greedy and row.error is None:
                    torch.rand(1, generator=s.generator, dtype=torch.float64)


def _plain_greedy(p, n_out: int) -> bool:
    return (p.greedy and p.repetition_penalty == 1.0 and not p.presence_penalty and not p.frequency_penalty
            and n_out >= p.min_tokens and p.logprobs is None and not p.allowed_token_ids and not p.bad_words_ids
            and not p.logit_bias)


def _row(i: int, offset: int, s, history: list[int]) -> SamplingRow:
    """Sequence s at the position after `history` (its output so far, plus the drafts before this position)."""
    p = s.params
    if _plain_greedy(p, len(history)):     # the commonest row: nothing to gather
        return SamplingRow(i, offset)
    row = SamplingRow(i, offset, greedy=p.greedy, logprobs=p.logprobs,
                      token_masks=bool(p.allowed_token_ids or p.bad_words_ids or p.logit_bias))
    if not p.greedy:
        row.temperature, row.top_k, row.top_p, row.min_p = p.temperature, p.top_k, p.top_p, p.min_p
    try:
        if p.allowed_token_ids:
            row.allowed = list(p.allowed_token_ids)
        banned = []
        for word in p.bad_words_ids:    # a bad word's last token, where its other tokens end the history
            prefix = len(word) - 1
            if prefix > len(history):
                continue
            if prefix == 0 or history[-prefix:] == word[:prefix]:
                banned.append(word[-1])
        row.banned = banned or None
        if p.logit_bias:
            row.bias = (list(p.logit_bias), list(p.logit_bias.values()))
    except Exception as exc:
        row.error = SampleError(f"logit_bias / allowed_token_ids / bad_words: applying them failed ({exc})")
        return row
    try:
        if p.repetition_penalty != 1.0:
            row.repetition = p.repetition_penalty
            row.seen = sorted(set(s.prompt_ids) | set(history)) or None
        if (p.presence_penalty or p.frequency_penalty) and history:
            counts: dict[int, int] = {}
            for t in history:
                counts[t] = counts.get(t, 0) + 1
            row.presence, row.frequency = p.presence_penalty, p.frequency_penalty
            row.counts = (list(counts), [float(c) for c in counts.values()])
        if len(history) < p.min_tokens:
            row.blocked = list(s.min_tokens_blocked_ids) or None
    except Exception as exc:
        row.error = SampleError(f"sampling: applying penalties failed ({exc})")
    return row


def _fill_grammar(grammar, draft, mask: torch.Tensor, m: int, rows: list[SamplingRow]) -> None:
    """Mask rows m.. of sequence's positions; a failing grammar fails its rows alone."""
    try:
        if draft is None:
            grammar.fill_mask(mask[m])
            active = [True]
        else:                       # the mask after each prefix of the draft (the grammar is left as it was)
            active = grammar.fill_masks(draft, mask.narrow(0, m, len(rows)))
        for k, row in enumerate(rows):
            if active[k]:
                row.mask = m + k
    except RequestError as exc:     # names the request's own field (and comes first: the grammar is the first op)
        for row in rows:
            row.error, row.mask = SampleError(str(exc)), None
    except Exception as exc:
        for row in rows:
            row.error, row.mask = SampleError(f"structured_outputs: the grammar failed ({exc})"), None
