"""Device pools (``--device cuda|npu|fake``): one device allocation the daemon exports by IPC,
opened once by each same-node worker process, entries as offsets into it, freed only after
every importer closed. Across real processes: a real daemon, workers as child processes, on
each ``pool_device`` (conftest.py): the CPU stand-in for a device (``device/fake_device.py``,
named FAKE) always, a real GPU / NPU where the host has one.

The fake must refuse what the drivers refuse, or these tests would prove nothing: the first
tests check that."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from chunkstore.client import ChunkStoreClient
from chunkstore.device.device_ipc import TensorDigest, keyed_run_sums, parse_device
from chunkstore.device.device_runtime import IpcHandle
from chunkstore.device.fake_device import ENV, FakeDeviceIPC
from chunkstore.errors import ChecksumMismatch, DeviceError, InvalidRequest
from chunkstore.processes.daemon import memory_dir, serve_env
from chunkstore.protocol.keyed_digest import SumKey, keyed_sums, packed
from chunkstore.testing.entries import entry_key, random_kv, wait_for


def child(code: str, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    """A Python process running ``code`` (a worker); it prints "ready" when set up."""
    environment = {**serve_env(), **(env or {})}
    return subprocess.Popen(
        [sys.executable, "-c", code],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=environment,
    )


def finish(process: subprocess.Popen[str], stdin: str = "") -> str:
    out, err = process.communicate(stdin, timeout=120)
    assert process.returncode == 0, err
    return out


def handle_text(handle: IpcHandle) -> str:
    return repr(handle)


OPEN_AND_WAIT = """
import sys
from chunkstore.errors import DeviceError
from chunkstore.device.device_runtime import IpcHandle
from chunkstore.device.fake_device import FakeDeviceIPC
handle = {handle}
ipc = FakeDeviceIPC()
pool = ipc.open(handle, ipc.index_of(handle.device))
print("first bytes", pool[:4].tolist(), flush=True)
try:
    ipc.open(handle, ipc.index_of(handle.device))
except DeviceError as err:
    print("second import refused:", err, flush=True)
print("ready", flush=True)
if sys.stdin.readline().strip() == "close":
    ipc.close(pool)
    print("closed", flush=True)
"""


# The fake keeps the drivers' contracts ----------------------------------------------------


def test_the_fake_refuses_what_the_drivers_refuse(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV, "GPU-aaaa,GPU-bbbb")
    exporter = FakeDeviceIPC()
    pool = exporter.allocate(1, 1 << 16)
    pool[:4] = torch.tensor([1, 2, 3, 4], dtype=torch.uint8)
    handle = exporter.export(pool)
    assert handle.device == "GPU-bbbb"  # identity, not the ordinal 1
    # The exporting process cannot import its own memory.
    with pytest.raises(DeviceError, match="exported itself"):
        exporter.open(handle, 1)
    # A worker that sees the devices in another order finds the pool by identity; opened on
    # the ordinal the daemon used (1: another device there) it is refused.
    worker = child(OPEN_AND_WAIT.format(handle=handle_text(handle)), {ENV: "GPU-bbbb,GPU-aaaa"})
    assert worker.stdout is not None
    lines = [worker.stdout.readline() for _ in range(3)]
    assert lines[0].strip() == "first bytes [1, 2, 3, 4]", lines
    assert "second import refused" in lines[1]  # one import per process
    assert exporter.importers(pool) == [worker.pid]
    wrong = FakeDeviceIPC()
    monkeypatch.setenv(ENV, "GPU-bbbb,GPU-aaaa")
    with pytest.raises(DeviceError, match="opened on fake:1"):
        wrong.open(handle, 1)
    # Freeing under a live importer is refused (undefined on a device).
    with pytest.raises(DeviceError, match="still import"):
        exporter.free(pool)
    assert finish(worker, "close\n").strip().endswith("closed")
    assert exporter.importers(pool) == []
    exporter.free(pool)
    stale = child(TRY_OPEN.format(handle=handle_text(handle)), {ENV: "GPU-bbbb"})
    assert "was freed: the handle is stale" in finish(stale)


TRY_OPEN = """
from chunkstore.errors import DeviceError
from chunkstore.device.device_runtime import IpcHandle
from chunkstore.device.fake_device import FakeDeviceIPC
handle = {handle}
try:
    FakeDeviceIPC().open(handle, 0)
