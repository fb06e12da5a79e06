"""FAKE device runtime: a CPU stand-in for CUDA / Ascend device memory and its IPC calls, for
hosts without an accelerator (this project's CI). Selected by ``chunkstore serve --device
fake``; never by default.

It keeps the real runtimes' contracts, so the pool code above it runs as it would on a
device, across real processes:
- an allocation is one file in /dev/shm ("device memory") that only its handle opens;
- a handle names its device by identity; an importer opens it on the ordinal that has that
  identity in *its* process (``FAKE_VISIBLE_DEVICES`` lists a process's visible devices,
  as ``CUDA_VISIBLE_DEVICES`` / ``ASCEND_RT_VISIBLE_DEVICES`` would), and is refused on any
  other (cudaIpcOpenMemHandle and aclrtIpcMemImportByKey map onto the exporting device);
- the exporting process cannot import its own handle, and a process imports a handle at most
  once until it closes it (HDK < 25.3.RC1 refuses a second import; CUDA maps one per
  context): open once, share the tensor;
- the exporter may free only when no live importer holds the memory ("every importer must
  close before the exporter closes", aclrtIpcMemClose; cudaFree first is undefined). The
  fake refuses such a free; a dead importer's hold goes with its process, as the driver's
  does. When the exporter is gone, the last importer to close removes the memory.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import secrets
import socket
from pathlib import Path

import torch

from chunkstore.device.device_runtime import DeviceIPC, IpcHandle
from chunkstore.errors import DeviceError

ENV = "FAKE_VISIBLE_DEVICES"
DIRECTORY = Path("/dev/shm")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _edit_importers(path: Path, add: int = 0, remove: int = 0) -> list[int]:
    """Under an exclusive lock: drop dead pids, add / remove one, return the live ones."""
    with open(path, "a+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        f.seek(0)
        pids = {int(x) for x in f.read().split() if x.isdigit()}
        pids = {p for p in pids if _alive(p)}
        if add:
            pids.add(add)
        pids.discard(remove)
        f.seek(0)
        f.truncate()
        f.write("".join(f"{p}\n" for p in sorted(pids)))
        return sorted(pids)


class FakeDeviceIPC(DeviceIPC):
    """See the module docstring. One instance per process is enough; it remembers this
    process's allocations and imports."""

    kind = "fake"

    def __init__(self) -> None:
        self._allocations: dict[int, tuple[Path, str, mmap.mmap]] = {}  # data_ptr ->
        self._imports: dict[int, tuple[Path, mmap.mmap]] = {}

    def visible(self) -> list[str]:
        names = os.environ.get(ENV, "")
        if names:
            return [n.strip() for n in names.split(",") if n.strip()]
        return [f"fake-{socket.gethostname()}-{i}" for i in range(2)]

    def identity(self, index: int) -> str:
        devices = self.visible()
        if not 0 <= index < len(devices):
            raise DeviceError(f"fake:{index}: this process sees {len(devices)} fake devices")
        return devices[index]

    @staticmethod
    def sweep() -> None:
        """Remove allocations whose exporter died with no live importer left (the driver
        frees a dead process's memory; a file would outlive it)."""
        for path in DIRECTORY.glob(f"chunkstore-fakedev-{os.getuid()}-*-*"):
            if path.suffix == ".importers":
                continue
            pid = path.name.split("-")[3]
            ledger = Path(f"{path}.importers")
            if pid.isdigit() and not _alive(int(pid)) and not _edit_importers(ledger):
                path.unlink(missing_ok=True)
                ledger.unlink(missing_ok=True)

    def allocate(self, index: int, nbytes: int) -> torch.Tensor:
        self.sweep()
        identity = self.identity(index)
        path = DIRECTORY / f"chunkstore-fakedev-{os.getuid()}-{os.getpid()}-{secrets.token_hex(4)}"
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.posix_fallocate(fd, 0, nbytes)
            region = mmap.mmap(fd, nbytes, mmap.MAP_SHARED)
        except BaseException:
            path.unlink(missing_ok=True)
            raise
        finally:
            os.close(fd)
        tensor = torch.frombuffer(region, dtype=torch.uint8)
        self._allocations[tensor.data_ptr()] = (path, identity, region)
        return tensor

    def export(self, pool: torch.Tensor) -> IpcHandle:
        if pool.data_ptr() not in self._allocations:
            raise DeviceError("export of memory this process did not allocate")
        path, identity, _ = self._allocations[pool.data_ptr()]
        return IpcHandle(
            "fake",
            identity,
            f"{path}|{os.getpid()}".encode(),
            pool.numel(),
            ref_counter_handle=f"{path}.importers".encode(),
        )

    def open(self, handle: IpcHandle, index: int) -> torch.Tensor:
        path_text, _, exporter = handle.handle.decode().partition("|")
        path = Path(path_text)
        if self.identity(index) != handle.device:
            raise DeviceError(
                f"handle of device {handle.device} opened on fake:{index} "
                f"({self.identity(index)}): the memory lives on its own device"
            )
        if exporter == str(os.getpid()):
            raise DeviceError("a process cannot import the memory it exported itself")
        if any(p == path for p, _ in self._imports.values()):
            raise DeviceError(
                f"{path.name} is imported in this process already: import a handle once "
                "and share the tensor (older drivers refuse a second import)"
            )
        try:
            fd = os.open(path, os.O_RDWR)
        except FileNotFoundError:
            raise DeviceError(f"{path.name} was freed: the handle is stale") from None
        try:
            if os.fstat(fd).st_size != handle.size:
                raise DeviceError(
                    f"{path.name} holds {os.fstat(fd).st_size} bytes, not {handle.size}"
                )
            region = mmap.mmap(fd, handle.size, mmap.MAP_SHARED)
        finally:
            os.close(fd)
        _edit_importers(Path(handle.ref_counter_handle.decode()), add=os.getpid())
        tensor = torch.frombuffer(region, dtype=torch.uint8)
        self._imports[tensor.data_ptr()] = (path, region)
        return tensor

    def close(self, opened: torch.Tensor) -> None:
        entry = self._imports.pop(opened.data_ptr(), None)
        if entry is None:
            raise DeviceError("close of memory this process has not imported")
        path, _ = entry
        exporter = int(path.name.split("-")[3])
        left = _edit_importers(Path(f"{path}.importers"), remove=os.getpid())
        if not left and not _alive(exporter):  # the driver frees with the last reference
            path.unlink(missing_ok=True)
            Path(f"{path}.importers").unlink(missing_ok=True)

    def importers(self, pool: torch.Tensor) -> list[int]:
        """Live processes holding an import of this allocation."""
        path, _, _ = self._allocations[pool.data_ptr()]
        return _edit_importers(Path(f"{path}.importers"))

    def free(self, pool: torch.Tensor) -> None:
        if pool.data_ptr() not in self._allocations:
            raise DeviceError("free of memory this process did not allocate")
        holders = self.importers(pool)
        if holders:
            raise DeviceError(
                f"{len(holders)} process(es) still import this memory (pids {holders}): "
                "every importer must close before the exporter frees"
            )
        path, _, _ = self._allocations.pop(pool.data_ptr())
        path.unlink(missing_ok=True)
        Path(f"{path}.importers").unlink(missing_ok=True)
