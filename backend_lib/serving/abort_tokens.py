"""The abort capability of a streamed request: a random token its first response carries (return_abort_token),
which an abort request presents with the request's Triton id. The registry knows the running requests' tokens
and, for a while, the finished ones', so that a late abort is answered as valid; a token and id that match no
request get the same answer whether the id exists or not, so an abort reveals nothing about other clients'
requests."""
from __future__ import annotations

import hmac
import secrets
import threading
from collections import OrderedDict

from ..contract.errors import RequestError
from .request import AbortRequest

RECENT_TOKENS = 4096         # abort tokens of finished requests kept, so that a late abort is answered as valid


def new_token() -> str:
    return secrets.token_urlsafe(24)


class AbortTokens:
    """token -> the running request it aborts (any object with a `triton_id`), and token -> the Triton id of a
    recently finished one; thread-safe."""

    def __init__(self, recent: int = RECENT_TOKENS):
        self._lock = threading.Lock()
        self._running: dict[str, object] = {}
        self._finished: OrderedDict[str, str] = OrderedDict()
        self._recent = recent

    def register(self, token: str, state) -> None:
        with self._lock:
            self._running[token] = state

    def finish(self, token: str, triton_id: str) -> None:
        """The request of `token` has ended (all its choices): a late abort with it is answered as valid."""
        with self._lock:
            if self._running.pop(token, None) is not None:
                self._finished[token] = triton_id
                if len(self._finished) > self._recent:
                    self._finished.popitem(last=False)

    def match(self, abort: AbortRequest):
        """(the running request `abort` ends, None) or (None, the Triton id of the finished request it names); a
        RequestError naming abort_request_id when it matches no request."""
        with self._lock:
            state = self._running.get(abort.token)
            finished = self._finished.get(abort.token)
        if state is not None and hmac.compare_digest(state.triton_id.encode(), abort.request_id.encode()):
            return state, None
        if finished is None or not hmac.compare_digest(finished.encode(), abort.request_id.encode()):
            raise RequestError("abort_request_id: no running request matches this abort_request_id and abort_token "
                               "(an abort needs the abort_token of the request's first response: "
                               "return_abort_token)")
        return None, finished
