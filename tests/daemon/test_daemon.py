"""The daemon as a running process, talked to over its real unix socket and TCP port."""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import grpc
import numpy as np
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from chunkstore.client import ChunkStoreClient
from chunkstore.errors import (
    AlreadyExists,
    ChecksumMismatch,
    Exhausted,
    InvalidRequest,
    NotFound,
    Unauthenticated,
    WrongState,
)
from chunkstore.kv.entry import EntryLayout, layout_of, tensors_of
from chunkstore.processes.daemon import (
    MEMORY_POOL_BYTES,
    RunningDaemon,
    memory_dir,
    serve_command,
    serve_env,
    socket_path,
)
from chunkstore.protocol import chunkstore_pb2 as pb
from chunkstore.protocol.convert import layout_to_proto
from chunkstore.protocol.shm import Pieces
from chunkstore.testing.entries import entry_key, random_kv, wait_for


@pytest.fixture
def daemon(serve) -> RunningDaemon:
    return serve("--lease-ttl-s", "2", "--verify-commits", "true")


@pytest.mark.parametrize("transport", ["shm", "stream"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_put_then_get_returns_the_same_bytes(daemon: RunningDaemon, transport, dtype) -> None:
    address = daemon.unix if transport == "shm" else daemon.tcp
    with ChunkStoreClient(address, transport=transport) as client:
        assert client.transport == transport
        k, v = random_kv(100, dtype=dtype)
        assert client.put(entry_key(1), k, v, virtual_start=12)
        assert not client.put(entry_key(1), k, v, virtual_start=12)  # present already
        got = client.get(entry_key(1))
        assert got is not None and got.layout.virtual_start == 12
        assert torch.equal(got.keys, k) and torch.equal(got.values, v)
        assert client.get(entry_key(2)) is None
        assert client.lookup([entry_key(1), entry_key(2)]) == [100, None]


@pytest.mark.parametrize("transport", ["shm", "stream"])
def test_a_packed_entry_read_into_pieces_keeps_every_byte_in_order(
    daemon: RunningDaemon, transport: str
) -> None:
    """An entry held as a cache's raw blocks (``put_packed``) comes back with its packing,
    and read into pieces of uneven sizes (a cache's blocks; here across the 1 MiB stripes
    and the pool's blocks) every byte lands where it belongs, checked."""
    address = daemon.unix if transport == "shm" else daemon.tcp
    with ChunkStoreClient(address, transport=transport) as client:
        blocks = torch.randn(4, 40, 4, 16, 128)  # [layers, blocks, heads, block, 2 * dim]
        layout = EntryLayout(4, 4, 64, "float32", "kv", 40 * 16, 32, "prefix", "test/raw/16")
        with pytest.raises(InvalidRequest, match="do not hold layout"):
            client.put_packed(entry_key(1), layout, blocks[:, 1:])
        assert client.put_packed(entry_key(1), layout, blocks)
        [entry] = client.acquire([entry_key(1)])
        assert entry is not None and entry.layout == layout
        cuts = sorted(torch.randperm(layout.nbytes - 1)[:60].add(1).tolist())
        sizes = [b - a for a, b in zip([0, *cuts], [*cuts, layout.nbytes], strict=True)]
        pieces = [np.full(n, 7, dtype=np.uint8) for n in sizes]
        assert client.read_each([entry], [Pieces(pieces)]) == [None]
        assert np.array_equal(np.concatenate(pieces), blocks.view(-1).view(torch.uint8).numpy())
        with pytest.raises(InvalidRequest, match="or pieces"):
            client.read_each([entry], [Pieces(pieces[1:])])


@pytest.mark.parametrize("transport", ["shm", "stream"])
def test_many_entries_read_in_one_call_are_each_checked(
    daemon: RunningDaemon, transport: str
) -> None:
    address = daemon.unix if transport == "shm" else daemon.tcp
    with ChunkStoreClient(address, transport=transport) as client:
        stored = [random_kv(tokens, seed=tokens) for tokens in (1, 37, 700, 3)]  # odd sizes
        for i, (k, v) in enumerate(stored):
            assert client.put(entry_key(i), k, v, 0)
        entries = client.acquire([entry_key(i) for i in range(len(stored))])
        assert all(entries)
        outs = [torch.empty(e.nbytes, dtype=torch.uint8) for e in entries]  # type: ignore[union-attr]
        client.read_many(entries, outs)  # type: ignore[arg-type]
        for entry, out, (k, v) in zip(entries, outs, stored, strict=True):
            keys, values = tensors_of(out, entry.layout)  # type: ignore[union-attr]
            assert torch.equal(keys, k) and torch.equal(values, v)
        with pytest.raises(InvalidRequest, match="uint8 tensor"):
            client.read_many(entries[:1], [outs[1]])  # type: ignore[list-item]
        if transport == "shm":  # one bad entry among good ones fails the call, and is evicted
            assert client.region is not None and entries[2] is not None
            client.region[entries[2].blocks[0] * client.block_size] ^= 0xFF
            with pytest.raises(ChecksumMismatch, match=entry_key(2).hex()):
                client.read_many(entries, outs)  # type: ignore[arg-type]
            assert client.lookup([entry_key(i) for i in range(4)]) == [1, 37, None, 3]
        client.release([e.lease_id for e in entries if e is not None])


def test_other_processes_read_what_one_wrote(daemon: RunningDaemon) -> None:
    with ChunkStoreClient(daemon.unix) as client:
        k, v = random_kv(64, seed=5)
        client.put(entry_key(7), k, v, 0)
    reader = (
        "import torch, sys\n"
        "from chunkstore.client import ChunkStoreClient\n"
        f"c = ChunkStoreClient({daemon.unix!r})\n"
        "got = c.get((7).to_bytes(16, 'little'))\n"
        "g = torch.Generator().manual_seed(5)\n"
        "k = torch.randn((2, 64, 3, 64), generator=g)\n"
        "sys.exit(0 if c.transport == 'shm' and torch.equal(got.keys, k) else 1)\n"
    )
    assert subprocess.run([sys.executable, "-c", reader], timeout=60).returncode == 0


def test_health_service_answers_serving(daemon: RunningDaemon) -> None:
    with grpc.insecure_channel(daemon.tcp) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        for service in ("", "chunkstore.v1.ChunkStore"):
            reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING


def test_a_daemon_in_a_deep_directory_listens_on_a_short_socket_path(serve, tmp_path) -> None:
    """A unix socket's path holds 107 bytes: a test's (or a bench's) deep temporary
    directory gets its socket in a private directory under /tmp instead."""
    assert socket_path(tmp_path) == tmp_path / "chunkstore.sock"
    deep = tmp_path / ("d" * 60)
    short = socket_path(deep)
    assert (
        short.parent.parent == Path("/tmp") and stat.S_IMODE(short.parent.stat().st_mode) == 0o700
    )
    short.parent.rmdir()
    daemon = serve(name="d" * 60)
    with ChunkStoreClient(daemon.unix) as client:
        assert client.put(entry_key(1), *random_kv(2), 0)


def test_sigusr1_writes_every_threads_stack_to_the_log_and_serving_goes_on(
    daemon: RunningDaemon,
) -> None:
    """What an operator (and the test fixture's log) gets from a daemon that will not stop."""
    daemon.process.send_signal(signal.SIGUSR1)
    log = daemon.workdir / "daemon.log"
    wait_for(lambda: "Thread 0x" in log.read_text(), timeout=10)
    assert 'workers.py", line' in log.read_text()  # the background threads' frames
    with ChunkStoreClient(daemon.unix) as client:
        assert client.put(entry_key(1), *random_kv(2), 0)


def test_socket_and_pool_are_private_to_the_user(daemon: RunningDaemon) -> None:
    for path in (daemon.ready["socket"], daemon.ready["fast"], daemon.ready["shm_path"]):
        mode = stat.S_IMODE(os.stat(path).st_mode)
        assert mode & 0o077 == 0, f"{path} is {oct(mode)}"


def test_bad_input_gets_typed_errors_and_the_daemon_stays_healthy(daemon: RunningDaemon) -> None:
    with ChunkStoreClient(daemon.tcp, transport="stream") as client:
        stub, s = client.stub, client.session
        layout = layout_of(*random_kv(4), 0)
        with pytest.raises(InvalidRequest, match="16 bytes"):  # malformed key
            client.lookup([b"short"])
        with pytest.raises(InvalidRequest, match="never fit"):  # oversized entry
            big = layout_of(*random_kv(8), 0)
            big = type(big)(**{**big.__dict__, "num_tokens": 10**6})
            client._call(
                stub.Reserve,
                pb.ReserveRequest(
                    session_id=s, key=entry_key(1), layout=layout_to_proto(big), nbytes=big.nbytes
                ),
            )
        with pytest.raises(InvalidRequest, match="do not match"):  # layout vs bytes
            client._call(
                stub.Reserve,
                pb.ReserveRequest(
                    session_id=s,
                    key=entry_key(1),
                    layout=layout_to_proto(layout),
                    nbytes=layout.nbytes + 4,
                ),
            )
        with pytest.raises(InvalidRequest, match="keys"):
            client.lookup([entry_key(1)] * 5000)
        with pytest.raises(NotFound):  # unknown lease
            client.release([424242])
        with pytest.raises(NotFound):  # unknown session
            client._call(stub.Acquire, pb.AcquireRequest(session_id="nope", keys=[entry_key(1)]))
        res = client._call(
            stub.Reserve,
            pb.ReserveRequest(
                session_id=s, key=entry_key(1), layout=layout_to_proto(layout), nbytes=layout.nbytes
            ),
        )
        with pytest.raises(AlreadyExists):
            client._call(
                stub.Reserve,
                pb.ReserveRequest(
                    session_id=s,
                    key=entry_key(1),
                    layout=layout_to_proto(layout),
                    nbytes=layout.nbytes,
                ),
            )
        with pytest.raises(ChecksumMismatch):  # nothing was written: the bytes do not match
            client._call(
                stub.Commit,
                pb.CommitRequest(session_id=s, reservation_id=res.reservation_id, checksum=12345),
            )
        with pytest.raises(WrongState, match="aborted"):  # commit after (implied) abort
            client._call(
                stub.Commit, pb.CommitRequest(session_id=s, reservation_id=res.reservation_id)
            )
        k, v = random_kv(4)
        assert client.put(entry_key(2), k, v, 0)
        # A message over the daemon's size limit is refused by gRPC itself.
        with pytest.raises(Exhausted):
            client._call(stub.Lookup, pb.LookupRequest(keys=[b"x" * (65 << 20)]))
        assert client.get(entry_key(2)) is not None  # everything else intact
    with grpc.insecure_channel(daemon.tcp) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())
        assert reply.status == health_pb2.HealthCheckResponse.SERVING


def test_a_full_pool_answers_resource_exhausted_and_stays_healthy(serve) -> None:
    running = serve(pool_bytes=1 << 20, block_size=1 << 16)
    with ChunkStoreClient(running.unix) as client:
        k, v = random_kv(300)  # 2 * 2 * 300 * 3 * 64 * 4 = 921600 bytes: 15 of 16 blocks
        assert client.put(entry_key(1), k, v, 0)
        [lease] = client.acquire([entry_key(1)])  # leased: cannot be evicted
        assert lease is not None
        with pytest.raises(Exhausted):
            client.put(entry_key(2), *random_kv(300), 0)
        client.release([lease.lease_id])
        assert client.put(entry_key(2), *random_kv(300), 0)  # now the old one is evicted for it
        stats = client.stats()
        assert stats.entries == 1 and stats.evictions["capacity"] == 1


def test_a_wrong_token_is_refused(serve) -> None:
    running = serve("--token", "s3cret")
    with pytest.raises(Unauthenticated):
        ChunkStoreClient(running.tcp, token="wrong")
    with pytest.raises(Unauthenticated):
        ChunkStoreClient(running.tcp)
    with ChunkStoreClient(running.tcp, token="s3cret", transport="stream") as client:
        assert client.put(entry_key(1), *random_kv(4), 0)


def serve_tcp_only(tcp: str, shm_dir: Path) -> subprocess.CompletedProcess[str]:
    """``chunkstore serve`` on a TCP address alone, for start-ups that must fail."""
    command = serve_command(
        shm_dir, "--tcp", tcp, "--socket", "", "--metrics", "", pool_bytes=1 << 20
    )
    return subprocess.run(command, capture_output=True, text=True, timeout=60, env=serve_env())


def test_non_loopback_tcp_without_a_token_is_refused(tmp_path: Path) -> None:
    run = serve_tcp_only("0.0.0.0:0", tmp_path)
    assert run.returncode == 2 and "refusing to listen on 0.0.0.0:0" in run.stderr
    assert not list(tmp_path.iterdir())  # nothing was created


KILLED_WRITER = """
import os, torch
from chunkstore.client import ChunkStoreClient
from chunkstore.kv.entry import layout_of
from chunkstore.protocol import chunkstore_pb2 as pb
from chunkstore.protocol.shm import Pieces
from chunkstore.protocol.convert import layout_to_proto
c = ChunkStoreClient({address!r}, transport="stream")
k = torch.zeros(2, 64, 3, 64)
layout = layout_of(k, k, 0)
res = c._call(c.stub.Reserve, pb.ReserveRequest(session_id=c.session, key=b"w" * 16,
              layout=layout_to_proto(layout), nbytes=layout.nbytes))
def pieces():
    yield pb.WritePiece(session_id=c.session, reservation_id=res.reservation_id,
                        data=b"\\0" * 1000)
    os._exit(9)  # dies halfway through the write
c._call(c.stub.Write, pieces())
"""

KILLED_READER = """
import os
from chunkstore.client import ChunkStoreClient
c = ChunkStoreClient({address!r})
[lease] = c.acquire([(1).to_bytes(16, "little")])
assert lease is not None
print("leased", flush=True)
os._exit(9)  # dies while holding the lease
"""


def test_a_client_killed_mid_write_or_mid_read_leaves_nothing_held(daemon: RunningDaemon) -> None:
    with ChunkStoreClient(daemon.unix) as client:
        client.put(entry_key(1), *random_kv(16), 0)
        for script in (KILLED_WRITER, KILLED_READER):
            run = subprocess.run(
                [sys.executable, "-c", script.format(address=daemon.unix)],
                capture_output=True,
                text=True,
                timeout=60,
            )
            assert run.returncode == 9, run.stderr
        wait_for(
            lambda: client.stats().active_reservations == 0 and client.stats().active_leases == 0
        )
        stats = client.stats()
        assert stats.entries == 1 and stats.sessions == 1  # only ours is left
        assert client.lookup([b"w" * 16]) == [None]  # the half write never became readable


def test_sigterm_drains_and_exits_zero(serve) -> None:
    running = serve("--drain-timeout-s", "1")
    client = ChunkStoreClient(running.unix)
    client.put(entry_key(1), *random_kv(4), 0)
    [lease] = client.acquire([entry_key(1)])
    assert lease is not None
    began = time.monotonic()
    assert running.stop() == 0
    assert 0.9 <= time.monotonic() - began < 20  # waited for the lease, within the bound
    assert "draining" in running.log()
    assert not Path(running.ready["shm_path"]).exists()
    assert not Path(running.ready["socket"]).exists()


def test_metrics_move_exactly_as_the_operations(daemon: RunningDaemon) -> None:
    with ChunkStoreClient(daemon.unix) as client:
        before = daemon.scrape()
        k, v = random_kv(10)
        client.put(entry_key(1), k, v, 0)
        client.put(entry_key(2), *random_kv(20), 0)
        client.lookup([entry_key(1), entry_key(2), entry_key(3)], num_tokens=[10, 20, 30])
        client.lookup([entry_key(3)], num_tokens=[30])
        client.get(entry_key(1))
        # An Acquire that looks up (the connector's scheduler); other clients read under its
        # lease, through shared memory and through the stream, and it reports their bytes.
        lease, missing = client.acquire([entry_key(1), entry_key(3)], num_tokens=[10, 30])
        assert lease is not None and missing is None
        for transport in ("shm", "stream"):
            with ChunkStoreClient(daemon.unix, transport=transport) as reader:
                buffer = torch.empty(lease.nbytes, dtype=torch.uint8)
                reader.read_into(lease, buffer, session=client.session)
                assert torch.equal(tensors_of(buffer, lease.layout)[0], k)
        client.release([lease.lease_id], shm_bytes_read=lease.nbytes)
        client.evict([entry_key(2)])
        with pytest.raises(InvalidRequest):
            client.lookup([b"bad"])
        after = daemon.scrape()
    delta = {name: after.get(name, 0.0) - before.get(name, 0.0) for name in after}
    nbytes = 2 * k.numel() * 4
    assert delta["chunkstore_lookup_chunks_total"] == 4 + 2
    assert delta["chunkstore_hit_chunks_total"] == 2 + 1
    assert delta["chunkstore_lookup_tokens_total"] == 90 + 40
    assert delta["chunkstore_hit_tokens_total"] == 30 + 10
    assert delta['chunkstore_bytes_total{direction="read",transport="grpc"}'] == nbytes
    assert delta['chunkstore_evictions_total{reason="admin"}'] == 1
    assert delta['chunkstore_bytes_total{direction="write",transport="shm"}'] == nbytes * 3
    assert delta['chunkstore_bytes_total{direction="read",transport="shm"}'] == 2 * nbytes
    assert after["chunkstore_entries"] == 1
    assert after["chunkstore_pool_bytes_used"] == 65536  # one 64 KiB block holds entry_key(1)
    assert after["chunkstore_pool_bytes_capacity"] == 64 << 20
    assert delta['chunkstore_errors_total{code="INVALID_ARGUMENT"}'] == 1
    assert delta['chunkstore_rpc_seconds_count{method="Lookup"}'] == 3


def test_lookups_and_entries_are_counted_by_kind(daemon: RunningDaemon) -> None:
    """Prefix blocks and chunk segments share the pool and are told apart only by the
    metrics: lookups and hits by the kind the client names, entries and bytes by the kind
    they were stored as; an unknown kind is refused before anything is leased."""
    with ChunkStoreClient(daemon.unix) as client:
        before = daemon.scrape()
        k, v = random_kv(10)
        client.put(entry_key(11), k, v, 0, "prefix")
        client.put(entry_key(12), k, v, 0)
        client.acquire([entry_key(11), entry_key(13)], [10, 10], "prefix")
        client.lookup([entry_key(12)], [10])
        with pytest.raises(InvalidRequest, match="entry_kind"):
            client.acquire([entry_key(12)], [10], "disk")
        with pytest.raises(InvalidRequest, match="entry_kind"):
            client.put(entry_key(14), k, v, 0, "disk")
        after = daemon.scrape()
        stats = client.stats()
    delta = {name: after.get(name, 0.0) - before.get(name, 0.0) for name in after}
    for kind, looked_up, hit in (("prefix", 20, 10), ("chunk", 10, 10)):
        assert delta[f'chunkstore_lookup_tokens_by_kind_total{{kind="{kind}"}}'] == looked_up
        assert delta[f'chunkstore_hit_tokens_by_kind_total{{kind="{kind}"}}'] == hit
        assert delta[f'chunkstore_entries_by_kind{{kind="{kind}"}}'] == 1
        assert delta[f'chunkstore_entry_bytes_by_kind{{kind="{kind}"}}'] == 2 * k.numel() * 4
        assert stats.kinds[kind].entries >= 1
    assert delta["chunkstore_lookup_tokens_total"] == 30  # the totals hold every kind
    assert stats.kinds["prefix"].hit_tokens >= 10
    assert stats.active_leases == 1  # the refused Acquire took none


def test_a_port_in_use_fails_start_up_cleanly(daemon: RunningDaemon, tmp_path: Path) -> None:
    run = serve_tcp_only(daemon.tcp, tmp_path)
    assert run.returncode == 2 and daemon.tcp in run.stderr
    assert not list(tmp_path.glob("chunkstore-*"))  # the pool file was removed


def test_admin_calls_work_at_any_size(serve) -> None:
    """Clear of 10k entries (it used to send every key through the 4,096-key batch limit
    and clear nothing); evict and pin of more keys than one call takes."""
    daemon = serve(pool_bytes=12_000 * 4096, block_size=4096)
    k, v = random_kv(1, heads=1, head_dim=4)
    keys = [entry_key(i) for i in range(10_000)]
    with ChunkStoreClient(daemon.unix) as client:
        for key in keys:
            assert client.put(key, k, v, 0)
        assert client.pin(keys[:5000]) == 5000
        assert client.unpin(keys[:4500]) == 4500
        reply = client.evict(keys[:5000])
        assert (reply.evicted, reply.busy) == (4500, 500)
        reply = client.clear()
        assert (reply.evicted, reply.busy) == (5000, 500)
        stats = client.stats()
        assert (stats.entries, stats.pinned_entries) == (500, 500)
        assert client.unpin(keys[4500:5000]) == 500
    cleared = subprocess.run(
        [sys.executable, "-m", "chunkstore.cli", "clear", "--address", daemon.unix],
        capture_output=True,
        text=True,
        env=serve_env(),
        timeout=60,
    )
    assert cleared.returncode == 0, cleared.stderr
    with ChunkStoreClient(daemon.unix) as client:
        assert client.stats().entries == 0


def test_large_test_pools_take_memory_not_the_test_disk(serve, tmp_path: Path) -> None:
    """A CI run once failed with its temporary directory's disk under 1 GiB free: test
    daemons' pools are preallocated, and the large ones lived there. From MEMORY_POOL_BYTES up
    a pool goes to /dev/shm where memory can hold it; a small one stays beside the test's
    files; the pool of a daemon that was killed is removed when it is stopped."""
    large = serve(name="large", pool_bytes=MEMORY_POOL_BYTES)
    small = serve(name="small", pool_bytes=1 << 20)
    pool = Path(large.ready["shm_path"])
    assert pool.parent == (memory_dir(MEMORY_POOL_BYTES) or tmp_path / "large")
    assert Path(small.ready["shm_path"]).parent == tmp_path / "small"
    large.process.send_signal(signal.SIGKILL)
    large.process.wait()
    assert pool.exists()  # nobody removed it: the daemon died
    large.stop()
    assert not pool.exists()
