"""The chunk pool: one preallocated region carved into fixed-size blocks. It owns bytes and
which blocks are free; it knows nothing of entries (the index does).

Back ends sit behind ``Pool``, and ``pool_factory.create_pool`` picks one. This file holds the
interface and the CPU pool: a file in shared memory that clients on the same host map, so a
read or write is one copy between a client's tensors and the pool, never through the daemon.
Device pools are in ``device_pool.py``; this file does not import torch, so a daemon on a CPU
pool starts without it.
"""

from __future__ import annotations

import logging
import mmap
import os
import secrets
import stat
import threading
from abc import ABC, abstractmethod
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from chunkstore.errors import InvalidRequest
from chunkstore.protocol import shm
from chunkstore.protocol.keyed_digest import NO_LANES, SumKey

if TYPE_CHECKING:
    from chunkstore.device.device_runtime import IpcHandle

log = logging.getLogger(__name__)


def _load_runs_kernel() -> None:
    """Import numba's runs kernel and load its compiled code for the pools' arrays now, off
    the serving path: left to the first summed lease, it held the GIL for 0.4-0.5 s of other
    clients' calls (a Lookup waited 356-508 ms here)."""
    from chunkstore.protocol.runs_kernel import sums_of_runs

    byte, start = np.zeros(1, dtype=np.uint8), np.zeros(1, dtype=np.int64)
    weights = SumKey((0, 0)).tables(1)
    shm.gather_runs_summed(byte, [0], 1, start, 1, np.empty(1, dtype=np.uint8), weights)
    sums_of_runs(byte, start, 1, *weights)  # a device pool on the CPU (the fake's)


