"""``chunkstore bench device``: the device paths' figures, each against a plain copy of the same
bytes on the same device, timed side by side (ratios are medians of per-round ratios):

- ``remap_write``: a chunk written into a paged cache with its keys re-rotated on the device
  (``write_chunk``, the device's writer, named in the row) against ``copy_`` of as many bytes;
- ``remap_write_triton``: the same through the fused Triton kernel (``kv/writer_triton``),
  checked bit for bit against the torch writer on the device, with the torch writer's GB/s
  beside it and whether the kernel's self-check passed; where triton does not import, or on
  the CPU (its writer is numba), the row says why it is absent;
- ``ipc_get``: an entry read from a daemon's device pool (``--device cuda|npu``, ``fake`` on
  a CPU host) through the client (the pool imported by IPC, the blocks gathered, checked by
  ``TensorDigest``: in one fused Triton kernel where the device has it, the row's ``gather``)
  against a device-to-device copy of as many bytes (cudaMemcpy);
- ``ipc_get_triton``: the same entry's get without the client around it, through the fused
  kernel (``device/gather_triton``: gather and digest in one pass, the digest compared with
  the committed checksum), with today's torch gather (a copy per extent, then the digest's
  passes) timed beside it (``torch_get_gb_s``); on the CPU (a fake pool), or where triton does
  not import or its self-check failed, the row says why it is absent;
- ``host_pool``: an entry of a shared-memory pool copied into device memory with the mapping
  registered with the runtime (pinned: DMA) against the same mapping unregistered
  (pageable: staged through a bounce buffer). Pinning needs CUDA: elsewhere only pageable.

Every figure is checked for bytes: a fast wrong copy does not count. Uses no vLLM, Redis or
transformers (it runs in the device check on a bare GPU machine)."""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from chunkstore.client import ChunkStoreClient
from chunkstore.device import device_ipc
from chunkstore.device.device_ipc import TensorDigest, accelerators, gather_with_torch
from chunkstore.kv.paging import slot_mapping
from chunkstore.kv.remap import remap_keys
from chunkstore.kv.rope import RotaryConfig
from chunkstore.kv.writer import Writer, triton_problem, write_chunk, write_torch, writer_for
from chunkstore.processes.daemon import memory_dir, start_daemon
from chunkstore.protocol.convert import LeasedEntry
from chunkstore.protocol.shm import extents

MIB = 1 << 20
IPC_KEY, HOST_KEY = b"bench-device-ipc", b"bench-device-hst"  # 16 bytes each


def run(args: argparse.Namespace) -> Iterator[dict[str, Any]]:
    device = args.device if args.device != "auto" else (accelerators() or ["cpu"])[0]
    sync = _synchronizer(device)
    yield _remap_write(args, device, sync)
    with tempfile.TemporaryDirectory(prefix="chunkstore-bench-device-") as scratch:
        yield from _ipc_get(args, device, sync, Path(scratch))
        yield _host_pool(args, device, sync, Path(scratch))
    yield _remap_write_triton(args, device, sync)  # last: new, it must not cost the others


def _synchronizer(device: str) -> Callable[[], None]:
    module = getattr(torch, device, None) if device != "cpu" else None
    return module.synchronize if module is not None else (lambda: None)


def _timed(fn: Callable[[], Any], sync: Callable[[], None]) -> float:
    sync()
    began = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - began


def _rounds(
    measured: Callable[[], Any], baseline: Callable[[], Any], sync: Callable[[], None], n: int
) -> tuple[list[float], list[float]]:
    measured(), baseline()  # warm up (kernels load, pages fault in)
    pairs = [(_timed(measured, sync), _timed(baseline, sync)) for _ in range(n)]
    return [m for m, _ in pairs], [b for _, b in pairs]


def _figures(
    name: str, nbytes: int, measured: list[float], baseline: list[float]
) -> dict[str, Any]:
    m = statistics.median(measured)
    return {
        f"{name}_ms_p50": round(m * 1e3, 3),
        f"{name}_gb_s": round(nbytes / m / 1e9, 2),
        "ratio_vs_baseline": round(
            statistics.median(x / y for x, y in zip(measured, baseline, strict=True)), 3
        ),
    }


