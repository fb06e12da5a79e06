"""A client's session with the daemon: opened by Hello with the transport its bytes will move
over (``factory``), held by the daemon while its heartbeat stream is open (if the process
dies, its leases and reservations go at once; if it is paused, the session waits for it),
and opened again, once, when the daemon has lost it (a restart, or a pause past the lease
TTL before the stream was attached). What the lost session held is gone with it."""

from __future__ import annotations

import logging
import queue
import socket
import threading
from collections.abc import Callable, Iterator
from typing import Any

import grpc

from chunkstore.errors import SessionLost, StoreError
from chunkstore.protocol import chunkstore_pb2 as pb
from chunkstore.transport.base import Settings, Transport
from chunkstore.transport.factory import open_transport

log = logging.getLogger("chunkstore.client")


class Session:
    """Open before the constructor returns, and attached: until the daemon has the heartbeat
    stream an idle session can expire, so a process paused (or slow) right after would find
    it gone when it resumes."""

    def __init__(self, address: str, name: str, settings: Settings) -> None:
        self.address, self.name, self.settings = address, name, settings
        self.calls = calls = settings.calls
        self.reopened = 0  # sessions lost (daemon restart, pause past the TTL)
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._open(None)
        self._pings: queue.Queue[pb.Ping | None] = queue.Queue()
        self._attached = threading.Event()  # the first heartbeat stream answered (or failed)
        self._heartbeat = threading.Thread(
            target=self._beat, name="chunkstore-heartbeat", daemon=True
        )
        self._heartbeat.start()
        self._attached.wait(calls.timeout)

    def _open(self, previous: Transport | None) -> None:
        """Hello: a new session, and its transport (``previous``: the lost session's; a
        restarted daemon has a new pool), and the fast path the daemon offers now."""
        hello = self.calls.call(
            self.calls.stub.Hello,
            pb.HelloRequest(client_name=self.name, hostname=socket.gethostname()),
        )
        self.transport = open_transport(hello, self.settings, previous)
        self.hello = hello
        self.calls.connect_fast(hello)
        self.id = hello.session_id

    def reopen(self, lost: str) -> None:
        """The daemon no longer knows session ``lost``: open a new one (once, whichever
        thread notices first)."""
        with self._lock:
            if self.id != lost or self._closed.is_set():
                return
            self._open(self.transport)
            self.reopened += 1
        log.warning(
            "chunkstore session %s at %s was lost (daemon restarted, or this process was "
            "paused past the lease TTL); reopened as %s",
            lost,
            self.address,
            self.id,
        )

    def call(
        self, method: Any, request: Callable[[str], Any], retry: bool, timeout: float = 0.0
    ) -> Any:
        """A call made under this session (``request``: its message for a session id). If
        the daemon lost the session, a new one is opened; ``retry``: the call is made again
        under it (calls that start something; one that refers to what the lost session held
        raises ``SessionLost``)."""
        session = self.id
        try:
            return self.calls.call(method, request(session), timeout or None)
        except SessionLost:
            self.reopen(session)
            if not retry:
                raise
        return self.calls.call(method, request(self.id), timeout or None)

    def _beat(self) -> None:
        """Keep the session alive; when the stream ends (the daemon restarted or dropped the
        session, which ending the stream does anyway) open a new session, until closed."""
        while not self._closed.is_set():
            session = self.id
            interval = max(0.05, self.hello.lease_ttl_ms / 3000)
            pings = self._pings_of(session, interval)
            try:
                for _ in self.calls.stub.Heartbeat(pings, metadata=self.calls.metadata):
                    self._attached.set()  # the daemon attached the stream before answering
                    if self._closed.is_set():
                        return
            except grpc.RpcError as err:
                if not self._closed.is_set():
                    log.warning("heartbeat to %s ended: %s", self.address, err)
            self._attached.set()  # never keep the constructor waiting past a failed stream
            while not self._closed.wait(interval):
                try:
                    self.reopen(session)
                    break
                except StoreError:
                    continue  # the daemon is not back yet

    def _pings_of(self, session: str, interval: float) -> Iterator[pb.Ping]:
        holds_pool = self.transport.device_pool is not None
        yield pb.Ping(session_id=session, holds_pool=holds_pool)
        while True:
            try:
                item = self._pings.get(timeout=interval)
            except queue.Empty:
                item = pb.Ping(session_id=session)
            if item is None:
                return
            yield item

    @property
    def closed(self) -> bool:
        return self._closed.is_set()

    def close(self) -> None:
        """End the session: the daemon releases whatever it still holds."""
        self._closed.set()
        self.transport.close()  # a device pool's import ends before the daemon sees it end
        self._pings.put(None)
        self._heartbeat.join(timeout=2)
