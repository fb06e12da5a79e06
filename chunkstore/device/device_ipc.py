"""Device pools shared between processes: one allocation made by the daemon, opened once by
each same-node worker through the platform's IPC handle, entries addressed as byte offsets.

The platform sits behind ``DeviceIPC`` (``device_runtime``, with the ``IpcHandle`` it
exports): ``TorchIPC`` here drives torch's own sharing calls (CUDA ``_share_cuda_`` /
``_new_shared_cuda``; torch-npu ``_share_npu_`` / ``_new_shared_npu``, which wrap the ACL IPC
calls), and ``fake_device`` stands in for a device
on a CPU-only host; ``runtime_for`` picks one by name. Everything else
(handle exchange over gRPC, offsets, who holds an import, close before free, the data path)
is this module's and the pool's, the same code whichever runtime is beneath.

Rules both real runtimes impose, kept here for all:
- a handle names a device by identity (a UUID, or host and physical chip), never by a
  process-local ordinal: ``CUDA_VISIBLE_DEVICES`` / ``ASCEND_RT_VISIBLE_DEVICES`` renumber;
- a process opens a handle once and reuses the tensor (HDK < 25.3.RC1 refuses a second import,
  CUDA maps one per context);
- every importer closes before the exporter frees (freeing first is undefined on the device).

Entries in a device pool are checked with ``TensorDigest`` (computed on the device the bytes
are on), not the shared-memory pool's xxh3 stripes, which need host bytes. A get on CUDA or
an NPU gathers and hashes in one Triton kernel (``gather_triton``: why every get still hashes
is said there) where it loads and passes its self-check; else torch ops copy, then hash.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import socket
import threading
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import numpy as np
import torch

from chunkstore.device.device_runtime import DeviceIPC, IpcHandle
from chunkstore.device.fake_device import FakeDeviceIPC
from chunkstore.errors import DeviceError, InvalidRequest
from chunkstore.protocol.keyed_digest import MODULUS, SPAN
from chunkstore.protocol.shm import SUM_MODULUS as _MODULUS
from chunkstore.protocol.shm import digest_of_sums, extents, gather_runs_summed

log = logging.getLogger(__name__)

Weights = tuple[np.ndarray, np.ndarray]  # a SumKey's inner and outer tables (keyed_digest)


class TorchIPC(DeviceIPC):
    """CUDA or Ascend through torch's storage sharing (torch-npu installs the same methods
    with npu in their names). Not run on this project's CPU-only hosts: ``tests/device``
    runs the pool's checks through it where a device exists."""

    def __init__(self, kind: str) -> None:
        if kind not in ("cuda", "npu"):
            raise InvalidRequest(f"no IPC runtime for {kind!r}")
        if kind == "npu":
            import torch_npu  # noqa: F401  (installs torch.npu and _share_npu_)
        self.kind = kind
        self.module: Any = getattr(torch, kind)
        if not self.module.is_available():
            raise DeviceError(f"torch sees no {kind} device in this process")

    def identity(self, index: int) -> str:
        uuid = getattr(self.module.get_device_properties(index), "uuid", None)
        if uuid:
            return str(uuid)
        if self.kind == "npu":  # older HDKs expose no UUID: host and physical chip
            chips = os.environ.get("ASCEND_RT_VISIBLE_DEVICES", "")
            physical = chips.split(",")[index] if chips else str(index)
            return f"{socket.gethostname()}-{physical.strip()}"
        raise DeviceError(f"{self.kind}:{index} reports no UUID")

    def visible(self) -> list[str]:
        return [self.identity(i) for i in range(self.module.device_count())]

    def allocate(self, index: int, nbytes: int) -> torch.Tensor:
        # The caching allocator hands a plain (ND, cudaMalloc-style) block; expandable
        # segments and vLLM's sleep-mode allocator are not shareable this way.
        return torch.empty(nbytes, dtype=torch.uint8, device=f"{self.kind}:{index}")

    def export(self, pool: torch.Tensor) -> IpcHandle:
        share = getattr(pool.untyped_storage(), f"_share_{self.kind}_")
        _device, handle, size, offset, ref_handle, ref_offset, event, sync = share()
        return IpcHandle(
            self.kind,
            self.identity(pool.device.index or 0),
            handle,
            size,
            offset,
            ref_handle,
            ref_offset,
            event or b"",
            bool(sync),
        )

    def open(self, handle: IpcHandle, index: int) -> torch.Tensor:
        new_shared = getattr(torch.UntypedStorage, f"_new_shared_{self.kind}")
        with self.module.device(index):
            storage = new_shared(
                index,
                handle.handle,
                handle.size,
                handle.offset,
                handle.ref_counter_handle,
                handle.ref_counter_offset,
                handle.event_handle,
                handle.event_sync_required,
            )
            pool = torch.empty(0, dtype=torch.uint8, device=f"{self.kind}:{index}")
            pool.set_(storage, 0, (handle.size,), (1,))
        return pool

    def close(self, opened: torch.Tensor) -> None:
        self.synchronize(opened)  # nothing of ours still reads or writes it
        opened.set_()  # type: ignore[call-overload]  # drops the storage: the import ends

    def free(self, pool: torch.Tensor) -> None:
        self.synchronize(pool)
        pool.set_()  # type: ignore[call-overload]
        self.module.empty_cache()

    def synchronize(self, tensor: torch.Tensor) -> None:
        self.module.synchronize(tensor.device)


