"""What a device runtime is to the pool code: the ``DeviceIPC`` interface each back end
implements (``device_ipc.TorchIPC`` for CUDA and Ascend, ``fake_device.FakeDeviceIPC`` for a
CPU-only host) and the ``IpcHandle`` it exports, which travels to importers over gRPC. The back
ends import this module; ``device_ipc`` imports them and picks one (``runtime_for``)."""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from chunkstore.errors import DeviceError
from chunkstore.protocol.convert import IpcHandle


class DeviceIPC(ABC):
    """One platform's allocation and IPC calls. ``index`` is this process's ordinal."""

    kind: str

    @abstractmethod
    def identity(self, index: int) -> str:
        """The device's identity, the same in every process on the node."""

    @abstractmethod
    def visible(self) -> list[str]:
        """Identities of this process's devices, by ordinal."""

    @abstractmethod
    def allocate(self, index: int, nbytes: int) -> torch.Tensor:
        """A uint8 tensor of its own allocation (IPC shares whole allocations)."""

    @abstractmethod
    def export(self, pool: torch.Tensor) -> IpcHandle: ...

    @abstractmethod
    def open(self, handle: IpcHandle, index: int) -> torch.Tensor: ...

    @abstractmethod
    def close(self, opened: torch.Tensor) -> None: ...

    @abstractmethod
    def free(self, pool: torch.Tensor) -> None: ...

    def synchronize(self, tensor: torch.Tensor) -> None:  # noqa: B027  (CPU: nothing queued)
        """Wait until copies queued on the tensor's device have landed."""

    def importers(self, pool: torch.Tensor) -> list[int] | None:
        """Live processes holding an import of ``pool``, where the runtime can tell (None:
        torch keeps a freed block in its IPC limbo until they let go, so it never asks)."""
        return None

    def index_of(self, identity: str) -> int:
        try:
            return self.visible().index(identity)
        except ValueError:
            raise DeviceError(
                f"the pool is on device {identity}, which this process does not see "
                f"(it sees {self.visible() or 'none'}): check *_VISIBLE_DEVICES"
            ) from None
