"""Bounded sockets: uvicorn's h11 protocol with a request-read timeout and a connection limit.

uvicorn bounds only the idle time between two requests of a keep-alive connection (timeout_keep_alive); a
client that connects and sends nothing, or trickles a request's headers or body a byte at a time (slowloris),
holds its socket for good, and its `limit_concurrency` is checked only once a request's headers have arrived.
Here every connection must deliver a whole request (headers and body) within `read_timeout_s` of its start (or of
the previous response's end), else it is closed; and a connection beyond `max_connections` open ones is answered
503 and closed at once, before it can hold a file descriptor for long.

    config = uvicorn.Config(app, http=bounded_h11(read_timeout_s=30, max_connections=1024), ...)
"""
from __future__ import annotations

import asyncio
import json
import logging
import socket
import time

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

DEFAULT_READ_TIMEOUT_S = 30.0
DEFAULT_KEEP_ALIVE_S = 5       # uvicorn's own default (idle time between two requests of one connection)
DEFAULT_MAX_CONNECTIONS = 1024
# what one connection may hold unsent: the kernel's send buffer (SO_SNDBUF; Linux doubles it) and the transport's
# write buffer before it pauses the response (uvicorn's flow control); a stream whose client stops reading then
# blocks at its next chunk, and its Triton stream ends at gateway.MAX_UNREAD responses unread
DEFAULT_SEND_BUFFER = 64 * 1024
LOG_PERIOD_S = 60.0
log = logging.getLogger("openai_frontend")

_BODY = json.dumps({"error": {"message": "too many connections to the server; retry later",
                              "type": "server_error", "param": None, "code": "too_many_connections"}}).encode()
TOO_MANY = (b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\nconnection: close\r\n"
            b"retry-after: 1\r\ncontent-length: " + str(len(_BODY)).encode() + b"\r\n\r\n" + _BODY)


class BoundedH11Protocol(H11Protocol):
    read_timeout_s: float = DEFAULT_READ_TIMEOUT_S
    max_connections: int = DEFAULT_MAX_CONNECTIONS
    send_buffer: int = DEFAULT_SEND_BUFFER

    def connection_made(self, transport: asyncio.Transport) -> None:   # type: ignore[override]
        super().connection_made(transport)
        self._read_timer: asyncio.TimerHandle | None = None
        if len(self.connections) > self.max_connections:
            self._refused()
            transport.write(TOO_MANY)
            transport.close()
            return
        sock = transport.get_extra_info("socket")
        if sock is not None:
            try:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, self.send_buffer)
            except OSError:
                pass
        transport.set_write_buffer_limits(high=self.send_buffer)
        self._arm_read_timer()

    @classmethod
    def _refused(cls) -> None:
        """Counts a refused connection; one log line a minute at most (a flood must not flood the log too)."""
        cls.refused = getattr(cls, "refused", 0) + 1
        now = time.monotonic()
        if now - getattr(cls, "_logged_at", -LOG_PERIOD_S) >= LOG_PERIOD_S:
            cls._logged_at = now
            log.warning("connection refused: --max-connections %d are open (%d refused so far)",
                        cls.max_connections, cls.refused)

    def _arm_read_timer(self) -> None:
        self._cancel_read_timer()
        self._read_timer = self.loop.call_later(self.read_timeout_s, self._read_timed_out)

    def _cancel_read_timer(self) -> None:
        timer = getattr(self, "_read_timer", None)
        if timer is not None:
            timer.cancel()
            self._read_timer = None

    def _read_timed_out(self) -> None:
        self._read_timer = None
        if not self.transport.is_closing() and self.conn.their_state is not h11.DONE:
            self.transport.close()   # no whole request within read_timeout_s: a silent or trickling client

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.conn.their_state is h11.DONE:   # the whole request is in: the time to answer is not bounded here
            self._cancel_read_timer()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():
            self._arm_read_timer()   # the next request on this connection gets read_timeout_s as well

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_read_timer()
        super().connection_lost(exc)


def bounded_h11(read_timeout_s: float = DEFAULT_READ_TIMEOUT_S, max_connections: int = DEFAULT_MAX_CONNECTIONS,
                send_buffer: int = DEFAULT_SEND_BUFFER) -> type[BoundedH11Protocol]:
    """The protocol class for uvicorn.Config(http=...), with these bounds."""
    if read_timeout_s <= 0 or max_connections < 1 or send_buffer < 4096:
        raise ValueError("the read timeout must be > 0, max_connections >= 1 and the send buffer >= 4096 bytes")
    return type("BoundedH11", (BoundedH11Protocol,), {"read_timeout_s": float(read_timeout_s),
                                                      "max_connections": int(max_connections),
                                                      "send_buffer": int(send_buffer)})
