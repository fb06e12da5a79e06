"""What a put and a read need from a transport, whichever moves the bytes: the interface each
back end implements (``shared_memory``, ``device``, ``stream``), and what travels between it
and the client (the leased entry it reads, the entry it writes, the settings)."""

from __future__ import annotations

import socket
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass
from enum import StrEnum

import numpy as np
import torch

from chunkstore.device.device_ipc import TensorDigest
from chunkstore.errors import InvalidRequest
from chunkstore.protocol import chunkstore_pb2 as pb
from chunkstore.protocol.convert import LeasedEntry
from chunkstore.protocol.shm import EntryDigest, Pieces
from chunkstore.transport.calls import DaemonCalls

# The checksum the daemon's pool keeps: xxh3 stripes, or TensorDigest (a device pool).
Digest = EntryDigest | TensorDigest


class TransportName(StrEnum):
    """The transport a client moves bytes over (``ChunkStoreClient.transport``)."""

    SHM = "shm"  # the daemon's shared-memory pool, mapped here
    IPC = "ipc"  # the daemon's device pool, opened here by IPC
    STREAM = "stream"  # the gRPC Write and Read streams


class Wanted(StrEnum):
    """The transport a client asks for (``ChunkStoreClient``'s ``transport``)."""

    AUTO = "auto"  # through the pool when this host can reach it, else the stream
    POOL = "shm"  # through the pool (shared memory or a device pool), or fail
    STREAM = "stream"


@dataclass(frozen=True)
class Settings:
    """What the client asks of its transports (its ``transport``, ``copy_threads``,
    ``pin_for`` and ``populate`` arguments), and how they call the daemon."""

    wanted: Wanted
    calls: DaemonCalls
    copy_threads: int
    pin_for: str
    populate: bool


@dataclass
class Outgoing:
    """An entry on its way into the pool, made before its reservation: the caller's tensors,
    their bytes on the host where the transport copies from there, and the digest fed."""

    tensors: list[torch.Tensor]
    parts: list[np.ndarray]
    digest: Digest


@dataclass
class Reads:
    """One ``ChunkStoreClient.read_each``: leased entries, where each goes (a uint8 tensor of
    its length, or its ``Pieces``), the session that holds the leases, and how to copy."""

    entries: Sequence[LeasedEntry]
    outs: Sequence[torch.Tensor | Pieces]
    session: str
    threads: int
    helper: Executor | None
    progress: Callable[[int], None] | None

    def __post_init__(self) -> None:
        """Each entry has an out that holds it: its ``Pieces``, or a contiguous uint8 tensor."""
        if len(self.entries) != len(self.outs):
            raise InvalidRequest(
                f"{len(self.entries)} entries to read into {len(self.outs)} buffers"
            )
        for entry, out in zip(self.entries, self.outs, strict=True):
            if isinstance(out, Pieces):
                fits = out.nbytes == entry.nbytes
            else:
                fits = out.dtype == torch.uint8 and out.numel() == entry.nbytes
                fits = fits and out.is_contiguous()
            if not fits:
                raise InvalidRequest(
                    f"entry {entry.key.hex()} is {entry.nbytes} bytes: read it into a contiguous "
                    f"uint8 tensor (or pieces) of as many"
                )


def as_bytes(t: torch.Tensor) -> np.ndarray:
    """A tensor's bytes as uint8, without a copy when it is contiguous on the CPU."""
    return t.detach().to("cpu").contiguous().view(torch.uint8).reshape(-1).numpy()


def on_this_host(hello: pb.HelloReply) -> bool:
    return hello.hostname == socket.gethostname()


class Transport(ABC):
    """How a client's puts and reads move an entry's bytes for one session. Chosen once when
    the session opens (``factory.open_transport``); a back end is one module."""

    name: TransportName
    # The daemon cannot see copies out of a mapped pool: the client counts their bytes and
    # reports them when it releases the leases (``ChunkStoreClient.release``).
    reports_reads = False
    region: np.ndarray | None = None  # the shared-memory pool, mapped
    device_pool: torch.Tensor | None = None  # the device pool, opened
    pinned = False  # the mapped pool is registered with the device runtime

    def __init__(self, hello: pb.HelloReply) -> None:
        self.block_size = hello.block_size
        self._tensor_digest = hello.HasField("device_pool")

    @classmethod
    @abstractmethod
    def open(cls, hello: pb.HelloReply, settings: Settings) -> Transport | None:
        """This back end for the daemon that said ``hello``; None where it cannot serve here
        (Unavailable where ``settings.wanted`` is the pool and it was the pool's to give)."""

    def keeps(self, hello: pb.HelloReply) -> bool:
        """Whether this transport serves a new session of the daemon that said ``hello`` as it
        is (else it is closed, and another opened)."""
        return False

    def close(self) -> None:
        """Let go of what it holds of the pool (before the daemon sees the session end)."""
        return  # the stream holds nothing

    def digest(self) -> Digest:
        return TensorDigest() if self._tensor_digest else EntryDigest()

    def stage(self, tensors: list[torch.Tensor]) -> Outgoing:
        """Before the reservation: the tensors' bytes as this transport copies them."""
        return Outgoing(tensors, [as_bytes(t) for t in tensors], self.digest())

    @abstractmethod
    def write(self, session: str, reservation: pb.ReserveReply, outgoing: Outgoing) -> None:
        """Copy the entry into the blocks reserved for it, its digest whole at the end."""

    @abstractmethod
    def read(self, reads: Reads) -> list[Digest]:
        """Copy each leased entry into its out; the digests of what was read, one an entry,
        not yet compared with the committed checksums."""

    def read_spans(
        self, entry: LeasedEntry, spans: Sequence[tuple[int, int]], out: np.ndarray
    ) -> list[int]:
        """Copy the leased entry's byte ``spans`` into ``out`` one after another: each
        span's xxh3-64, not yet compared with anything (the mapped pool only)."""
        raise InvalidRequest(
            f"a read of part of an entry needs the shared-memory pool, not the {self.name} "
            "transport: read the entry whole"
        )

    @abstractmethod
    def read_runs(
        self, entry: LeasedEntry, starts: torch.Tensor, length: int, out: torch.Tensor, session: str
    ) -> torch.Tensor:
        """Copy the leased entry's runs of ``length`` bytes at ``starts`` (int64, where
        ``out`` is) into ``out`` one after another: their two keyed sums under the lease's
        key (``device_ipc.keyed_run_sums``), not yet compared with anything."""


class EntryAtATime(Transport):
    """A transport that reads one entry at a time into a tensor of its length (an out given
    as ``Pieces`` through a buffer of its own)."""

    def read(self, reads: Reads) -> list[Digest]:
        whole = [
            torch.empty(entry.nbytes, dtype=torch.uint8) if isinstance(out, Pieces) else out
            for entry, out in zip(reads.entries, reads.outs, strict=True)
        ]
        digests = [self.digest() for _ in reads.entries]
        for entry, buffer, digest in zip(reads.entries, whole, digests, strict=True):
            self.read_entry(entry, buffer, digest, reads.session)
        for out, buffer in zip(reads.outs, whole, strict=True):
            if isinstance(out, Pieces):
                out.fill(buffer.numpy())
        return digests

    @abstractmethod
    def read_entry(
        self, entry: LeasedEntry, out: torch.Tensor, digest: Digest, session: str
    ) -> None:
        """Copy one leased entry into ``out`` (uint8, its length), feeding ``digest``."""
