"""Incremental detokenization: text deltas that never split a UTF-8 character or drop a space.

For byte-level BPE vocabularies (Qwen) every token maps to raw bytes; the deltas are the output of
an incremental UTF-8 decoder over the concatenated bytes, which holds back an incomplete character
until its last byte arrives. The concatenated deltas therefore equal decoding all ids at once.
"""
from __future__ import annotations

import codecs


class IncrementalDetokenizer:
    def __init__(self, token_bytes: list[bytes], skip_special: list[bool] | None, skip_special_tokens: bool = True):
        self._token_bytes = token_bytes
        self._special = skip_special if skip_special_tokens else None
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def _bytes(self, token_id: int) -> bytes:
        if 0 <= token_id < len(self._token_bytes):
            if self._special is not None and self._special[token_id]:
                return b""
            return self._token_bytes[token_id]
        return b""

    def add(self, token_id: int) -> str:
        """The text that became complete with this token (may be empty)."""
        return self._decoder.decode(self._bytes(token_id))

    def flush(self) -> str:
        """At the end of the stream: whatever is left (an incomplete character becomes U+FFFD)."""
        return self._decoder.decode(b"", final=True)
