"""The router's HTTP server: uvicorn, with what uvicorn lacks against slow clients.

uvicorn bounds an idle keep-alive connection (``timeout_keep_alive``) and, with
``limit_concurrency``, the connections it serves at once (503 past it), but not the time a
connection may take to send its request's headers: a client that sends half a request and
waits held a connection (and a slot of ``limit_concurrency``) for ever. ``http_protocol``
adds that deadline (``limits.Limits.header_timeout``).
"""

from __future__ import annotations

import asyncio
from typing import Any

from uvicorn.protocols.http.h11_impl import H11Protocol
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol


def http_protocol(header_timeout: float) -> type[Any]:
    """uvicorn's HTTP protocol (httptools where installed, as uvicorn's "auto" picks) with a
    deadline on each request's headers."""
    try:
        import httptools  # noqa: F401

        base: type[Any] = HttpToolsProtocol
    except ImportError:
        base = H11Protocol
    return _with_header_deadline(base, header_timeout)


def _with_header_deadline(base: type[Any], header_timeout: float) -> type[Any]:
    class HeaderDeadline(base):
        """A connection that has not sent a whole request's headers ``header_timeout``
        seconds after it opened, or after its last reply, is closed."""

        _deadline: asyncio.TimerHandle | None = None

        def _arm(self) -> None:
            if self._deadline is None:
                self._deadline = self.loop.call_later(header_timeout, self._expire)

        def _disarm(self) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
                self._deadline = None

        def _expire(self) -> None:
            self._deadline = None
            if self._between_requests():
                self.transport.close()

        def _between_requests(self) -> bool:
            return self.cycle is None or bool(self.cycle.response_complete)

        def connection_made(self, transport: asyncio.Transport) -> None:
            super().connection_made(transport)
            self._arm()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self._between_requests():
                self._arm()  # a request's first bytes, its headers not whole yet
            else:
                self._disarm()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

    return HeaderDeadline