def accelerators() -> list[str]:
    """The accelerator kinds this host has, as torch sees them ("cuda", "npu"); a FAKE
    torch_npu (chunkstore.testing.fake_torch_npu) has none."""
    found = []
    if torch.cuda.is_available():
        found.append("cuda")
    if importlib.util.find_spec("torch_npu") is not None:
        import torch_npu

        npu = getattr(torch, "npu", None)
        if not getattr(torch_npu, "FAKE", False) and npu is not None and npu.is_available():
            found.append("npu")
    return found


def runtime_for(kind: str) -> DeviceIPC:
    """The IPC runtime of a pool device kind: "cuda", "npu", or "fake" (the CPU stand-in)."""
    if kind == "fake":
        return FakeDeviceIPC()
    return TorchIPC(kind)


def parse_device(device: str) -> tuple[str, int]:
    """ "cuda", "cuda:1", "npu:0", "fake" -> (kind, ordinal)."""
    kind, _, index = device.partition(":")
    if kind not in ("cpu", "cuda", "npu", "fake") or (index and not index.isdigit()):
        raise InvalidRequest(
            f"unknown pool device {device!r}: cpu, cuda[:N], npu[:N] or fake[:N] (a CPU "
            "stand-in for a device, for tests)"
        )
    return kind, int(index or 0)


# Pinned host pools -------------------------------------------------------------------------


def pin_host_region(region: Any, kind: str) -> tuple[Callable[[], None] | None, str]:
    """Register a mapped shared-memory pool with a device runtime, page-locked, so copies
    between it and that device run as DMA (an unregistered page is staged through a pinned
    bounce buffer first). Returns (unregister, "") or (None, why not)."""
    if kind == "cuda":
        if not torch.cuda.is_available():
            return None, "torch sees no CUDA device in this process"
        cudart = torch.cuda.cudart()
        pointer, size = region.ctypes.data, region.nbytes
        err = cudart.cudaHostRegister(pointer, size, 0)  # cudaHostRegisterDefault
        if int(err) != 0:
            return None, f"cudaHostRegister failed with error {int(err)}"

        def unregister() -> None:
            cudart.cudaHostUnregister(pointer)

        return unregister, ""
    if kind == "npu":
        # torch_npu exposes no host-register call (ACL's aclrtHostRegister needs a binding
        # of its own): the pool stays pageable there.
        return None, "torch_npu has no host-register call: the pool stays pageable"
    return None, f"nothing to pin for {kind!r}"


# Opening -----------------------------------------------------------------------------------