except DeviceError as err:
    print(err)
"""


def test_a_dead_importer_does_not_hold_the_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV, raising=False)
    exporter = FakeDeviceIPC()
    pool = exporter.allocate(0, 1 << 16)
    handle = exporter.export(pool)
    worker = child(OPEN_AND_WAIT.format(handle=handle_text(handle)))
    assert worker.stdout is not None
    while worker.stdout.readline().strip() != "ready":
        pass
    assert exporter.importers(pool) == [worker.pid]
    worker.send_signal(signal.SIGKILL)
    worker.wait()
    assert exporter.importers(pool) == []  # the driver drops a dead process's imports
    exporter.free(pool)


def test_device_names_and_digests() -> None:
    assert parse_device("cuda:1") == ("cuda", 1)
    assert parse_device("fake") == ("fake", 0)
    for bad in ("tpu", "cuda:x", "npu:-1"):
        with pytest.raises(InvalidRequest, match="unknown pool device"):
            parse_device(bad)
    data = torch.randint(0, 256, (10_000,), dtype=torch.uint8)
    whole, pieces = TensorDigest(), TensorDigest()
    whole.update(data)
    for lo in range(0, 10_000, 777):
        pieces.update(data[lo : lo + 777])
    assert whole.intdigest() == pieces.intdigest()  # fed in any pieces, the same
    flipped = data.clone()
    flipped[5000] ^= 1
    shifted = data.clone()
    shifted[:10] = data[10:20]
    for other in (flipped, shifted, data[:-1], torch.zeros_like(data)):
        changed = TensorDigest()
        changed.update(other)
        assert changed.intdigest() != whole.intdigest()
    # Bytes split any way over several readers (context-parallel ranks), each summing its own
    # at their offsets in the entry under the lease's key: the sums add up to the whole's
    # keyed sums; a byte counted at another offset does not.
    data = torch.randint(0, 256, (200_000,), dtype=torch.uint8)
    weights = SumKey.fresh().tables(data.numel())
    whole = keyed_sums(data.numpy(), 0, *weights)
    owners = torch.randint(0, 3, (data.numel(),), generator=torch.Generator().manual_seed(1))
    held = [(owners == reader).nonzero().flatten() for reader in range(3)]
    total = sum(keyed_run_sums(data[at], at, 1, weights) for at in held)
    assert packed(total.tolist()) == packed(whole)
    total = sum(
        keyed_run_sums(data[at], at + (reader == 1), 1, weights) for reader, at in enumerate(held)
    )
    assert packed(total.tolist()) != packed(whole)


# The pool, served by a real daemon --------------------------------------------------------

WORKER = """
import sys, torch
from chunkstore.client import ChunkStoreClient
from chunkstore.testing.entries import entry_key, random_kv
client = ChunkStoreClient({address!r}, transport="shm")
print(client.transport, flush=True)
keys, values = random_kv(40, seed=1)
got = client.get(entry_key(1))
assert torch.equal(got.keys, keys) and torch.equal(got.values, values), "wrong bytes"
keys, values = random_kv(300, seed=2)
assert client.put(entry_key(2), keys, values, 7)
print("ready", flush=True)
if sys.stdin.readline().strip() == "close":
    client.close()
    print("closed", flush=True)
