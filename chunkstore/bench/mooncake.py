"""Mooncake Store in daemon mode, run for real beside chunkstore in ``bench store --peers``:
``mooncake_master`` + ``mooncake_client`` (the node's store process, holding the memory) on
free loopback ports, and this process as its "dummy" client (``setup_dummy``), the way an
inference worker uses it. Zero-copy calls only, into a buffer from its own pool
(``alloc_from_mem_pool`` + ``register_buffer``); its errors are integer return codes, raised
here as ``RuntimeError``. Needs the ``mooncake`` extra (and Debian's libibverbs1, libfabric1).
"""

from __future__ import annotations

import ctypes
import shutil
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from chunkstore.processes.redis import free_port

OBJECT_NOT_FOUND = -704  # Mooncake's ErrorCode (mooncake-store/include/types.h)


def _binary(name: str) -> str:
    found = shutil.which(name, path=str(Path(sys.executable).parent)) or shutil.which(name)
    if found is None:
        raise RuntimeError(f"{name} not found: pip install 'chunkstore[mooncake]'")
    return found


class MooncakeStore:
    """A master and a store process of ``segment_bytes``, and a client of them with a
    registered buffer of ``buffer_bytes`` (``buffer``: a uint8 view of it)."""

    def __init__(self, workdir: Path, segment_bytes: int, buffer_bytes: int) -> None:
        from mooncake.store import MooncakeDistributedStore

        workdir.mkdir(parents=True, exist_ok=True)
        master_port, client_port = free_port(), free_port()
        self._processes: list[subprocess.Popen[bytes]] = []
        self._start(
            workdir / "master.log",
            _binary("mooncake_master"),
            f"--rpc_port={master_port}",
            f"--metrics_port={free_port()}",
            f"--http_metadata_server_port={free_port()}",
        )
        self._start(
            workdir / "client.log",
            _binary("mooncake_client"),
            "--host=127.0.0.1",
            f"--port={client_port}",
            f"--master_server_address=127.0.0.1:{master_port}",
            f"--global_segment_size={segment_bytes}",
            "--metadata_server=P2PHANDSHAKE",
        )
        self.store = MooncakeDistributedStore()
        deadline = time.monotonic() + 60
        while self.store.setup_dummy(buffer_bytes, 0, f"127.0.0.1:{client_port}") != 0:
            if time.monotonic() > deadline:
                self.close()
                raise RuntimeError(f"mooncake_client did not answer: see {workdir}")
            time.sleep(0.5)
        self.address = self.store.alloc_from_mem_pool(buffer_bytes)
        if not self.address:
            raise RuntimeError(f"alloc_from_mem_pool({buffer_bytes}) failed")
        self._check("register_buffer", self.store.register_buffer(self.address, buffer_bytes))
        self.buffer = np.frombuffer(
            memoryview((ctypes.c_char * buffer_bytes).from_address(self.address)).cast("B"),
            dtype=np.uint8,
        )

    def _start(self, log: Path, *command: str) -> None:
        with log.open("wb") as out:
            self._processes.append(subprocess.Popen(command, stdout=out, stderr=out))

    @staticmethod
    def _check(call: str, rc: int) -> None:
        if rc != 0:
            raise RuntimeError(f"mooncake {call} returned {rc}")

    def put(self, key: str, offset: int, nbytes: int) -> None:
        self._check("put_from", self.store.put_from(key, self.address + offset, nbytes))

    def get(self, key: str, offset: int, nbytes: int) -> None:
        got = self.store.get_into(key, self.address + offset, nbytes)
        if got != nbytes:
            raise RuntimeError(f"mooncake get_into({key}) returned {got}, wanted {nbytes}")

    def batch_put(self, keys: Sequence[str], offsets: Sequence[int], nbytes: int) -> None:
        ptrs = [self.address + o for o in offsets]
        for rc in self.store.batch_put_from(list(keys), ptrs, [nbytes] * len(keys)):
            self._check("batch_put_from", rc)

    def batch_get(self, keys: Sequence[str], offsets: Sequence[int], nbytes: int) -> None:
        ptrs = [self.address + o for o in offsets]
        got = self.store.batch_get_into(list(keys), ptrs, [nbytes] * len(keys))
        if list(got) != [nbytes] * len(keys):
            raise RuntimeError(f"mooncake batch_get_into returned {sorted(set(got))}")

    def exist(self, keys: Sequence[str]) -> list[int]:
        return list(self.store.batch_is_exist(list(keys)))

    def remove(self, key: str) -> None:
        """Raises if the key stays (OBJECT_HAS_LEASE, -706: read in the last ``kv_lease_ttl``,
        5 s): a put of a key still there returns 0 at once and would be timed as a put. A
        key that is not there (OBJECT_NOT_FOUND, -704) is fine."""
        rc = self.store.remove(key)
        if rc != OBJECT_NOT_FOUND:
            self._check("remove", rc)

    def close(self) -> None:
        if hasattr(self, "store"):
            self.store.close()
        # The store process first: with the master gone it retries for ~15 s.
        for process in reversed(self._processes):
            process.terminate()
            try:
                process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
