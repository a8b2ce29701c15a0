"""Shared helpers of the sampling tests: fake sequences and grammars, the row kinds, exact comparison."""
from __future__ import annotations

import torch

from backend_lib.contract.fields import SamplingLimits
from backend_lib.sampling import SampleError, SamplingParams

V = 300
KINDS = [dict(temperature=0), dict(temperature=0.8), dict(temperature=1.3, top_k=20), dict(top_p=0.9),
         dict(min_p=0.05), dict(top_k=50, top_p=0.8, min_p=0.01, temperature=0.7),
         dict(temperature=0.9, repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.3),
         dict(temperature=0, repetition_penalty=1.5, min_tokens=5), dict(temperature=0.6, logprobs=3),
         dict(temperature=0, logprobs=0), dict(temperature=0, presence_penalty=-2, frequency_penalty=2),
         dict(temperature=2.0, top_k=1), dict(temperature=1e4), dict(top_p=1e-9)]
# rows with the token masks too (logit_bias, allowed_token_ids, bad words: bad_words_ids set by the test)
MASK_KINDS = [dict(temperature=0.7, logit_bias={3: 5.0, 9: -100.0}), dict(temperature=0, allowed_token_ids=[1, 5, 7, 200]),
              dict(temperature=0.5, top_k=20, logprobs=5), dict(temperature=0.9, top_p=0.8, allowed_token_ids=[2, 4, 6]),
              dict(temperature=0, bad_words=["x"]), dict(temperature=1.1, top_k=20, top_p=0.7, logprobs=2)]


class FakeSeq:
    def __init__(self, params, prompt=(), output=(), seed=0, grammar=None):
        self.params, self.prompt_ids, self.output_ids = params, list(prompt), list(output)
        self.min_tokens_blocked_ids = [0, 7]
        self.generator = torch.Generator().manual_seed(seed)
        self.grammar = grammar


def bitmask(allowed, words: int) -> torch.Tensor:
    """int32 bitmask words with the bits of `allowed` set (as llguidance fills them)."""
    bits = torch.zeros(words * 32, dtype=torch.bool)
    bits[list(allowed)] = True
    w = (bits.view(-1, 32).long() << torch.arange(32)).sum(-1)
    return torch.where(w >= 2**31, w - 2**32, w).to(torch.int32)


class FakeGrammar:
    """Allows the ids in `allowed` (a bitmask row, as llguidance fills it); `fail` raises while filling."""
    active = True

    def __init__(self, allowed, fail=None):
        self.allowed, self.fail = list(allowed), fail

    def fill_mask(self, out):
        if self.fail:
            raise self.fail
        out.copy_(bitmask(self.allowed, out.numel()))


class HistoryGrammar:
    """A grammar whose mask depends on what it accepted: after tokens h, the ids t with t % 5 == len(h) % 5
    (and t < 250); accept / fill_masks as GrammarState has them (fill_masks leaves the state as it was)."""

    def __init__(self):
        self.history: list[int] = []
        self.active = True

    def allowed(self):
        return [t for t in range(250) if t % 5 == len(self.history) % 5]

    def fill_mask(self, out):
        out.copy_(bitmask(self.allowed(), out.numel()))

    def accept(self, token_id):
        self.history.append(token_id)
        return False

    def fill_masks(self, draft, out):
        before = list(self.history)
        try:
            for p in range(len(draft) + 1):
                self.fill_mask(out[p])
                if p < len(draft):
                    self.accept(draft[p])
        finally:
            self.history = before
        return [True] * (len(draft) + 1)


def P(vocab=V, **kw):
    return SamplingParams(**kw).validate(SamplingLimits(), vocab)


def seqs_for(step, kinds=KINDS, grammar=lambda i: None):
    return [FakeSeq(P(**k), prompt=[1, 2, 3, step], output=[4, 4, 5 + step], seed=100 * step + i, grammar=grammar(i))
            for i, k in enumerate(kinds)]


def assert_same(expected, got):
    """Bit for bit: the same kind of result, the same ids, logprobs, ranks and top-N, the same messages."""
    assert len(expected) == len(got)
    for e, g in zip(expected, got):
        assert type(e).__name__ == type(g).__name__, (e, g)
        if isinstance(g, SampleError):
            assert e.message == g.message
            continue
        assert (e.token_id, e.logprob, e.rank, e.top_logprobs) == (g.token_id, g.logprob, g.rank, g.top_logprobs)