_opened: dict[tuple[str, bytes], tuple[DeviceIPC, torch.Tensor, int]] = {}
_opened_lock = threading.Lock()


def open_pool(handle: IpcHandle) -> torch.Tensor:
    """This process's view of a daemon's device pool, opened at the first call and shared by
    every later one (clients of one process, a session reopened on the same pool)."""
    key = (handle.runtime, handle.handle)
    with _opened_lock:
        if key in _opened:
            runtime, pool, users = _opened[key]
            _opened[key] = (runtime, pool, users + 1)
            return pool
        runtime = runtime_for(handle.runtime)
        pool = runtime.open(handle, runtime.index_of(handle.device))
        _opened[key] = (runtime, pool, 1)
        return pool


def close_pool(handle: IpcHandle) -> None:
    """One user less; the last one closes the import (before the daemon may free)."""
    key = (handle.runtime, handle.handle)
    with _opened_lock:
        if key not in _opened:
            return
        runtime, pool, users = _opened.pop(key)
        if users > 1:
            _opened[key] = (runtime, pool, users - 1)
            return
    runtime.close(pool)


def synchronize_pool(handle: IpcHandle) -> None:
    with _opened_lock:
        opened = _opened.get((handle.runtime, handle.handle))
    if opened is not None:
        opened[0].synchronize(opened[1])


# Data path ---------------------------------------------------------------------------------

DIGEST_PIECE = 4 << 20
RUN_PIECE = 256 << 10  # bytes of runs summed at a time (``keyed_run_sums``)


class TensorDigest:
    """An entry's checksum in a device pool, computed with torch ops wherever the bytes are:
    xxh3-64 over the entry's length, the sum of its bytes and their sum weighted by position
    (weights cycle through 1..65521). Exact integers, so every device and the CPU agree; it
    catches zeroed, stale, shifted and torn blocks, not a deliberate forgery. Fed in pieces
    of any size, in order.

    Kept cheap where the bytes are (the first GPU run measured the int64 form at 20 GB/s on
    an H200, 75x slower than a copy of the bytes): products in int32 (a byte times a weight
    is under 2^24), weights sliced from one table per device, and the sums left on the
    device until ``intdigest``, so a gather of many extents waits on the device once."""

    def __init__(self) -> None:
        self.length = 0
        self.plain: int | torch.Tensor = 0
        self.weighted: int | torch.Tensor = 0
        self.gathered: torch.Tensor | None = None  # [plain, weighted] of fused gets

    def update(self, data: torch.Tensor) -> None:
        for lo in range(0, data.numel(), DIGEST_PIECE):
            piece = data[lo : lo + DIGEST_PIECE]
            phase = self.length % _MODULUS
            weights = _weights(piece.device)[phase : phase + piece.numel()]
            wide = piece.to(torch.int32)
            self.plain = self.plain + wide.sum(dtype=torch.int64)
            self.weighted = self.weighted + (wide * weights).sum(dtype=torch.int64)
            self.length += piece.numel()

    def add_gathered(self, nbytes: int, sums: torch.Tensor) -> None:
        """Feed ``nbytes`` more bytes summed elsewhere: ``sums`` is [plain, weighted] (int64),
        weighted from this digest's length on (``gather_triton``). Kept apart from the
        sums of ``update`` so that a fused get launches nothing more here."""
        self.gathered = sums if self.gathered is None else self.gathered + sums
        self.length += nbytes

    def intdigest(self) -> int:
        sums = [self.plain, self.weighted]
        if isinstance(sums[0], torch.Tensor) and isinstance(sums[1], torch.Tensor):
            sums = torch.stack((sums[0], sums[1])).tolist()  # one wait on the device
        plain, weighted = int(sums[0]), int(sums[1])
        if self.gathered is not None:
            more = self.gathered.tolist()  # a fused get: its one wait
            plain, weighted = plain + more[0], weighted + more[1]
        return digest_of_sums(self.length, plain, weighted)


