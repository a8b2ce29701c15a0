"""The n choices of one Triton request (vLLM's n): one engine request each, one response stream.

`fork` makes each choice's engine request id and sampling parameters (choice j of a seeded request is seeded by
backend_lib.contract.choices.choice_seed); a `ChoiceGroup` shares the Triton response stream among them, each
choice sending through its own `ChoiceSender`."""
from __future__ import annotations

import uuid

from ..contract.choices import choice_seed


def fork(req, name: str, make_params) -> list[tuple[str, object]]:
    """(engine request id, sampling parameters) of each of the request's n choices; `make_params(dict)` validates
    the sampling fields (a RequestError names the field)."""
    choices = []
    for j in range(req.n):
        sampling = dict(req.sampling)
        if j and sampling.get("seed") is not None:
            sampling["seed"] = choice_seed(sampling["seed"], j)
        choices.append((f"{name}-{uuid.uuid4().hex}", make_params(sampling)))
    return choices


class ChoiceGroup:
    """The choices of one request and their shared sender. The Triton final flag goes out with the last choice's
    final response, and the first error ends the stream (the other choices are aborted, their sends dropped)."""

    def __init__(self, sender, n: int, final_flag: int, abort):
        self.sender, self.final_flag, self.abort = sender, final_flag, abort
        self.open = set(range(n))
        self.closed = False
        self.states: list = []

    def is_cancelled(self) -> bool:
        return self.sender.is_cancelled()


class ChoiceSender:
    """Choice `index`'s sender: a Triton response sender's interface over the group's."""

    def __init__(self, group: ChoiceGroup, index: int):
        self.group, self.index = group, index

    def is_cancelled(self) -> bool:
        return self.group.is_cancelled()

    def send(self, response=None, flags: int = 0) -> None:
        g = self.group
        if g.closed:
            return
        if response is not None and response.has_error():
            g.closed = True
            for s in g.states:
                if s.index != self.index and not s.done:
                    g.abort(s.rid)
            g.sender.send(response, flags=g.final_flag)
            return
        if flags & g.final_flag:
            g.open.discard(self.index)
            if g.open:
                flags &= ~g.final_flag
                if response is None:
                    return
            else:
                g.closed = True
        if response is None:
            g.sender.send(flags=flags)
        else:
            g.sender.send(response, flags=flags)
