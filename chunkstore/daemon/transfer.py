"""Mooncake's Transfer Engine for peer pulls
(docs/daemon.md#peer-pulls-over-mooncakes-transfer-engine-optional): a daemon registers its pool
with the engine once, and a peer holding a lease on an entry reads the entry's blocks
one-sidedly, straight into blocks it reserved in its own pool; the owner's CPU does not copy.

The fabric is the engine's protocol: "tcp" anywhere (the only one exercised here), "rdma" on
RoCE / InfiniBand, "ascend" on Ascend clusters (HCCS / RoCE, what vllm-ascend moves KV with).
Sessions are opened peer to peer ("P2PHANDSHAKE": no metadata server); where to read travels
in the gRPC Hello reply of the session that holds the lease (``TransferEndpoint``).

The engine is an optional extra: ``pip install 'chunkstore[mooncake]'`` (Debian's
``libibverbs1`` and ``libfabric1`` too). Its calls answer integer codes; here a failure is an
``Unavailable`` and the caller falls back to the gRPC stream.

The engine does not authenticate its readers: whoever reaches its port can read the
registered pool. Turn it on only on a fabric that is the cluster's alone.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
from collections.abc import Iterator, Sequence

import numpy as np

from chunkstore.errors import Unavailable
from chunkstore.protocol.convert import Endpoint
from chunkstore.protocol.shm import extents

log = logging.getLogger("chunkstore.daemon.transfer")

ENGINES = ("none", "mooncake")
PROTOCOLS = ("tcp", "rdma", "ascend")


def _extents(blocks: Sequence[int], block_size: int, nbytes: int) -> list[tuple[int, int]]:
    """(offset, length) of each contiguous byte range an entry of ``nbytes`` covers."""
    if len(blocks) != -(-nbytes // block_size):
        raise ValueError(f"{len(blocks)} blocks of {block_size} bytes for {nbytes} bytes")
    return list(extents(blocks, block_size, 0, nbytes))


def read_runs(
    local: Sequence[int],
    local_block_size: int,
    remote: Sequence[int],
    remote_block_size: int,
    nbytes: int,
) -> list[tuple[int, int, int]]:
    """The reads (local offset, remote offset, length) that move an entry of ``nbytes`` from
    the peer's blocks ``remote`` into ours ``local``, each as long as both sides stay
    contiguous (the pools' block sizes may differ)."""
    mine, theirs = (
        _extents(local, local_block_size, nbytes),
        _extents(remote, remote_block_size, nbytes),
    )
    runs: list[tuple[int, int, int]] = []
    i = j = 0
    (lo, ln), (ro, rn) = mine[0], theirs[0]
    while True:
        length = min(ln, rn)
        runs.append((lo, ro, length))
        lo, ln, ro, rn = lo + length, ln - length, ro + length, rn - length
        if ln == 0:
            i += 1
            if i == len(mine):
                return runs
            lo, ln = mine[i]
        if rn == 0:
            j += 1
            ro, rn = theirs[j]


@contextlib.contextmanager
def _signal_handlers_kept() -> Iterator[None]:
    """The engine installs glog's failure handlers, SIGTERM and SIGINT among them, which end
    the process at once: put the daemon's back, so a SIGTERM still drains (main thread only,
    where Python handles signals)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    kept = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for sig, handler in kept.items():
            signal.signal(sig, handler)


class MooncakeEngine:
    """The engine of this daemon, with ``region`` (the pool) registered. Raises
    ``Unavailable`` when it cannot start: not installed, or the engine refused."""

    def __init__(self, host: str, protocol: str, devices: str, region: np.ndarray) -> None:
        if protocol not in PROTOCOLS:
            raise Unavailable(f"transfer protocol {protocol!r}: one of {', '.join(PROTOCOLS)}")
        try:
            from mooncake.engine import TransferEngine
        except ImportError as err:
            raise Unavailable(
                f"Mooncake's Transfer Engine is not installed ({err}): pip install "
                "'chunkstore[mooncake]' (Debian: apt-get install libibverbs1 libfabric1)"
            ) from None
        self._engine = TransferEngine()
        with _signal_handlers_kept():
            rc = self._engine.initialize(host, "P2PHANDSHAKE", protocol, devices)
        if rc != 0:
            raise Unavailable(
                f"the transfer engine did not start: initialize({host!r}, 'P2PHANDSHAKE', "
                f"{protocol!r}, {devices!r}) returned {rc}"
            )
        self._region = region  # registered memory must outlive the engine's use of it
        base, size = region.ctypes.data, region.nbytes
        rc = self._engine.register_memory(base, size)
        if rc != 0:
            raise Unavailable(f"the transfer engine refused the pool ({size} bytes): {rc}")
        self.endpoint = Endpoint(
            "mooncake", protocol, f"{host}:{self._engine.get_rpc_port()}", base, size
        )

    def read(self, peer: Endpoint, runs: Sequence[tuple[int, int, int]]) -> None:
        """Read ``runs`` (our offset, the peer's offset, length) of ``peer``'s pool into ours,
        all or nothing: an ``Unavailable`` leaves what was read unspecified."""
        if peer.engine != self.endpoint.engine or peer.protocol != self.endpoint.protocol:
            raise Unavailable(
                f"the peer serves {peer.engine}/{peer.protocol}, this daemon "
                f"{self.endpoint.engine}/{self.endpoint.protocol}"
            )
        for local, remote, length in runs:
            if local + length > self.endpoint.size or remote + length > peer.size:
                raise Unavailable(f"a read of {length} bytes at {remote} is outside a pool")
        rc = self._engine.batch_transfer_sync_read(
            peer.session,
            [self.endpoint.base + local for local, _, _ in runs],
            [peer.base + remote for _, remote, _ in runs],
            [length for _, _, length in runs],
        )
        if rc != 0:
            raise Unavailable(f"reading from {peer.session} over the transfer engine failed: {rc}")

    def close(self) -> None:
        self._engine.unregister_memory(self.endpoint.base)