"""


def test_a_device_pool_serves_workers_in_several_processes(serve, pool_device: str) -> None:
    daemon = serve("--device", pool_device, block_size=1 << 12)
    with ChunkStoreClient(daemon.unix, transport="shm") as writer:
        assert writer.transport == "ipc" and writer.device_pool is not None
        assert writer.server_info.device == f"{parse_device(pool_device)[0]}:0"
        keys, values = random_kv(40, seed=1)
        assert writer.put(entry_key(1), keys, values, 0)
        worker = child(WORKER.format(address=daemon.unix))
        assert worker.stdout is not None
        assert worker.stdout.readline().strip() == "ipc"
        assert worker.stdout.readline().strip() == "ready", worker.stderr.read()  # type: ignore[union-attr]
        assert writer.stats().pool_importers == 2
        # What the worker wrote (across many blocks) reads back here, checked.
        keys, values = random_kv(300, seed=2)
        got = writer.get(entry_key(2))
        assert got is not None and got.layout.virtual_start == 7
        assert torch.equal(got.keys, keys) and torch.equal(got.values, values)
        assert finish(worker, "close\n").strip().endswith("closed")
        wait_for(lambda: writer.stats().pool_importers == 1)
        # A client on the stream (another host, as far as it knows) keeps the device pool's
        # checksum, so both kinds of reader agree on every entry.
        with ChunkStoreClient(daemon.unix, transport="stream") as remote:
            assert remote.transport == "stream" and remote.device_pool is None
            assert torch.equal(remote.get(entry_key(2)).values, values)  # type: ignore[union-attr]
            assert remote.put(entry_key(3), keys[:, :5], values[:, :5], 0)
        assert torch.equal(writer.get(entry_key(3)).keys, keys[:, :5])  # type: ignore[union-attr]
    assert daemon.scrape()["chunkstore_pool_importers"] == 0


def test_bytes_changed_in_a_device_pool_are_never_served(serve, pool_device: str) -> None:
    daemon = serve("--device", pool_device, block_size=1 << 12)
    with ChunkStoreClient(daemon.unix) as client:
        keys, values = random_kv(64, seed=3)
        assert client.put(entry_key(1), keys, values, 0)
        [entry] = client.acquire([entry_key(1)])
        assert entry is not None and client.device_pool is not None
        block = entry.blocks[len(entry.blocks) // 2] * client.block_size
        client.device_pool[block + 100] ^= 0xFF  # a stray write into the pool
        # Read on the pool's device: a GPU's get then gathers and hashes in one kernel.
        out = torch.empty(entry.nbytes, dtype=torch.uint8, device=client.device_pool.device)
        with pytest.raises(ChecksumMismatch):
            client.read_into(entry, out)
        client.release([entry.lease_id])
        assert client.get(entry_key(1)) is None  # the daemon checked it and evicted it
        assert client.stats().evictions["corrupt"] == 1


WORKER_LEASE = """
import sys
from chunkstore.client import ChunkStoreClient
from chunkstore.testing.entries import entry_key
client = ChunkStoreClient({address!r}, transport="shm")
[entry] = client.acquire([entry_key(1)])
assert entry is not None
print("ready", flush=True)
sys.stdin.readline()
"""


def test_a_killed_importer_leaves_the_pool_serving(serve, pool_device: str) -> None:
    """A worker killed while it imports the pool and holds a lease: the daemon drops its
    import and its lease, the entry is served and evictable again, the daemon stops clean."""
    daemon = serve("--device", pool_device, block_size=1 << 12)
    with ChunkStoreClient(daemon.unix, transport="shm") as client:
        keys, values = random_kv(64, seed=5)
        assert client.put(entry_key(1), keys, values, 0)
        worker = child(WORKER_LEASE.format(address=daemon.unix))
        assert worker.stdout is not None
        assert worker.stdout.readline().strip() == "ready", worker.stderr.read()  # type: ignore[union-attr]
        assert client.stats().pool_importers == 2 and client.stats().active_leases == 1
        assert client.evict([entry_key(1)]).busy == 1  # leased: not evicted
        worker.send_signal(signal.SIGKILL)
        worker.wait()
        wait_for(lambda: client.stats().pool_importers == 1, timeout=30)
        wait_for(lambda: client.stats().active_leases == 0, timeout=30)
        got = client.get(entry_key(1))
        assert got is not None and torch.equal(got.keys, keys) and torch.equal(got.values, values)
        assert client.evict([entry_key(1)]).evicted == 1


def test_the_daemon_frees_its_device_pool_only_after_every_importer_closed(
    serve, tmp_path: Path
) -> None:
    """A worker killed while holding the pool lets it go; one alive past the drain keeps the
    memory allocated (the daemon says so and exits); the last importer to close frees it.
    On the fake only: it watches the fake's backing file."""
    daemon = serve("--device", "fake", "--drain-timeout-s", "1")
    with ChunkStoreClient(daemon.unix) as probe:
        handle = IpcHandle.from_proto(probe.server_info.device_pool)
    memory = Path(handle.handle.decode().partition("|")[0])
    assert memory.exists()
    killed, kept = (
        child(WORKER_OPEN.format(address=daemon.unix)),
        child(WORKER_OPEN.format(address=daemon.unix)),
    )
    for worker in (killed, kept):
        assert worker.stdout is not None and worker.stdout.readline().strip() == "ready"
    wait_for(lambda: daemon.scrape()["chunkstore_pool_importers"] == 2)
    killed.send_signal(signal.SIGKILL)
    killed.wait()
    wait_for(lambda: daemon.scrape()["chunkstore_pool_importers"] == 1)
    assert daemon.stop() == 0  # drains, waits 1 s for `kept`, leaves the memory to it
    assert "not freed" in daemon.log() and "still import" in daemon.log()
    assert memory.exists()
    assert finish(kept, "close\n").strip().endswith("closed")
    assert not memory.exists()  # the last importer closed after the exporter left


