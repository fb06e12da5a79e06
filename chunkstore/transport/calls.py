"""How the client's calls reach the daemon: gRPC, and the hot control calls (Lookup, Acquire,
Release, Reserve, Commit) over the daemon's fast path where it offers one on this host
(``protocol/fast.py``); a failed call raises the typed error its status names."""

from __future__ import annotations

import logging
import socket
from collections.abc import Callable
from typing import Any

import grpc

from chunkstore.errors import StoreError, Unavailable
from chunkstore.protocol import chunkstore_pb2 as pb
from chunkstore.protocol import chunkstore_pb2_grpc as pb_grpc
from chunkstore.protocol.fast import FastChannel
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

    def connect_fast(self, hello: pb.HelloReply) -> None:
        """The fast path the daemon that said ``hello`` offers, instead of any before."""
        if self._fast is not None:
            self._fast.close()
            self._fast = None
        path = hello.fast_socket
        if not (self._use_fast and path and hello.hostname == socket.gethostname()):
            return
        try:
            self._fast = FastChannel(path, self._token, self.timeout)
        except (OSError, StoreError) as exc:
            log.info("fast path at %s not used (%s); the control calls over gRPC", path, exc)

    @property
    def fast(self) -> bool:
        """Whether Lookup, Acquire, Release, Reserve and Commit go over the fast path now."""
        return self._fast is not None

    def call(self, method: Any, request: Any, timeout: float | None = None) -> Any:
        """``method`` (a stub's) with ``request``: its reply, or the typed error."""
        fast = self._fast
        if fast is not None:
            name = self._fast_names.get(method)
            if name is not None:
                return self._on_fast(lambda: fast.call(name, request))
            self._on_fast(fast.sync)  # what was posted is done first, as over the fast path
        try:
            return method(request, timeout=timeout or self.timeout, metadata=self.metadata)
        except grpc.RpcError as err:
            raise typed_error(err) from None

    def post(self, method: Any, request: Any) -> bool:
        """Send ``method`` (a stub's) over the fast path without waiting for its answer
        (``FastChannel.post``); False where there is no fast path (nothing was sent)."""
        fast, name = self._fast, self._fast_names.get(method)
        if fast is None or name is None:
            return False
        self._on_fast(lambda: fast.post(name, request))
        return True

    def _on_fast(self, step: Callable[[], Any]) -> Any:
        """``step`` on the fast path; a failure of the connection itself: gRPC from now on."""
        try:
            return step()
        except Unavailable as exc:
            self._fast = None
            log.warning("%s; the control calls over gRPC from now on", exc)
            raise

    def close(self) -> None:
        if self._fast is not None:
            self._fast.close()
        self.channel.close()
