"""Digit bounds for the numbers of generated JSON (json schemas, json_object, forced tool calls).

llama.cpp's JSON grammars bound every part of a number: an integral part of at most 16 digits, a fraction of
1 to 16 and an exponent of at most 16. llguidance 1.9 has no such option: its JSON compiler writes numbers with
one fixed lexeme, `-?(0|[1-9][0-9]*)(\\.[0-9]+)?([eE][+-]?[0-9]+)?` (its options are separators, whitespace,
oneOf coercion, leniency and string escapes), and a schema bound (minimum / maximum) bounds the integral part
only while it forbids exponents. So the bound is kept here, on top of the grammar's mask: a request's
`DigitRun` follows the JSON text the grammar accepted (inside a string or not, and the run of digits that
ends it), and while a number's run is MAX_DIGITS long no token that would make it longer is allowed: each part
of a number (integral, fraction, exponent) has at most MAX_DIGITS digits, as llama.cpp's. Digits inside strings
are not touched.

A schema's own bounds win: a schema that names a number of more digits (a `minimum`, `maximum`, `const`, `enum`,
`multipleOf` ...) gets no bound at all, and wherever the bound would leave no token the grammar allows (a
grammar that requires a longer number), the grammar's own mask stands.
"""
from __future__ import annotations

import re

import numpy as np

MAX_DIGITS = 16
_LONG_NUMBER = re.compile(rb"[0-9]{%d,}" % (MAX_DIGITS + 1))
_QUOTE, _BACKSLASH = 0x22, 0x5C


def schema_allows_bound(text: str) -> bool:
    """Whether a schema leaves the default bound on (it names no number of more than MAX_DIGITS digits)."""
    return _LONG_NUMBER.search(text.encode()) is None


class DigitTable:
    """Per vocabulary: each token's bytes, and for each run length r the ids whose leading digits would take a
    run of r past MAX_DIGITS."""

    def __init__(self, token_bytes: list[bytes]):
        self.token_bytes = token_bytes
        leading = np.array([len(b) - len(b.lstrip(b"0123456789")) for b in token_bytes], dtype=np.int64)
        self.over: list[np.ndarray] = [np.flatnonzero(leading > MAX_DIGITS - r) for r in range(MAX_DIGITS + 1)]


class DigitRun:
    """One request's JSON lexical state: inside a string (and after a backslash) or not, and the digits that end
    the text outside strings. Immutable: `after(token)` is the state past a token (speculative drafts roll back
    by keeping the old one)."""

    __slots__ = ("in_string", "escape", "run")

    def __init__(self, in_string: bool = False, escape: bool = False, run: int = 0):
        self.in_string, self.escape, self.run = in_string, escape, run

    def after(self, data: bytes) -> "DigitRun":
        in_string, escape, run = self.in_string, self.escape, self.run
        for ch in data:
            if in_string:
                if escape:
                    escape = False
                elif ch == _BACKSLASH:
                    escape = True
                elif ch == _QUOTE:
                    in_string = False
            elif ch == _QUOTE:
                in_string, run = True, 0
            elif 0x30 <= ch <= 0x39:
                run += 1
            else:
                run = 0
        return DigitRun(in_string, escape, run)

    def restrict(self, table: DigitTable, mask: np.ndarray) -> None:
        """In place on an int32 bitmask (bit t % 32 of word t // 32): the tokens that would make this number's
        run longer than MAX_DIGITS cleared, unless that leaves nothing the grammar allowed (then it stands)."""
        if self.in_string or self.run == 0:
            return
        ids = table.over[min(self.run, MAX_DIGITS)]
        ids = ids[ids < mask.size * 32]
        if not ids.size:
            return
        words = mask.view(np.uint32)
        bits = (np.uint32(1) << (ids & 31).astype(np.uint32))
        if not (words[ids >> 5] & bits).any():
            return      # the grammar allows none of them here
        saved = words.copy()
        np.bitwise_and.at(words, ids >> 5, ~bits)
        if not words.any():
            words[:] = saved   # the grammar requires a longer number here: it wins
