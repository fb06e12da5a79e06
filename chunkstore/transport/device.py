"""The device-IPC transport: the daemon's device pool (CUDA, Ascend, or the fake device of a
CPU-only host), opened in this process through its IPC handle (same node), entries copied
between its blocks and the caller's tensors by the device, checked with ``TensorDigest``."""

from __future__ import annotations

import logging

import torch

from chunkstore.device.device_ipc import (
    TensorDigest,
    close_pool,
    gather_runs,
    gather_tensor,
    open_pool,
    scatter_tensors,
    synchronize_pool,
    tensor_bytes,
)
from chunkstore.device.device_runtime import IpcHandle
from chunkstore.errors import StoreError, Unavailable
from chunkstore.protocol import chunkstore_pb2 as pb
from chunkstore.transport.base import (
    Digest,
    EntryAtATime,
    LeasedEntry,
    Outgoing,
    Settings,
    TransportName,
    Wanted,
    on_this_host,
)

log = logging.getLogger("chunkstore.client")


def _handle_of(hello: pb.HelloReply) -> IpcHandle | None:
    return IpcHandle.from_proto(hello.device_pool) if hello.HasField("device_pool") else None


class DevicePoolTransport(EntryAtATime):
    """Through the opened device pool. A process opens a pool once (``device_ipc.open_pool``):
    a session reopened on the same pool keeps this transport; a restarted daemon's new pool
    replaces it, the old import closed first."""

    name = TransportName.IPC

    def __init__(self, hello: pb.HelloReply, handle: IpcHandle, pool: torch.Tensor) -> None:
        super().__init__(hello)
        self.handle = handle
        self._pool = pool
        self.device_pool = pool  # None once closed

    @classmethod
    def open(cls, hello: pb.HelloReply, settings: Settings) -> DevicePoolTransport | None:
        handle = _handle_of(hello)
        if handle is None or not on_this_host(hello) or settings.wanted == Wanted.STREAM:
            if handle is not None and settings.wanted == Wanted.POOL:
                raise Unavailable("the daemon's device pool is on another host")
            return None
        try:
            pool = open_pool(handle)
        except (StoreError, RuntimeError, OSError) as exc:
            if settings.wanted == Wanted.POOL:
                raise Unavailable(f"cannot open the daemon's device pool: {exc}") from exc
            log.warning("device pool not opened (%s); using the gRPC stream", exc)
            return None
        return cls(hello, handle, pool)

    def keeps(self, hello: pb.HelloReply) -> bool:
        return self.device_pool is not None and _handle_of(hello) == self.handle

    def close(self) -> None:
        if self.device_pool is not None:
            close_pool(self.handle)
            self.device_pool = None

    def stage(self, tensors: list[torch.Tensor]) -> Outgoing:
        """The tensors stay where they are: the device copies and hashes them."""
        return Outgoing(tensors, [], self.digest())

    def write(self, session: str, reservation: pb.ReserveReply, outgoing: Outgoing) -> None:
        assert isinstance(outgoing.digest, TensorDigest)
        sources = [tensor_bytes(t) for t in outgoing.tensors]
        scatter_tensors(self._pool, reservation.blocks, self.block_size, sources, outgoing.digest)
        synchronize_pool(self.handle)  # landed before the commit makes it readable

    def read_entry(
        self, entry: LeasedEntry, out: torch.Tensor, digest: Digest, session: str
    ) -> None:
        assert isinstance(digest, TensorDigest)
        gather_tensor(self._pool, entry.blocks, self.block_size, out, digest)

    def read_runs(
        self, entry: LeasedEntry, starts: torch.Tensor, length: int, out: torch.Tensor, session: str
    ) -> torch.Tensor:
        weights = entry.sum_tables()
        return gather_runs(self._pool, entry.blocks, self.block_size, starts, length, out, weights)
