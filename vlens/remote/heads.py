"""A deadline on every request's head: the HTTP protocol ``vlens serve``
gives uvicorn.

uvicorn times a connection only while it sits idle between two answers
(``--timeout-keep-alive``). A connection that never sends a byte, or sends
part of a request line or of its headers and then stops, is held for good:
each costs the server a socket, and enough of them (no token is needed to
open one) would leave it none for the participants. Here every request's
head (request line and headers) must arrive within ``--body-timeout``
seconds of the connection opening, or of the request's first byte on a
connection that is reused; past that the server answers 408 and closes it.
The body that follows has the same limit of its own (``bodies.py``).
"""

from __future__ import annotations

from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

__all__ = ["HeadDeadlineProtocol", "http_protocol"]

_TIMEOUT = (b"HTTP/1.1 408 Request Timeout\r\ncontent-type: text/plain; charset=utf-8\r\n"
            b"content-length: %d\r\nconnection: close\r\n\r\n%s")


class HeadDeadlineProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with a timer from a request's first byte
    (or the connection's start) to the end of its headers. The timer uses
    the parser's own callbacks: ``on_message_begin`` (httptools calls it on
    a request's first byte) and ``on_headers_complete``."""

    head_seconds: float = 30.0
    _head_timer: Any = None

    def connection_made(self, transport: Any) -> None:
        super().connection_made(transport)
        self._arm()

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._arm()

    def on_headers_complete(self) -> None:
        self._disarm()
        super().on_headers_complete()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _arm(self) -> None:
        self._disarm()
        self._head_timer = self.loop.call_later(self.head_seconds, self._head_late)

    def _disarm(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_late(self) -> None:
        self._head_timer = None
        if self.transport.is_closing():
            return
        if self.cycle is None or self.cycle.response_complete:
            msg = f"the request's head took over {self.head_seconds:g} s to arrive".encode()
            self.transport.write(_TIMEOUT % (len(msg), msg))
        # else the late head was pipelined behind an answer still being
        # sent: a 408 now would land inside that answer, so the connection
        # is only closed (its client stopped mid-request on it)
        self.transport.close()


def http_protocol(head_seconds: float) -> type[HeadDeadlineProtocol]:
    """The protocol class for ``uvicorn.Config(http=...)`` with this
    deadline (uvicorn makes one instance a connection from the class)."""
    return type("HeadDeadline", (HeadDeadlineProtocol,), {"head_seconds": float(head_seconds)})
