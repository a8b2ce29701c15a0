"""Stop strings matched on the generated text, across token boundaries, with partial matches held back."""
from __future__ import annotations


class StopMatcher:
    """Feed text deltas; get back what is safe to emit now and whether a stop string was hit.

    The stop string itself is never emitted. Text that might be the start of a stop string is held
    back until the next delta proves otherwise (or the stream ends and `flush` releases it).
    """

    def __init__(self, stops: list[str]):
        self.stops = [s for s in stops if s]
        self.max_len = max((len(s) for s in self.stops), default=0)
        self.pending = ""
        self.stopped_on: str | None = None

    def feed(self, delta: str) -> str:
        if not self.stops:
            return delta
        text = self.pending + delta
        hit, hit_stop = -1, None
        for s in self.stops:
            i = text.find(s)
            if i != -1 and (hit == -1 or i < hit):
                hit, hit_stop = i, s
        if hit != -1:
            self.pending = ""
            self.stopped_on = hit_stop
            return text[:hit]
        hold = 0
        for s in self.stops:
            for n in range(min(len(s) - 1, len(text)), 0, -1):
                if text.endswith(s[:n]):
                    hold = max(hold, n)
                    break
        self.pending = text[len(text) - hold:] if hold else ""
        return text[:len(text) - hold] if hold else text

    def flush(self) -> str:
        out, self.pending = self.pending, ""
        return out