WORKER_OPEN = """
import sys
from chunkstore.client import ChunkStoreClient
client = ChunkStoreClient({address!r}, transport="shm")
print("ready", flush=True)
if sys.stdin.readline().strip() == "close":
    client.close()
    print("closed", flush=True)
"""


def test_device_pools_refuse_what_they_cannot_serve(serve, tmp_path: Path) -> None:
    from chunkstore.processes.daemon import serve_command

    run = subprocess.run(
        serve_command(tmp_path, "--device", "tpu"),
        capture_output=True,
        text=True,
        timeout=60,
        env=serve_env(),
    )
    assert run.returncode == 2 and "unknown pool device 'tpu'" in run.stderr
    env = {**serve_env(), ENV: "GPU-only-one"}
    run = subprocess.run(
        serve_command(tmp_path, "--device", "fake:3"),
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert run.returncode != 0 and "sees 1 fake devices" in run.stderr


# Pinned host pools ------------------------------------------------------------------------


def test_a_shared_memory_pool_is_pinned_for_a_gpu(serve, accelerator: str) -> None:
    """A CPU pool read by device workers: the client registers its mapping with the device
    runtime, so copies to the device run as DMA (CUDA only: torch_npu has no host-register
    call, and a CPU needs none; those read it pageable). The pool lies where a deployed
    daemon keeps it, /dev/shm: cudaHostRegister refuses a mapping of a file on a disk
    (error 1, first GPU run; the client then warns and reads it pageable)."""
    daemon = serve(shm_dir=memory_dir(64 << 20))
    with ChunkStoreClient(daemon.unix, transport="shm", pin_for=accelerator) as client:
        pinnable = accelerator == "cuda"
        assert client.pinned == pinnable
        assert torch.from_numpy(client.region).is_pinned() == pinnable
        keys, values = random_kv(64)
        assert client.put(entry_key(1), keys.to(accelerator), values.to(accelerator), 0)
        [entry] = client.acquire([entry_key(1)])
        assert entry is not None
        out = torch.empty(entry.nbytes, dtype=torch.uint8)
        out = out.pin_memory() if pinnable else out
        client.read_into(entry, out)
        client.release([entry.lease_id])
        got = out.to(accelerator).view(torch.float32)[: keys.numel()].view(keys.shape)
        assert torch.equal(got.cpu(), keys)


def test_a_pool_that_cannot_be_pinned_is_used_pageable(
    serve, caplog: pytest.LogCaptureFixture
) -> None:
    daemon = serve()
    with ChunkStoreClient(daemon.unix, transport="shm", pin_for="npu") as client:
        assert not client.pinned
        assert "pool not pinned for npu: torch_npu has no host-register call" in caplog.text
        keys, values = random_kv(8)
        assert client.put(entry_key(1), keys, values, 0)
        assert torch.equal(client.get(entry_key(1)).keys, keys)  # type: ignore[union-attr]


EXPORT_AND_WAIT = """
from chunkstore.device.fake_device import FakeDeviceIPC
ipc = FakeDeviceIPC()
pool = ipc.allocate(0, 1 << 16)
print(ipc.export(pool).handle.decode().partition("|")[0], flush=True)
input()
"""


def test_memory_of_an_exporter_that_died_goes_with_it() -> None:
    """As the driver frees a killed process's allocations, the fake's next allocation sweeps
    a dead exporter's file (none is left behind by a SIGKILLed daemon)."""
    exporter = child(EXPORT_AND_WAIT)
    assert exporter.stdout is not None
    memory = Path(exporter.stdout.readline().strip())
    assert memory.exists()
    exporter.send_signal(signal.SIGKILL)
    exporter.wait()
    ipc = FakeDeviceIPC()
    ipc.free(ipc.allocate(0, 1 << 12))
    assert not memory.exists()
