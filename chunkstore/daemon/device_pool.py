"""A pool in device memory (CUDA, NPU, or the CPU stand-in "fake"): one device allocation
that same-node clients open once through its IPC handle (``device/device_ipc.py``); the
daemon frees it only after every importer closed."""

from __future__ import annotations

import logging
import time
import warnings
from collections.abc import Sequence

import numpy as np
import torch

from chunkstore.daemon.pool import Pool
from chunkstore.device.device_ipc import (
    DIGEST_PIECE,
    TensorDigest,
    gather_runs,
    keyed_run_sums,
    parse_device,
    runtime_for,
)
from chunkstore.device.device_runtime import IpcHandle
from chunkstore.errors import DeviceError, InvalidRequest
from chunkstore.protocol import shm
from chunkstore.protocol.keyed_digest import MODULUS, NO_LANES, SumKey

log = logging.getLogger(__name__)


class DevicePool(Pool):
    """One device allocation shared by IPC. The daemon's own reads and writes (streamed
    transport, verification) copy through the host; same-node clients copy device to device
    through their import. Entries are checked with ``TensorDigest``, and sealed at commit
    with a key of the daemon's own for summed leases (``seal``)."""

    def __init__(self, device: str, block_size: int, num_blocks: int) -> None:
        super().__init__(block_size, num_blocks)
        kind, index = parse_device(device)
        self.runtime = runtime_for(kind)
        self._device = f"{kind}:{index}"
        self.tensor = self.runtime.allocate(index, self.capacity)
        self._handle = self.runtime.export(self.tensor)
        self._seal_key = SumKey.fresh()  # never leaves this process (``seal``)
        log.info(
            "device pool: %d bytes on %s (%s)", self.capacity, self._device, self._handle.device
        )

    @property
    def device(self) -> str:
        return self._device

    @property
    def shm_path(self) -> str:
        return ""

    @property
    def ipc_handle(self) -> IpcHandle:
        return self._handle

    def region(self) -> np.ndarray:
        raise InvalidRequest(
            f"the {self._device} pool has no host region: a transfer engine registers host "
            "memory (serve device pools with --transfer-engine none)"
        )

    def checksum(self, blocks: Sequence[int], nbytes: int) -> int:
        digest = TensorDigest()
        for start, length in shm.extents(blocks, self.block_size, 0, nbytes):
            digest.update(self.tensor[start : start + length])
        return digest.intdigest()

    def seal(self, blocks: Sequence[int], nbytes: int) -> tuple[int, int]:
        """The entry's keyed sums under this daemon's own key, which never leaves it: the
        committed checksum is the writer's ``TensorDigest``, which a change orthogonal to
        its weights keeps, so a summed lease checks the bytes against this instead."""
        [sealed] = self._keyed([self._seal_key], blocks, nbytes)
        return sealed

    def keyed_sums(
        self,
        blocks: Sequence[int],
        nbytes: int,
        checksum: int,
        seal: tuple[int, int] | None,
        key: SumKey,
    ) -> tuple[int, int] | None:
        """Under ``key``, of bytes that still make the entry's seal (both from one copy)."""
        sealed, sums = self._keyed([self._seal_key, key], blocks, nbytes)
        return sums if seal is not None and sealed == seal else None

    def _keyed(
        self, keys: Sequence[SumKey], blocks: Sequence[int], nbytes: int
    ) -> list[tuple[int, int]]:
        """The entry's keyed sums under each key, all of one private copy of each piece of it
        (gathered and summed under the first key in one pass, then summed where it is under
        the others): a change made while it is read is in all of them or in none."""
        tables = [key.tables(nbytes) for key in keys]
        device = self.tensor.device
        totals = [torch.zeros(2, dtype=torch.int64, device=device) for _ in keys]
        copy = torch.empty(min(DIGEST_PIECE, nbytes), dtype=torch.uint8, device=device)
        for lo in range(0, nbytes, DIGEST_PIECE):
            piece = copy[: min(DIGEST_PIECE, nbytes - lo)]
            at = torch.tensor([lo], device=device)
            totals[0] += gather_runs(
                self.tensor, blocks, self.block_size, at, len(piece), piece, tables[0]
            )
            for total, weights in zip(totals[1:], tables[1:], strict=True):
                total += keyed_run_sums(piece, at, len(piece), weights)
        return [(a % MODULUS, b % MODULUS) for a, b in (t.tolist() for t in totals)]

    def gather_runs(self, blocks: Sequence[int], starts: np.ndarray, length: int) -> np.ndarray:
        where = torch.from_numpy(starts).to(self.tensor.device)
        out = torch.empty(len(starts) * length, dtype=torch.uint8, device=self.tensor.device)
        gather_runs(self.tensor, blocks, self.block_size, where, length, out, NO_LANES)
        return out.cpu().numpy()

    def scatter(self, blocks: Sequence[int], data: np.ndarray, offset: int = 0) -> None:
        with warnings.catch_warnings():  # read-only bytes off the wire: only read here
            warnings.simplefilter("ignore", UserWarning)
            source = torch.from_numpy(data)
        done = 0
        end = offset + data.shape[0]
        for start, length in shm.extents(blocks, self.block_size, offset, end):
            self.tensor[start : start + length].copy_(source[done : done + length])
            done += length
        self.runtime.synchronize(self.tensor)

    def read(self, start: int, end: int) -> bytes:
        return self.tensor[start:end].cpu().numpy().tobytes()

    def close(self, grace: float = 0.0) -> None:
        """Free once no process imports the pool; after ``grace`` seconds of waiting, leave it
        allocated rather than free it under an importer (the runtime frees it when the last
        one closes or exits)."""
        deadline = time.monotonic() + grace
        holders = self.runtime.importers(self.tensor)
        while holders and time.monotonic() < deadline:
            time.sleep(0.05)
            holders = self.runtime.importers(self.tensor)
        try:
            self.runtime.free(self.tensor)
        except DeviceError as err:
            log.error("device pool on %s not freed: %s", self._device, err)