class Pool(ABC):
    """Fixed-size blocks over one region. Not thread-safe: its owner (the index) serializes."""

    def __init__(self, block_size: int, num_blocks: int) -> None:
        if block_size <= 0 or num_blocks <= 0:
            raise InvalidRequest("a pool needs a positive block size and block count")
        self.block_size = block_size
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))  # pop() hands out low blocks first
        self.importers: set[str] = set()  # sessions whose process opened the pool by IPC
        self._kernel = threading.Thread(target=_load_runs_kernel, name="runs-kernel", daemon=True)
        self._kernel.start()

    def loaded(self) -> None:
        """Wait until the runs kernel is loaded (the daemon, before it says it is ready: a
        thread still importing numba when SIGUSR1 dumps every thread's stack crashed it)."""
        self._kernel.join()

    @property
    def capacity(self) -> int:
        return self.block_size * self.num_blocks

    @property
    def free_blocks(self) -> int:
        return len(self._free)

    def blocks_for(self, nbytes: int) -> int:
        return -(-nbytes // self.block_size)

    def allocate(self, count: int) -> list[int] | None:
        """``count`` free blocks, or None (nothing taken) if there are fewer."""
        if count > len(self._free):
            return None
        taken = [self._free.pop() for _ in range(count)]
        return taken

    def free(self, blocks: Sequence[int]) -> None:
        self._free.extend(reversed(blocks))

    @property
    @abstractmethod
    def device(self) -> str: ...

    @property
    @abstractmethod
    def shm_path(self) -> str:
        """The file same-host clients map ("" if the pool cannot be mapped)."""

    @property
    def ipc_handle(self) -> IpcHandle | None:
        """What a same-node client opens a device pool with (None: not a device pool)."""
        return None

    @abstractmethod
    def region(self) -> np.ndarray:
        """The whole pool as host uint8 (a transfer engine registers it)."""

    def views(self, blocks: Sequence[int], nbytes: int) -> list[np.ndarray]:
        """An entry's bytes as arrays over the host region, in order, consecutive blocks
        as one (no copy): what the disk tier writes from and reads into."""
        region = self.region()
        extents = shm.extents(blocks, self.block_size, 0, nbytes)
        return [region[start : start + length] for start, length in extents]

    @abstractmethod
    def checksum(self, blocks: Sequence[int], nbytes: int) -> int:
        """An entry's checksum, computed from its pool bytes the way its writers compute it."""

    def seal(self, blocks: Sequence[int], nbytes: int) -> tuple[int, int] | None:
        """What a committed entry's bytes are later checked against before a summed lease
        vouches for them, where the commit checksum cannot be trusted to (a device pool's:
        its writer's ``TensorDigest``, forgeable). None: the checksum serves."""
        return None

    def keyed_sums(
        self,
        blocks: Sequence[int],
        nbytes: int,
        checksum: int,
        seal: tuple[int, int] | None,
        key: SumKey,
    ) -> tuple[int, int] | None:
        """An entry's keyed sums under ``key`` (``keyed_digest``): what the sums of parts of
        it, read apart under a lease that carries the key, add up to. Of its pool bytes now,
        in the pass that checks them against the committed ``checksum`` (each stripe copied
        once, both computed from the copy); None where they fail it."""
        weights = (key.inner(), key.outer(nbytes))
        region = self.region()
        actual, sums = shm.keyed_and_checksum(region, blocks, self.block_size, nbytes, weights)
        return sums if actual == checksum else None

    def gather_runs(self, blocks: Sequence[int], starts: np.ndarray, length: int) -> np.ndarray:
        """An entry's runs of ``length`` bytes at ``starts`` (int64), one after another, to
        the host (``shm.gather_runs_summed``, a copy: the reader sums what it receives)."""
        out = np.empty(len(starts) * length, dtype=np.uint8)
        region = self.region()
        shm.gather_runs_summed(region, blocks, self.block_size, starts, length, out, NO_LANES)
        return out

    @abstractmethod
    def scatter(self, blocks: Sequence[int], data: np.ndarray, offset: int = 0) -> None:
        """Host bytes into an entry's blocks, from entry byte ``offset``."""

    @abstractmethod
    def read(self, start: int, end: int) -> bytes:
        """Pool bytes [start, end) to the host."""

    @abstractmethod
    def close(self, grace: float = 0.0) -> None:
        """Give the memory back (``grace``: how long importers get to close first)."""


class SharedMemoryPool(Pool):
    """A CPU pool in a shared-memory file, private to the daemon's user (0600) unless group
    access is asked for (0660)."""

    def __init__(
        self,
        block_size: int,
        num_blocks: int,
        directory: str | Path = "/dev/shm",
        name: str | None = None,
        group_access: bool = False,
    ) -> None:
        super().__init__(block_size, num_blocks)
        name = name or f"chunkstore-{os.getuid()}-{os.getpid()}-{secrets.token_hex(4)}"
        self.path = Path(directory) / name
        mode = 0o660 if group_access else 0o600
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, mode)
        try:
            os.fchmod(fd, mode)  # not subject to the umask
            free = os.statvfs(directory)
            if free.f_bavail * free.f_frsize < self.capacity:
                raise InvalidRequest(
                    f"{directory} has {free.f_bavail * free.f_frsize} bytes free, the pool "
                    f"needs {self.capacity}: lower --pool-bytes or use another --shm-dir"
                )
            # Take the pages now: a pool that runs out of shared memory later would crash
            # whoever touches the missing page (SIGBUS), daemon or client.
            os.posix_fallocate(fd, 0, self.capacity)
            self._mmap = mmap.mmap(fd, self.capacity, mmap.MAP_SHARED)
        except BaseException:
            os.close(fd)
            self.path.unlink(missing_ok=True)
            raise
        os.close(fd)
        self._region = np.frombuffer(self._mmap, dtype=np.uint8)

    @property
    def device(self) -> str:
        return "cpu"

    @property
    def shm_path(self) -> str:
        return str(self.path)

    def region(self) -> np.ndarray:
        return self._region

    def checksum(self, blocks: Sequence[int], nbytes: int) -> int:
        return shm.checksum(self._region, blocks, self.block_size, nbytes)

    def scatter(self, blocks: Sequence[int], data: np.ndarray, offset: int = 0) -> None:
        shm.scatter(self._region, blocks, self.block_size, data, offset)

    def read(self, start: int, end: int) -> bytes:
        return self._region[start:end].tobytes()

    def close(self, grace: float = 0.0) -> None:
        self.path.unlink(missing_ok=True)
        # The mapping goes when the last view of it does (clients' maps keep their pages).


def _owner_gone(pid: int) -> bool:
    if pid == os.getpid():
        return True  # this daemon has not made its pool yet: a dead one's, same pid reused
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False  # alive, another user's process
    return False


def reclaim_stale_pools(directory: str | Path) -> list[tuple[Path, int]]:
    """Remove the pool files that daemons of this user left when they died (a SIGKILL skips
    the clean-up), so crashed daemons do not keep their pools' memory. Only this user's
    files, only when the process named in the file name is gone. Returns (path, bytes)."""
    uid = os.getuid()
    removed = []
    for path in Path(directory).glob(f"chunkstore-{uid}-*-*"):
        pid = path.name.split("-")[2]
        try:
            st = path.lstat()
        except FileNotFoundError:
            continue
        if not pid.isdigit() or st.st_uid != uid or not stat.S_ISREG(st.st_mode):
            continue
        if _owner_gone(int(pid)):
            path.unlink(missing_ok=True)
            removed.append((path, st.st_size))
    return removed
