"""The fast path: the hot control calls (Lookup, Acquire, Release, Reserve, Commit) over a
plain unix socket beside the daemon's gRPC one. Python gRPC costs ~0.7 ms a call here
whatever it carries; the same messages framed on a socket cost ~0.06 ms. Same messages,
same service code, same tokens and typed errors: only the framing differs.

A frame is a little-endian u32 (the bytes after it), a u8 kind, then the payload. Requests:
kind 0 is ``Auth`` (payload: the bearer token, or nothing; the client's first frame), kind
1 + i calls ``METHODS[i]`` (payload: its request message). Replies: kind 0 is the reply
message; kind 1 + i is the error whose gRPC status is ``CODES[i]`` (payload: its message).

Until an ``Auth`` frame carries a token the daemon admits, it reads no call's payload and no
``Auth`` payload over ``MAX_TOKEN``: a peer without a token cannot make it hold more.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import struct
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

import grpc

from chunkstore.errors import Exhausted, InvalidRequest, StoreError, Unavailable
from chunkstore.protocol import chunkstore_pb2 as pb
from chunkstore.protocol.wire import MAX_MESSAGE, error_of

METHODS: dict[str, tuple[type[Any], type[Any]]] = {
    "Lookup": (pb.LookupRequest, pb.LookupReply),
    "Acquire": (pb.AcquireRequest, pb.AcquireReply),
    "Release": (pb.ReleaseRequest, pb.ReleaseReply),
    "Reserve": (pb.ReserveRequest, pb.ReserveReply),
    "Commit": (pb.CommitRequest, pb.CommitReply),
}
KINDS = {name: 1 + i for i, name in enumerate(METHODS)}
CODES = [code.name for code in grpc.StatusCode if code is not grpc.StatusCode.OK]
AUTH, OK = 0, 0
# The longest token an Auth frame may carry. Tokens are tens of bytes (a JWT ~1 KiB), and gRPC
# takes no more than 8 KiB of metadata for a whole call, so no token the daemon serves is near
# it; it is what a peer not yet admitted can make the daemon read and keep per connection.
MAX_TOKEN = 4 << 10
_HEADER = struct.Struct("<IB")
T = TypeVar("T")
Posted = tuple[str, Any]  # a call made without waiting: its method's name, its request
log = logging.getLogger("chunkstore.client")


def fast_socket_path(grpc_socket: str) -> str:
    return grpc_socket + ".fast"


def send(sock: socket.socket, kind: int, payload: bytes) -> None:
    sock.sendall(_frame(kind, payload))


def _exactly(sock: socket.socket, n: int) -> bytes | None:
    """``n`` bytes, or None if the peer closed before the first; a close after it is an
    ``EOFError`` (a frame cut short)."""
    data = bytearray()
    while len(data) < n:
        piece = sock.recv(n - len(data))
        if not piece:
            if not data:
                return None
            raise EOFError(f"the frame ended after {len(data)} of {n} bytes")
        data += piece
    return bytes(data)


def receive_header(sock: socket.socket) -> tuple[int, int] | None:
    """The next frame's kind and payload length, or None at a clean end of the connection;
    its payload is left unread, for the reader to judge the length first. A frame longer
    than ``MAX_MESSAGE`` or cut short raises (the connection is then unusable)."""
    header = _exactly(sock, _HEADER.size)
    if header is None:
        return None
    length, kind = _HEADER.unpack(header)
    if not 1 <= length <= MAX_MESSAGE + 1:
        raise InvalidRequest(f"a fast-path frame of {length} bytes (at most {MAX_MESSAGE + 1})")
    return kind, length - 1


def receive_payload(sock: socket.socket, length: int) -> bytes:
    """The ``length`` payload bytes after a header; a close before them raises ``EOFError``."""
    payload = _exactly(sock, length) if length else b""
    if payload is None:
        raise EOFError("the frame ended after its header")
    return payload


def receive(sock: socket.socket) -> tuple[int, bytes] | None:
    """The next frame, or None at a clean end of the connection (raises as
    ``receive_header`` and ``receive_payload`` do)."""
    header = receive_header(sock)
    if header is None:
        return None
    kind, length = header
    return kind, receive_payload(sock, length)


class NotSent(Unavailable):
    """The fast path failed before a call's frame was all written: the daemon never had the
    call, so it can be made over gRPC instead."""


class FastChannel:
    """A client's connection to the fast path: one call at a time (a lock), from any
    thread. Any failure of the connection itself closes it for good and raises
    ``Unavailable`` (``NotSent`` when the call did not go out); the caller then goes back to
    gRPC. The posted calls not answered by then go to ``resend`` (the daemon may never have
    had them: a release lost would pin its entries for the session's life), from the thread
    that found the failure, holding the lock: no call on this channel overtakes them.

    ``post`` makes a call without waiting for its answer: its frame goes out with the next
    call's (one wake-up of the daemon for both: a get's release rides on the next get's
    acquire), or alone ``SEND_POSTED_S`` after it if no call comes (a thread of its own).
    The daemon answers a connection's calls in order, so the answers owed are read (a
    failure logged) before the next call's, or once ``MAX_OWED`` are owed (the daemon must
    never block on a full socket)."""

    MAX_OWED = 64
    SEND_POSTED_S = 0.002
    IDLE_S = 1.0

    def __init__(
        self,
        path: str,
        token: str | None,
        timeout: float,
        resend: Callable[[list[Posted]], None] | None = None,
    ) -> None:
        auth = (token or "").encode()
        if len(auth) > MAX_TOKEN:  # the daemon would refuse it: gRPC carries it instead
            raise Unavailable(f"a token of {len(auth)} bytes (the fast path's at most {MAX_TOKEN})")
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.settimeout(timeout)
        self._lock = threading.Lock()
        self._owed: list[Posted] = []  # the calls posted whose answers are not read yet
        self._unsent: list[bytes] = []  # the frames of posted calls not sent yet
        self._posted_at = 0.0  # when the first of them was posted
        self._posted = threading.Condition(self._lock)
        self._sender: threading.Thread | None = None
        self._sender_idle = False
        self._closed = False
        self._resend = resend or _lost
        try:
            self._sock.connect(path)
            self._exchange(AUTH, auth)  # a round trip: the path is served, the token admitted
        except BaseException:
            self._sock.close()
            raise

    def call(self, name: str, request: Any) -> Any:
        _, reply_type = METHODS[name]
        payload = self._exchange(KINDS[name], _message(name, request))
        return reply_type.FromString(payload)

    def post(self, name: str, request: Any) -> None:
        """Make the call later (``FastChannel``); its answer is read later, and a failure
        only logged."""
        frame = _frame(KINDS[name], _message(name, request))
        with self._lock:
            self._refuse_if_closed()
            if len(self._owed) >= self.MAX_OWED:
                self._send_unsent()
                self._settle()
            if not self._unsent:
                self._posted_at = time.monotonic()
            if self._sender_idle:
                self._posted.notify()
            self._unsent.append(frame)
            self._owed.append((name, request))
            if self._sender is None:
                self._sender = threading.Thread(
                    target=self._send_posted, name="chunkstore-fast-post", daemon=True
                )
                self._sender.start()

    def sync(self) -> None:
        """Send what was posted and read every answer owed: all the calls made so far are
        done (before a call that does not go this way)."""
        with self._lock:
            self._refuse_if_closed()
            self._send_unsent()
            self._settle()

    def _exchange(self, kind: int, payload: bytes) -> bytes:
        with self._lock:
            self._refuse_if_closed()
            self._send_unsent(_frame(kind, payload))
            self._settle()
            return _answer(self._receive())

    def _refuse_if_closed(self) -> None:
        if self._closed:  # failed before (a posted call's send), or closed
            raise NotSent("the fast path is closed")

    def _send_unsent(self, frame: bytes = b"") -> None:
        """The posted frames, then ``frame``, in one write (holding the lock); a failure is
        ``NotSent``: the write stopped short of its end, so the daemon has no ``frame``."""
        data = b"".join([*self._unsent, frame])
        self._unsent.clear()
        if data:
            try:
                self._guarded(lambda: self._sock.sendall(data))
            except Unavailable as err:
                raise NotSent(str(err)) from None

    def _send_posted(self) -> None:
        """Send posted frames no call took within ``SEND_POSTED_S``: it looks every
        ``SEND_POSTED_S`` while posts come, and sleeps after ``IDLE_S`` without one (a
        post wakes it then). Waking it at every post cost a get more than it saved."""
        with self._lock:
            while not self._closed:
                now = time.monotonic()
                if self._unsent and now - self._posted_at >= self.SEND_POSTED_S:
                    try:
                        self._send_unsent()
                    except Unavailable:  # resent over gRPC; the next call finds it closed
                        return
                if self._unsent or now - self._posted_at < self.IDLE_S:
                    self._posted.wait(self.SEND_POSTED_S)
                else:
                    self._sender_idle = True
                    self._posted.wait()
                    self._sender_idle = False

    def _settle(self) -> None:
        """Read the answers owed to posted calls (holding the lock)."""
        while self._owed:
            frame = self._receive()
            name, _ = self._owed.pop(0)
            try:
                _answer(frame)
            except StoreError as err:
                log.warning("a %s sent without waiting failed: %s", name, err)

    def _receive(self) -> tuple[int, bytes]:
        frame = self._guarded(lambda: receive(self._sock))
        if frame is None:
            raise self._failed("the daemon closed the fast path")
        return frame

    def _guarded(self, step: Callable[[], T]) -> T:
        """``step`` on the socket; a failure of the connection closes it as ``Unavailable``."""
        try:
            return step()
        except (OSError, EOFError, StoreError) as err:
            raise self._failed(f"the fast path failed: {err}") from None

    def _failed(self, why: str) -> Unavailable:
        """Close the connection for good and hand the posted calls it did not answer to
        ``resend`` (holding the lock); the error to raise."""
        self._closed = True
        self._posted.notify()
        self._sock.close()
        unanswered, self._owed = self._owed, []
        self._unsent.clear()
        if unanswered:
            self._resend(unanswered)
        return Unavailable(why)

    def close(self) -> None:
        """Close the connection, once what was posted is sent (best effort: the session
        ends with it, and its leases with the session)."""
        with self._lock:
            if not self._closed:
                self._closed = True
                self._posted.notify()
                with contextlib.suppress(OSError):
                    self._sock.sendall(b"".join(self._unsent))
                self._unsent.clear()
            self._sock.close()


def _lost(posted: list[Posted]) -> None:
    log.warning("%d calls sent without waiting were lost with the fast path", len(posted))


def _frame(kind: int, payload: bytes) -> bytes:
    return _HEADER.pack(len(payload) + 1, kind) + payload


def _message(name: str, request: Any) -> bytes:
    message: bytes = request.SerializeToString()
    if len(message) > MAX_MESSAGE:  # refused before it is sent, as gRPC does
        raise Exhausted(
            f"RESOURCE_EXHAUSTED: a {name} of {len(message)} bytes (at most {MAX_MESSAGE})"
        )
    return message


def _answer(frame: tuple[int, bytes]) -> bytes:
    """A reply's payload, or the typed error the frame carries."""
    status, body = frame
    if status == OK:
        return body
    code = CODES[status - 1] if status <= len(CODES) else "UNKNOWN"
    raise error_of(code, body.decode(errors="replace"))
