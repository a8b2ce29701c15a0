"""n-gram prompt lookup (vLLM's `ngram` method): drafts copied from the sequence's own context.

The proposer looks for the longest suffix of the sequence (prompt + output so far), of
prompt_lookup_max down to prompt_lookup_min tokens, that occurred earlier in it, and proposes the tokens
that followed its latest earlier occurrence. The copy runs on through the tokens it proposes itself, so a
loop of period p shorter than k still yields k drafts (the loop continued). Pure Python, incremental: an
index from each n-gram to the end of its latest occurrence grows with the sequence (committed tokens
only never change, so the index stays valid through preemption), so a proposal costs a few dict
look-ups whatever the length.
"""
from __future__ import annotations


class NgramIndex:
    """The latest end (exclusive) of every n-gram of sizes lo..hi in a token list, filled incrementally."""

    __slots__ = ("lo", "hi", "ends", "indexed")

    def __init__(self, lo: int, hi: int):
        self.lo, self.hi = lo, hi
        self.ends: dict[tuple[int, ...], int] = {}
        self.indexed = 0          # every n-gram ending at or before this position is in `ends`

    def extend(self, tokens: list[int], upto: int) -> None:
        """Indexes the n-grams ending at positions indexed+1 .. upto (exclusive end)."""
        ends, lo, hi = self.ends, self.lo, self.hi
        for e in range(self.indexed + 1, upto + 1):
            for n in range(lo, min(hi, e) + 1):
                ends[tuple(tokens[e - n:e])] = e
        self.indexed = max(self.indexed, upto)


class NgramProposer:
    def __init__(self, k: int, lookup_min: int, lookup_max: int):
        if not 1 <= lookup_min <= lookup_max:
            raise ValueError(f"prompt_lookup_min ({lookup_min}) must be in [1, prompt_lookup_max ({lookup_max})]")
        self.k, self.lo, self.hi = k, lookup_min, lookup_max

    def new_index(self) -> NgramIndex:
        return NgramIndex(self.lo, self.hi)

    def propose(self, tokens: list[int], index: NgramIndex, k: int | None = None) -> list[int]:
        """Up to k (default: num_speculative_tokens) drafts to follow `tokens`, [] when no suffix of
        lookup_min..lookup_max tokens occurred before."""
        k = self.k if k is None else k
        L = len(tokens)
        if k <= 0 or L < self.lo + 1:
            return []
        index.extend(tokens, L - 1)      # occurrences ending before the suffix's own end
        for n in range(min(self.hi, L - 1), self.lo - 1, -1):
            end = index.ends.get(tuple(tokens[L - n:]))
            if end is None:
                continue
            out: list[int] = []
            for i in range(k):            # the copy continues through its own drafts (end + i < L + i)
                p = end + i
                out.append(tokens[p] if p < L else out[p - L])
            return out
        return []


def propose_ngram(tokens: list[int], k: int, lookup_min: int, lookup_max: int) -> list[int]:
    """One-shot form of NgramProposer.propose (tests, tools)."""
    prop = NgramProposer(k, lookup_min, lookup_max)
    return prop.propose(tokens, prop.new_index())


class NgramMethod:
    """The n-gram proposer behind spec.decoder's Proposer interface: its state is the sequence's NgramIndex
    (committed tokens only, so nothing to roll back or free)."""

    def __init__(self, k: int, lookup_min: int, lookup_max: int):
        self.ngram = NgramProposer(k, lookup_min, lookup_max)

    def new_state(self, seq) -> NgramIndex:
        return self.ngram.new_index()

    def propose(self, rows) -> list[list[int]]:
        return [self.ngram.propose(r.seq.tokens, r.state, r.room) for r in rows]

    def commit(self, seq, state, accepted: int) -> None:
        pass

    def free(self, seq, state) -> None:
        pass
