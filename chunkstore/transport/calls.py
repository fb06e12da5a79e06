"""How the client's calls reach the daemon: gRPC, and the hot control calls (Lookup, Acquire,
Release, Reserve, Commit) over the daemon's fast path where it offers one on this host
(``protocol/fast.py``); a failed call raises the typed error its status names."""

from __future__ import annotations

import logging
import socket
from typing import Any

import grpc

from chunkstore.errors import StoreError, Unavailable
from chunkstore.protocol import chunkstore_pb2 as pb
from chunkstore.protocol import chunkstore_pb2_grpc as pb_grpc
from chunkstore.protocol.fast import FastChannel, NotSent, Posted
from chunkstore.protocol.wire import MAX_MESSAGE, typed_error

log = logging.getLogger("chunkstore.client")

FAST_METHODS = ("Lookup", "Acquire", "Release", "Reserve", "Commit")


def open_channel(
    address: str,
    root_certificates: bytes | None = None,
    client_cert_chain: bytes | None = None,
    client_key: bytes | None = None,
) -> grpc.Channel:
    """A gRPC channel to ``address``: TLS where ``root_certificates`` are given."""
    options = [
        ("grpc.max_receive_message_length", MAX_MESSAGE),
        ("grpc.max_send_message_length", MAX_MESSAGE),
    ]
    if root_certificates is None:
        return grpc.insecure_channel(address, options=options)
    credentials = grpc.ssl_channel_credentials(root_certificates, client_key, client_cert_chain)
    return grpc.secure_channel(address, credentials, options=options)


class DaemonCalls:
    """One daemon's API, as a client calls it. ``fast``: use the fast path when offered."""

    def __init__(
        self, channel: grpc.Channel, token: str | None, timeout: float, fast: bool
    ) -> None:
        self.channel = channel
        self.timeout = timeout
        self.metadata = (("authorization", f"Bearer {token}"),) if token else ()
        self.stub = pb_grpc.ChunkStoreStub(channel)
        self._token = token
        self._use_fast = fast
        self._fast: FastChannel | None = None
        self._fast_names = {getattr(self.stub, name): name for name in FAST_METHODS}
        self.posted_lost = 0  # calls sent without waiting that neither path carried

    def connect_fast(self, hello: pb.HelloReply) -> None:
        """The fast path the daemon that said ``hello`` offers, instead of any before."""
        if self._fast is not None:
            self._fast.close()
            self._fast = None
        path = hello.fast_socket
        if not (self._use_fast and path and hello.hostname == socket.gethostname()):
            return
        try:
            self._fast = FastChannel(path, self._token, self.timeout, self._resend)
        except (OSError, StoreError) as exc:
            log.info("fast path at %s not used (%s); the control calls over gRPC", path, exc)

    @property
    def fast(self) -> bool:
        """Whether Lookup, Acquire, Release, Reserve and Commit go over the fast path now."""
        return self._fast is not None

    def call(self, method: Any, request: Any, timeout: float | None = None) -> Any:
        """``method`` (a stub's) with ``request``: its reply, or the typed error. Where the
        fast path fails before the call went out on it, gRPC makes the call."""
        fast, name = self._fast, self._fast_names.get(method)
        try:
            if fast is not None and name is not None:
                return fast.call(name, request)
            if fast is not None:
                fast.sync()  # what was posted is done first, as over the fast path
        except Unavailable as exc:
            self._fast_failed(exc)
            if name is not None and not isinstance(exc, NotSent):
                raise  # the daemon may have made it: not made twice
        return self._over_grpc(method, request, timeout)

    def _over_grpc(self, method: Any, request: Any, timeout: float | None = None) -> Any:
        try:
            return method(request, timeout=timeout or self.timeout, metadata=self.metadata)
        except grpc.RpcError as err:
            raise typed_error(err) from None

    def post(self, method: Any, request: Any) -> bool:
        """Send ``method`` (a stub's) over the fast path without waiting for its answer
        (``FastChannel.post``); False where there is no fast path, or it failed (nothing
        was sent)."""
        fast, name = self._fast, self._fast_names.get(method)
        if fast is None or name is None:
            return False
        try:
            fast.post(name, request)
        except Unavailable as exc:  # not posted: the caller makes it over gRPC
            self._fast_failed(exc)
            return False
        return True

    def _fast_failed(self, exc: Unavailable) -> None:
        """A failure of the fast path's connection itself: gRPC from now on."""
        self._fast = None
        log.warning("%s; the control calls over gRPC from now on", exc)

    def _resend(self, posted: list[Posted]) -> None:
        """Make over gRPC the posted calls a failed fast path left unanswered (called by
        ``FastChannel``, holding its lock: never through it). One the daemon had already
        is refused, not made twice: a lease ends once (NotFound, logged as any posted
        call's failure). Where gRPC cannot reach the daemon either, the rest are counted in
        ``posted_lost``, not each tried for the whole timeout."""
        for done, (name, request) in enumerate(posted):
            try:
                self._over_grpc(getattr(self.stub, name), request)
            except Unavailable as err:
                self.posted_lost += len(posted) - done
                log.warning(
                    "%d calls sent without waiting were lost with the fast path: %s",
                    len(posted) - done,
                    err,
                )
                return
            except StoreError as err:
                log.warning("a %s sent without waiting failed: %s", name, err)

    def close(self) -> None:
        if self._fast is not None:
            self._fast.close()
        self.channel.close()