def keyed_run_sums(
    data: torch.Tensor, starts: torch.Tensor, length: int, weights: Weights
) -> torch.Tensor:
    """The two keyed sums (``keyed_digest``; ``weights``: a ``SumKey``'s tables for the
    entry), int64 [2] on the bytes' device, of runs of an entry's bytes: ``data`` (uint8)
    holds runs of ``length`` bytes one after another, the run at ``starts[i]`` (int64) in
    the entry i-th. Parts that together hold each of the entry's bytes once have sums that
    add up (mod ``MODULUS``) to the entry's. On the CPU: numba's loop (``runs_kernel``);
    elsewhere torch's (``keyed_run_sums_torch``)."""
    if data.device.type == "cpu":
        from chunkstore.protocol.runs_kernel import sums_of_runs

        return torch.from_numpy(sums_of_runs(data.numpy(), starts.numpy(), length, *weights))
    return keyed_run_sums_torch(data, starts, length, weights)


def keyed_run_sums_torch(
    data: torch.Tensor, starts: torch.Tensor, length: int, weights: Weights
) -> torch.Tensor:
    """``keyed_run_sums`` in torch's int64 ops, on any device (a device pool's; tested on
    the CPU): each span's products added up, then weighted by its outer weight."""
    if not len(weights[0]):  # ``NO_LANES``: a copy alone
        return torch.zeros(0, dtype=torch.int64, device=data.device)
    inner, outer = (torch.from_numpy(w.astype(np.int64)).to(data.device) for w in weights)
    spans = torch.zeros(outer.shape, dtype=torch.int64, device=data.device)  # under 2^50 each
    step = max(1, RUN_PIECE // length)  # runs at a time: the temporaries stay in cache
    offsets = torch.arange(length, device=data.device)
    runs = data.view(-1, length)
    for lo in range(0, runs.shape[0], step):
        at = (starts[lo : lo + step, None] + offsets).flatten()
        wide = runs[lo : lo + step].flatten().to(torch.int64)
        which, within = at // SPAN, at % SPAN
        for lane in range(spans.shape[0]):
            spans[lane].index_add_(0, which, wide * inner[lane, within])
    return (spans % MODULUS * outer % MODULUS).sum(1) % MODULUS


_weight_tables: dict[torch.device, torch.Tensor] = {}


def _weights(device: torch.device) -> torch.Tensor:
    """int32 weights (k % 65521) + 1 for k < DIGEST_PIECE + 65521, once per device: a piece
    starting at position p takes its weights from p % 65521 on."""
    table = _weight_tables.get(device)
    if table is None:
        k = torch.arange(DIGEST_PIECE + _MODULUS, dtype=torch.int32, device=device)
        table = _weight_tables[device] = k % _MODULUS + 1
    return table


def tensor_bytes(t: torch.Tensor) -> torch.Tensor:
    """A tensor's bytes as a flat uint8 tensor on its own device."""
    return t.detach().contiguous().view(torch.uint8).reshape(-1)


def scatter_tensors(
    pool: torch.Tensor,
    blocks: Sequence[int],
    block_size: int,
    parts: Sequence[torch.Tensor],
    digest: TensorDigest,
) -> None:
    """Copy ``parts`` (flat uint8, in order) into the entry's blocks, hashing each source."""
    at = 0
    for part in parts:
        done = 0
        for start, length in extents(blocks, block_size, at, at + part.numel()):
            source = part[done : done + length]
            pool[start : start + length].copy_(source, non_blocking=True)
            digest.update(source)
            done += length
        at += part.numel()


_WORDS = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}


