"""The shared-memory transport: the daemon's pool file mapped into this process (same host),
entries copied straight between its blocks and the caller's tensors, stripe by stripe."""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence

import numpy as np
import torch

from chunkstore.device.device_ipc import pin_host_region
from chunkstore.errors import Unavailable
from chunkstore.protocol import chunkstore_pb2 as pb
from chunkstore.protocol.convert import LeasedEntry
from chunkstore.protocol.shm import (
    EntryDigest,
    Pieces,
    gather_many,
    gather_runs_summed,
    gather_spans,
    map_shared_pool,
    scatter_parts,
)
from chunkstore.protocol.shm import populate as populate_pool
from chunkstore.transport.base import (
    Digest,
    Outgoing,
    Reads,
    Settings,
    Transport,
    TransportName,
    Wanted,
    on_this_host,
)

log = logging.getLogger("chunkstore.client")


class SharedMemoryTransport(Transport):
    """Through the mapped pool. ``pin_for`` registers the mapping with that device runtime
    (page-locked: copies to the device run as DMA); ``populate`` maps every page on a
    background thread at the lowest priority, so reads do not pay for it at first touch."""

    name = TransportName.SHM
    reports_reads = True
    region: np.ndarray

    def __init__(self, hello: pb.HelloReply, region: np.ndarray, settings: Settings) -> None:
        super().__init__(hello)
        self.region = region
        self.copy_threads = settings.copy_threads
        self._closed = threading.Event()
        self._unpin: Callable[[], None] | None = None
        if settings.pin_for:
            self._unpin, why = pin_host_region(region, settings.pin_for)
            self.pinned = self._unpin is not None
            if why:
                log.warning("chunkstore pool not pinned for %s: %s", settings.pin_for, why)
        if settings.populate and not self.pinned:  # a pinned pool is mapped already
            threading.Thread(target=self._populate, name="chunkstore-populate", daemon=True).start()

    @classmethod
    def open(cls, hello: pb.HelloReply, settings: Settings) -> SharedMemoryTransport | None:
        if settings.wanted != Wanted.STREAM and hello.shm_path != "" and on_this_host(hello):
            try:
                region = map_shared_pool(hello.shm_path, hello.block_size * hello.num_blocks)
            except OSError as exc:
                if settings.wanted == Wanted.POOL:
                    raise Unavailable(f"cannot map the pool at {hello.shm_path}: {exc}") from exc
                log.info("pool not mappable (%s); using the gRPC stream", exc)
                return None
            return cls(hello, region, settings)
        if settings.wanted == Wanted.POOL:
            raise Unavailable("the daemon's pool is not shared memory on this host")
        return None

    def close(self) -> None:
        self._closed.set()  # stops populating
        if self._unpin is not None:
            self._unpin()
            self._unpin, self.pinned = None, False

    def _populate(self) -> None:
        with contextlib.suppress(OSError):  # below vLLM's threads where they share a core
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        began = time.perf_counter()
        done = populate_pool(self.region, self._closed.is_set)
        log.debug(
            "pool map %s in %.2f s (%d MiB)",
            "populated" if done else "left to first touch",
            time.perf_counter() - began,
            self.region.nbytes >> 20,
        )

    def digest(self) -> EntryDigest:
        return EntryDigest()  # a mapped pool is a host one: xxh3 stripes

    def write(self, session: str, reservation: pb.ReserveReply, outgoing: Outgoing) -> None:
        """The parts hashed stripe by stripe as they are copied."""
        assert isinstance(outgoing.digest, EntryDigest)
        blocks, parts, threads = reservation.blocks, outgoing.parts, self.copy_threads
        scatter_parts(self.region, blocks, self.block_size, parts, outgoing.digest, threads)

    def read(self, reads: Reads) -> list[Digest]:
        """Every entry's stripes shared out over ``reads.threads`` (``shm.gather_many``),
        straight into ``Pieces`` too."""
        digests = [self.digest() for _ in reads.entries]
        targets = [
            (entry.blocks, out if isinstance(out, Pieces) else out.numpy())
            for entry, out in zip(reads.entries, reads.outs, strict=True)
        ]
        threads, helper, progress = reads.threads, reads.helper, reads.progress
        gather_many(self.region, self.block_size, targets, digests, threads, helper, progress)
        return list(digests)

    def read_runs(
        self, entry: LeasedEntry, starts: torch.Tensor, length: int, out: torch.Tensor, session: str
    ) -> torch.Tensor:
        """Gathered straight from the mapped pool (host memory: ``out`` on the CPU), and
        summed on the way, over ``copy_threads``."""
        args = (self.region, entry.blocks, self.block_size, starts.numpy(), length, out.numpy())
        sums = gather_runs_summed(*args, entry.sum_tables(), threads=self.copy_threads)
        return torch.tensor(sums)

    def read_spans(
        self, entry: LeasedEntry, spans: Sequence[tuple[int, int]], out: np.ndarray
    ) -> list[int]:
        return gather_spans(self.region, entry.blocks, self.block_size, spans, out)
