"""The chunk pool: one preallocated region carved into fixed-size blocks. It owns bytes and
which blocks are free; it knows nothing of entries (the index does).

Back ends sit behind ``Pool`` and ``create_pool``. The CPU pool is a file in shared memory
that clients on the same host map, so a read or write is one copy between a client's tensors
and the pool, never through the daemon. Device pools (CUDA, NPU) hand out IPC handles; they
are not built yet and ``create_pool`` says so.
"""

from __future__ import annotations

import mmap
import os
import secrets
from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
import xxhash

from chunkstore.errors import InvalidRequest


def block_runs(blocks: Sequence[int]) -> Iterator[tuple[int, int, int]]:
    """(first block, run length, index in ``blocks``) for each run of consecutive blocks:
    consecutive blocks are one contiguous copy."""
    i = 0
    while i < len(blocks):
        j = i + 1
        while j < len(blocks) and blocks[j] == blocks[j - 1] + 1:
            j += 1
        yield blocks[i], j - i, i
        i = j


PIECE = 1 << 20  # copy and hash in pieces that stay in L2 between the two


def gather(
    region: np.ndarray, blocks: Sequence[int], block_size: int, out: np.ndarray, digest: Any = None
) -> None:
    """Copy an entry's bytes out of its blocks into ``out`` (uint8, the entry's length),
    feeding ``digest`` (an xxhash object) on the way: one pass over memory, not two."""
    src, dst = torch.from_numpy(region), torch.from_numpy(out)
    nbytes = out.shape[0]
    for first, count, index in block_runs(blocks):
        start = index * block_size
        end = min(start + count * block_size, nbytes)
        offset = first * block_size - start
        for lo in range(start, end, PIECE):
            hi = min(lo + PIECE, end)
            dst[lo:hi].copy_(src[lo + offset : hi + offset])
            if digest is not None:
                digest.update(out[lo:hi].data)


def scatter(
    region: np.ndarray, blocks: Sequence[int], block_size: int, data: np.ndarray, offset: int = 0
) -> None:
    """Copy ``data`` (uint8) into an entry's blocks, starting ``offset`` bytes into the entry."""
    end_offset = offset + data.shape[0]
    for first, count, index in block_runs(blocks):
        run_start = index * block_size
        run_end = run_start + count * block_size
        lo, hi = max(run_start, offset), min(run_end, end_offset)
        if hi > lo:
            dest = first * block_size + (lo - run_start)
            region[dest : dest + hi - lo] = data[lo - offset : hi - offset]


def checksum(region: np.ndarray, blocks: Sequence[int], block_size: int, nbytes: int) -> int:
    """xxh3-64 of an entry's bytes, read in place."""
    h = xxhash.xxh3_64()
    remaining = nbytes
    for first, count, _ in block_runs(blocks):
        take = min(count * block_size, remaining)
        h.update(region[first * block_size : first * block_size + take].data)
        remaining -= take
        if remaining <= 0:
            break
    return h.intdigest()


class Pool(ABC):
    """Fixed-size blocks over one region. Not thread-safe: its owner (the index) serializes."""

    def __init__(self, block_size: int, num_blocks: int) -> None:
        if block_size <= 0 or num_blocks <= 0:
            raise InvalidRequest("a pool needs a positive block size and block count")
        self.block_size = block_size
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))  # pop() hands out low blocks first

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

    @abstractmethod
    def region(self) -> np.ndarray:
        """The whole pool as uint8, for the daemon's own reads and writes (streams, checks)."""

    @abstractmethod
    def close(self) -> None: ...


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

    def close(self) -> None:
        self.path.unlink(missing_ok=True)
        # The mapping goes when the last view of it does.


def map_shared_pool(path: str | Path, capacity: int) -> np.ndarray:
    """A client's view of a daemon's shared-memory pool (raises OSError if it cannot map it)."""
    fd = os.open(path, os.O_RDWR)
    try:
        if os.fstat(fd).st_size < capacity:
            raise OSError(f"{path} is smaller than the pool it should hold")
        mapped = mmap.mmap(fd, capacity, mmap.MAP_SHARED)
    finally:
        os.close(fd)
    return np.frombuffer(mapped, dtype=np.uint8)


def create_pool(
    device: str,
    block_size: int,
    num_blocks: int,
    shm_dir: str = "/dev/shm",
    group_access: bool = False,
) -> Pool:
    """The pool back end for a device. Adding one is adding a branch here and a class."""
    if device == "cpu":
        return SharedMemoryPool(block_size, num_blocks, shm_dir, group_access=group_access)
    raise InvalidRequest(
        f"no {device!r} pool back end yet: device pools (CUDA IPC, NPU) are not built; "
        "use --device cpu"
    )
