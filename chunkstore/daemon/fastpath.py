"""The daemon's side of the fast path (``protocol/fast.py``): a unix socket beside the gRPC one,
a thread per connection, each frame answered by the same service method gRPC calls (so the
same index calls, metrics, typed errors), under the same token rules.

A connection that sends what is not a frame (too long, cut short, an unknown kind, a message
that does not parse) gets one error and is closed; it costs nobody else anything. So does one
that, under token rules, calls before an ``Auth`` frame with a token they admit, or sends an
``Auth`` frame over ``MAX_TOKEN``: refused from the header alone, its payload never read.
Connections beyond ``max_connections`` are closed at once: their clients use gRPC.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
from google.protobuf.message import DecodeError

from chunkstore.errors import StoreError
from chunkstore.protocol.fast import (
    AUTH,
    CODES,
    MAX_TOKEN,
    METHODS,
    OK,
    receive_header,
    receive_payload,
    send,
)

log = logging.getLogger("chunkstore.daemon.fastpath")


class _Aborted(Exception):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code, self.details = code, details


class _Refused(Exception):
    """A frame that closes its connection, after one error with ``code`` and ``details``."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code, self.details = code, details


class _Context:
    """What the service methods ask of a gRPC context, for a fast-path call."""

    def __init__(self, bearer: str | None) -> None:
        self.bearer = bearer

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return (("authorization", self.bearer),) if self.bearer else ()

    def abort(self, code: grpc.StatusCode, details: str) -> None:
        raise _Aborted(code, details)

    def peer(self) -> str:
        return "fast-path"


class FastPath:
    """Serve ``service``'s fast methods on ``path``. ``refusal(bearer, method)``: the status
    and reason a call with that bearer ("Bearer <token>" or None) is refused with, or None."""

    def __init__(
        self,
        path: str,
        service: Any,
        refusal: Callable[[str | None, str], tuple[grpc.StatusCode, str] | None] | None,
        max_connections: int,
        group_access: bool,
    ) -> None:
        self.path = path
        self.service = service
        self.refusal = refusal
        self.max_connections = max_connections
        Path(path).unlink(missing_ok=True)
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        previous = os.umask(0o007 if group_access else 0o077)
        try:
            self._listener.bind(path)
        finally:
            os.umask(previous)
        self._listener.listen(64)
        self._lock = threading.Lock()
        self._connections: set[socket.socket] = set()
        self._stopping = False
        self._accepting = threading.Thread(target=self._accept, name="fast-accept", daemon=True)
        self._accepting.start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return  # closed: stopping
            with self._lock:
                if self._stopping or len(self._connections) >= self.max_connections:
                    conn.close()
                    continue
                self._connections.add(conn)
            threading.Thread(
                target=self._serve, args=(conn,), name="fast-conn", daemon=True
            ).start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            self._converse(conn)
        except _Refused as refused:
            self._refuse(conn, refused.code, refused.details)
        except OSError:
            return  # the client went away mid-frame: nothing was started for it
        finally:
            with self._lock:
                self._connections.discard(conn)
            conn.close()

    def _converse(self, conn: socket.socket) -> None:
        """Answer ``conn``'s frames until it closes; ``_Refused`` ends it at a bad frame."""
        bearer: str | None = None
        admitted = self._refusal_of(bearer) is None
        while True:
            header = self._header(conn, admitted)
            if header is None:
                return
            kind, length = header
            try:
                payload = receive_payload(conn, length)
            except EOFError as err:
                raise _Refused(grpc.StatusCode.INVALID_ARGUMENT, str(err)) from None
            if kind == AUTH:
                bearer = "Bearer " + payload.decode(errors="replace") if payload else None
                refused = self._refusal_of(bearer)
                if refused is not None:  # a token that opens nothing here: its client uses gRPC
                    raise _Refused(*refused)
                admitted = True
                send(conn, OK, b"")
            else:
                self._call(conn, list(METHODS)[kind - 1], payload, bearer)

    def _header(self, conn: socket.socket, admitted: bool) -> tuple[int, int] | None:
        """The next frame's kind and payload length, checked before its payload is read: a
        client not yet admitted must not make the daemon read (and keep) more than a token."""
        try:
            header = receive_header(conn)
        except (StoreError, EOFError) as err:
            raise _Refused(grpc.StatusCode.INVALID_ARGUMENT, str(err)) from None
        if header is None:
            return None
        kind, length = header
        if kind == AUTH:
            if length > MAX_TOKEN:
                raise _Refused(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"an Auth frame of {length} bytes: a token is at most {MAX_TOKEN}",
                )
        elif not 1 <= kind <= len(METHODS):
            raise _Refused(grpc.StatusCode.INVALID_ARGUMENT, f"no method {kind}")
        elif not admitted:
            raise _Refused(
                grpc.StatusCode.UNAUTHENTICATED,
                "missing or wrong bearer token (a call before an Auth frame admitted it)",
            )
        return header

    def _refusal_of(self, bearer: str | None) -> tuple[grpc.StatusCode, str] | None:
        """None when ``bearer`` may make some fast call (each call is still checked by
        itself), else why it may make none."""
        if self.refusal is None:
            return None
        refusals = [self.refusal(bearer, name) for name in METHODS]
        return None if None in refusals else refusals[0]

    def _call(self, conn: socket.socket, name: str, payload: bytes, bearer: str | None) -> None:
        """Answer one call; ``_Refused`` when its payload is not its message."""
        if self.refusal is not None:
            refused = self.refusal(bearer, name)
            if refused is not None:
                self._reply_error(conn, *refused)
                return
        request_type, _ = METHODS[name]
        try:
            request = request_type.FromString(payload)
        except DecodeError as err:
            raise _Refused(grpc.StatusCode.INVALID_ARGUMENT, f"{name}: {err}") from None
        try:
            reply = getattr(self.service, name)(request, _Context(bearer))
        except _Aborted as err:
            self._reply_error(conn, err.code, err.details)
            return
        send(conn, OK, reply.SerializeToString())

    @staticmethod
    def _reply_error(conn: socket.socket, code: grpc.StatusCode, details: str) -> None:
        send(conn, 1 + CODES.index(code.name), details.encode())

    def _refuse(self, conn: socket.socket, code: grpc.StatusCode, details: str) -> None:
        with contextlib.suppress(OSError):
            self._reply_error(conn, code, details)
        log.warning("fast path: closed a connection: %s", details)

    def stop(self) -> None:
        with self._lock:
            self._stopping = True
            connections = list(self._connections)
        # Closing a socket does not wake a thread blocked in its accept() on Linux; shutting
        # it down does (accept fails with EINVAL), so the accept thread ends now, not at the
        # join's timeout.
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)
        self._listener.close()
        for conn in connections:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
        self._accepting.join(timeout=2)
        Path(self.path).unlink(missing_ok=True)