class _PagedChunk:
    """A chunk of bf16 keys and values and a paged cache to write it into, on the device:
    ``args.layers`` x ``args.tokens`` x 8 KV heads x 128 dims, slots in shuffled blocks."""

    def __init__(self, args: argparse.Namespace, device: str) -> None:
        layers, tokens, heads, dim, block_size = args.layers, args.tokens, 8, 128, 16
        self.rotary = RotaryConfig(head_dim=dim, rotary_dim=dim, theta=1e6)
        g = torch.Generator().manual_seed(0)
        blocks = -(-tokens // block_size) + 8
        table = torch.randperm(blocks, generator=g)[None]
        positions = torch.arange(100, 100 + tokens)
        self.slots = slot_mapping(torch.zeros_like(positions), positions, table, block_size)
        self.slots = self.slots.to(device)
        shape = (layers, tokens, heads, dim)
        self.keys = torch.randn(shape, generator=g).to(torch.bfloat16).to(device)
        self.values = torch.randn(shape, generator=g).to(torch.bfloat16).to(device)
        cache_shape = (layers, blocks, block_size, heads, dim)
        self.key_cache = torch.zeros(cache_shape, dtype=torch.bfloat16, device=device)
        self.value_cache = torch.zeros_like(self.key_cache)
        self.source = torch.cat((self.keys.reshape(-1), self.values.reshape(-1)))
        self.target = torch.empty_like(self.source)
        self.nbytes = 2 * self.keys.numel() * self.keys.element_size()

    def write(self, writer: Writer | None = None) -> None:
        write_chunk(
            self.keys,
            self.values,
            self.key_cache,
            self.value_cache,
            self.slots,
            1234,
            self.rotary,
            writer,
        )

    def copy(self) -> None:
        self.target.copy_(self.source)


def _remap_write(args: argparse.Namespace, device: str, sync: Callable[[], None]) -> dict[str, Any]:
    chunk = _PagedChunk(args, device)
    measured, baseline = _rounds(chunk.write, chunk.copy, sync, args.repeats)
    layers, _, heads, dim = chunk.keys.shape
    flat = chunk.key_cache.view(layers, -1, heads, dim)
    expected = remap_keys(chunk.keys[-1].float().cpu(), 1234, chunk.rotary)
    error = float((flat[-1, chunk.slots].float().cpu() - expected).abs().max())
    if error > 2 * torch.finfo(torch.bfloat16).eps * float(expected.abs().max()):
        raise AssertionError(f"remap_write on {device} wrote keys {error} off the reference")
    return {
        "bench": "device",
        "part": "remap_write",
        "device": device,
        "writer": "torch" if writer_for(device) is write_torch else "fused",
        "dtype": "bfloat16",
        "bytes": chunk.nbytes,
        **_figures("remap_write", chunk.nbytes, measured, baseline),
        "copy_gb_s": round(chunk.nbytes / statistics.median(baseline) / 1e9, 2),
    }


def _remap_write_triton(
    args: argparse.Namespace, device: str, sync: Callable[[], None]
) -> dict[str, Any]:
    row: dict[str, Any] = {"bench": "device", "part": "remap_write_triton", "device": device}
    if device == "cpu":
        return {**row, "triton": "unavailable on the CPU (its writer is numba: remap_write)"}
    try:
        import triton

        from chunkstore.kv.writer_triton import write_triton
    except ImportError as exc:
        return {**row, "triton": f"unavailable ({exc})"}
    chunk = _PagedChunk(args, device)
    chunk.write(write_torch)
    by_torch = chunk.key_cache.clone(), chunk.value_cache.clone()
    measured_torch, _ = _rounds(lambda: chunk.write(write_torch), chunk.copy, sync, args.repeats)
    chunk.key_cache.zero_()
    chunk.value_cache.zero_()
    measured, baseline = _rounds(lambda: chunk.write(write_triton), chunk.copy, sync, args.repeats)
    written = chunk.key_cache, chunk.value_cache
    if not all(torch.equal(a, b) for a, b in zip(written, by_torch, strict=True)):
        raise AssertionError(f"the Triton writer on {device} wrote other bits than torch ops")
    return {
        **row,
        "triton": triton.__version__,
        "self_check": triton_problem(device) or "passed",
        "dtype": "bfloat16",
        "bytes": chunk.nbytes,
        **_figures("remap_write_triton", chunk.nbytes, measured, baseline),
        "copy_gb_s": round(chunk.nbytes / statistics.median(baseline) / 1e9, 2),
        "torch_writer_gb_s": round(chunk.nbytes / statistics.median(measured_torch) / 1e9, 2),
    }


def _daemon(scratch: Path, name: str, *flags: str, pool_bytes: int) -> Any:
    return start_daemon(
        scratch / name,
        *flags,
        pool_bytes=pool_bytes,
        block_size=MIB,
        shm_dir=memory_dir(pool_bytes) or scratch,
    )


def _ipc_get(
    args: argparse.Namespace, device: str, sync: Callable[[], None], scratch: Path
) -> Iterator[dict[str, Any]]:
    """The ``ipc_get`` row, then ``ipc_get_triton``'s, from one daemon and one entry (the
    new row after the old one is out: it must not cost it)."""
    pool_device = device if device in ("cuda", "npu") else "fake"
    nbytes = args.mib * MIB
    daemon = _daemon(scratch, "ipc", "--device", pool_device, pool_bytes=2 * nbytes + 4 * MIB)
    try:
        with ChunkStoreClient(daemon.unix, transport="shm") as client:
            if client.device_pool is None:
                raise AssertionError(
                    f"no device pool imported from a --device {pool_device} daemon"
                )
            half = nbytes // 8  # keys and values, fp32
            keys = torch.randn(2, half // 2, dtype=torch.float32, device=device)
            values = torch.randn(2, half // 2, dtype=torch.float32, device=device)
            assert client.put(IPC_KEY, keys[:, :, None, None], values[:, :, None, None], 0)
            [entry] = client.acquire([IPC_KEY])
            assert entry is not None
            out = torch.empty(entry.nbytes, dtype=torch.uint8, device=device)
            source = torch.cat((keys.reshape(-1), values.reshape(-1))).view(torch.uint8)
            plain = torch.empty_like(source)
            measured, baseline = _rounds(
                lambda: client.read_into(entry, out),
                lambda: plain.copy_(source),
                sync,
                args.repeats,
            )
            if not torch.equal(out[: source.numel()], source):
                raise AssertionError("the IPC read returned other bytes than were put")
            fused = device_ipc.fused_gather_for(client.device_pool.device.type)
            yield {
                "bench": "device",
                "part": "ipc_get",
                "device": device,
                "pool": pool_device,
                "gather": "torch" if fused is None else "fused",
                "bytes": entry.nbytes,
                **_figures("ipc_get", entry.nbytes, measured, baseline),
                "memcpy_gb_s": round(entry.nbytes / statistics.median(baseline) / 1e9, 2),
            }
            yield _ipc_get_triton(
                args, device, sync, client.device_pool, client.block_size, entry, source
            )
            client.release([entry.lease_id])
    finally:
        daemon.stop()


def _ipc_get_triton(
    args: argparse.Namespace,
    device: str,
    sync: Callable[[], None],
    pool: torch.Tensor,
    block_size: int,
    entry: LeasedEntry,
    source: torch.Tensor,
) -> dict[str, Any]:
    """A leased entry of the opened pool got by the fused kernel and by torch ops, each
    checked against the committed checksum, against a device copy of the entry's bytes."""
    row: dict[str, Any] = {"bench": "device", "part": "ipc_get_triton", "device": device}
    kind = pool.device.type
    fused = device_ipc.fused_gather_for(kind)
    if fused is None:
        why = device_ipc.gather_problems.get(kind, f"{kind} pools gather with torch ops")
        return {**row, "triton": f"unavailable ({why})"}
    import triton

    out = torch.empty(entry.nbytes, dtype=torch.uint8, device=pool.device)
    copied = torch.empty_like(out)
    verdicts: list[bool] = []

    def fused_get() -> None:
        digest = TensorDigest()
        digest.add_gathered(out.numel(), fused(pool, entry.blocks, block_size, out, 0))
        verdicts.append(digest.intdigest() == entry.checksum)

    def torch_get() -> None:
        digest = TensorDigest()
        gather_with_torch(pool, entry.blocks, block_size, out, digest)
        verdicts.append(digest.intdigest() == entry.checksum)

    measured_torch, _ = _rounds(torch_get, lambda: copied.copy_(out), sync, args.repeats)
    out.zero_()
    measured, baseline = _rounds(fused_get, lambda: copied.copy_(out), sync, args.repeats)
    if not all(verdicts) or not torch.equal(out[: source.numel()], source):
        raise AssertionError(f"the fused get on {device} served other bytes than were put")
    return {
        **row,
        "triton": triton.__version__,
        "self_check": "passed",
        "bytes": entry.nbytes,
        **_figures("ipc_get_triton", entry.nbytes, measured, baseline),
        "memcpy_gb_s": round(entry.nbytes / statistics.median(baseline) / 1e9, 2),
        "torch_get_gb_s": round(entry.nbytes / statistics.median(measured_torch) / 1e9, 2),
    }


def _host_pool(
    args: argparse.Namespace, device: str, sync: Callable[[], None], scratch: Path
) -> dict[str, Any]:
    nbytes = args.mib * MIB
    daemon = _daemon(scratch, "host", pool_bytes=2 * nbytes + 4 * MIB)
    pin = device if device != "cpu" else ""
    try:
        with (
            ChunkStoreClient(daemon.unix, transport="shm", pin_for=pin) as pinned,
            ChunkStoreClient(daemon.unix, transport="shm") as pageable,
        ):
            keys = torch.randn(2, nbytes // 16, 1, 1)
            assert pinned.put(HOST_KEY, keys, keys, 0)
            [entry] = pinned.acquire([HOST_KEY])
            assert entry is not None and pinned.region is not None and pageable.region is not None
            out = torch.empty(entry.nbytes, dtype=torch.uint8, device=device)

            def copy_from(region: Any) -> Callable[[], None]:
                def copy() -> None:
                    done = 0
                    for start, length in extents(entry.blocks, pinned.block_size, 0, entry.nbytes):
                        piece = torch.from_numpy(region[start : start + length])
                        out[done : done + length].copy_(piece, non_blocking=True)
                        done += length

                return copy

            measured, baseline = _rounds(
                copy_from(pinned.region), copy_from(pageable.region), sync, args.repeats
            )
            want = torch.cat((keys.reshape(-1), keys.reshape(-1))).view(torch.uint8)
            if not torch.equal(out[: want.numel()].cpu(), want):
                raise AssertionError("the host pool's bytes arrived changed")
            was_pinned = pinned.pinned
            pinned.release([entry.lease_id])
    finally:
        daemon.stop()
    figures = _figures("pinned", entry.nbytes, measured, baseline)
    return {
        "bench": "device",
        "part": "host_pool",
        "device": device,
        "pinned": was_pinned,
        "bytes": entry.nbytes,
        **figures,
        "pageable_gb_s": round(entry.nbytes / statistics.median(baseline) / 1e9, 2),
    }


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--device",
        default="auto",
        choices=["auto", "cuda", "npu", "cpu"],
        help="where to run (auto: the first accelerator torch sees, else the CPU)",
    )
    parser.add_argument("--mib", type=int, default=64, help="entry size for the pool parts")
    parser.add_argument("--tokens", type=int, default=4096, help="chunk length (remap_write)")
    parser.add_argument("--layers", type=int, default=28, help="layers (remap_write)")
    parser.add_argument("--repeats", type=int, default=10, help="timed rounds per figure")
