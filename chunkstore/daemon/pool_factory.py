"""Picks the pool back end for a device. Device pools load torch and the device runtime, so
they are imported only when asked for: a daemon on a CPU pool starts in a fraction of the time."""

from __future__ import annotations

from chunkstore.daemon.pool import Pool, SharedMemoryPool


def create_pool(
    device: str,
    block_size: int,
    num_blocks: int,
    shm_dir: str = "/dev/shm",
    group_access: bool = False,
) -> Pool:
    """The pool back end for a device: "cpu", or "cuda[:N]", "npu[:N]", "fake[:N]"."""
    if device == "cpu":
        return SharedMemoryPool(block_size, num_blocks, shm_dir, group_access=group_access)
    from chunkstore.daemon.device_pool import DevicePool

    return DevicePool(device, block_size, num_blocks)