def gather_runs(
    pool: torch.Tensor,
    blocks: Sequence[int],
    block_size: int,
    starts: torch.Tensor,
    length: int,
    out: torch.Tensor,
    weights: Weights,
) -> torch.Tensor:
    """Runs of ``length`` bytes of the entry, at ``starts`` (int64, on the pool's device),
    copied into ``out`` (uint8, one after another, on the pool's device) in one gather of the
    widest words that divide them, and their ``keyed_run_sums``: a context-parallel rank's
    part of an entry, checked with the other ranks' parts. On the CPU (a mapped pool, the
    fake device): gathered and summed in one pass by numba's loop (``runs_kernel``)."""
    if pool.device.type == "cpu":
        args = (pool.numpy(), blocks, block_size, starts.numpy(), length, out.numpy(), weights)
        return torch.tensor(gather_runs_summed(*args))
    word = next(
        w
        for w in _WORDS
        if length % w == 0
        and block_size % w == 0
        and pool.numel() % w == 0
        and pool.data_ptr() % w == 0
        and out.data_ptr() % w == 0
        and not bool((starts % w).any())
    )
    per_run, per_block = length // word, block_size // word
    at = (starts // word)[:, None] + torch.arange(per_run, device=pool.device)
    table = torch.as_tensor(list(blocks), dtype=torch.int64, device=pool.device)
    where = (table[at // per_block] * per_block + at % per_block).flatten()
    torch.index_select(pool.view(_WORDS[word]), 0, where, out=out.view(_WORDS[word]))
    return keyed_run_sums(out, starts, length, weights)


def gather_tensor(
    pool: torch.Tensor,
    blocks: Sequence[int],
    block_size: int,
    out: torch.Tensor,
    digest: TensorDigest,
) -> None:
    """Copy the entry's blocks into ``out`` (flat uint8) and hash them into ``digest``: in one
    pass where the pool's device has the fused get (``fused_gather_for``; the digest is of the
    bytes stored into ``out``), else a copy per extent, then a hash of the pool's bytes (a
    change made before or during the copy shows as a mismatch)."""
    fused = fused_gather_for(pool.device.type) if out.device == pool.device else None
    if fused is not None:
        digest.add_gathered(out.numel(), fused(pool, list(blocks), block_size, out, digest.length))
    else:
        gather_with_torch(pool, blocks, block_size, out, digest)


def gather_with_torch(
    pool: torch.Tensor,
    blocks: Sequence[int],
    block_size: int,
    out: torch.Tensor,
    digest: TensorDigest,
) -> None:
    """``gather_tensor`` on torch ops, any device: a copy per extent, then its digest."""
    done = 0
    for start, length in extents(blocks, block_size, 0, out.numel()):
        out[done : done + length].copy_(pool[start : start + length])
        digest.update(pool[start : start + length])
        done += length


class FusedGather(Protocol):
    """``gather_triton.gather_with_sums``: the entry in ``blocks`` of ``pool`` into ``out``,
    returning ``TensorDigest``'s two sums of its bytes (weights from ``phase`` on) as one
    int64 tensor [plain, weighted] on the device."""

    def __call__(
        self, pool: torch.Tensor, blocks: list[int], block_size: int, out: torch.Tensor, phase: int
    ) -> torch.Tensor: ...


FUSED_GATHER_DEVICES = ("cuda", "npu")  # CPU pools (the fake device) gather with torch ops
_fused_gathers: dict[str, FusedGather | None] = {}
gather_problems: dict[str, str] = {}  # device type -> why the fused get does not serve it


def fused_gather_for(device_type: str) -> FusedGather | None:
    """The fused Triton get for pools on this device type, or None (torch ops copy and hash):
    loaded once per device type, used only where triton imports and the kernel's self-check
    passes on the device (else said once in the log, and why kept in ``gather_problems``)."""
    if device_type not in _fused_gathers:
        _fused_gathers[device_type] = (
            _load_fused_gather(device_type) if device_type in FUSED_GATHER_DEVICES else None
        )
    return _fused_gathers[device_type]


def _load_fused_gather(device_type: str) -> FusedGather | None:
    try:
        from chunkstore.device.gather_triton import gather_with_sums, self_check
    except ImportError as exc:
        problem: str | None = f"triton unavailable ({exc})"
    else:
        problem = self_check(device_type, TensorDigest)
    if problem:
        gather_problems[device_type] = problem
        log.warning(
            "fused Triton get not used for %s pools: %s; copying and hashing with torch ops",
            device_type,
            problem,
        )
        return None
    return gather_with_sums
