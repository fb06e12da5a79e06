"""The daemon under faults (issue: healthy while useless): start-up over what a dead or live
daemon left behind, and requests that must change all or nothing. Real ``chunkstore serve``
processes, real signals."""

from __future__ import annotations

import itertools
import os
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from chunkstore.client import ChunkStoreClient, as_bytes
from chunkstore.errors import (
    Busy,
    ChecksumMismatch,
    Exhausted,
    Forbidden,
    InvalidRequest,
    NotFound,
    PoolFull,
    SessionLost,
    WrongState,
)
from chunkstore.kv.entry import layout_of
from chunkstore.kv.sparse import EntryBlocks, block_digests
from chunkstore.processes.daemon import RunningDaemon, serve_command, serve_env, start_daemon
from chunkstore.processes.redis import RedisServer
from chunkstore.protocol import chunkstore_pb2 as pb
from chunkstore.protocol.convert import layout_to_proto
from chunkstore.protocol.shm import EntryDigest
from chunkstore.protocol.wire import error_of, status_of
from chunkstore.testing.entries import entry_key, random_kv, wait_for


def serve_once(workdir: Path, *flags: str) -> subprocess.CompletedProcess[str]:
    """A ``chunkstore serve`` whose start-up must fail (it would block if it started)."""
    command = serve_command(workdir, *flags, pool_bytes=1 << 20)
    return subprocess.run(command, capture_output=True, text=True, timeout=60, env=serve_env())


def test_a_second_daemon_on_a_live_socket_refuses_and_leaves_the_first_reachable(
    serve, tmp_path: Path
) -> None:
    first = serve()
    socket_path = first.ready["socket"]
    # Same socket, and a TCP port that is taken: it used to delete the socket, then fail.
    run = serve_once(tmp_path / "daemon", "--tcp", first.tcp)
    assert run.returncode == 2, run.stderr
    assert f"another daemon is serving on {socket_path}" in run.stderr
    with ChunkStoreClient(first.unix) as client:
        assert client.put(entry_key(1), *random_kv(4), 0)


def test_a_stale_socket_is_replaced_and_a_non_socket_is_refused(serve, tmp_path: Path) -> None:
    dead = start_daemon(tmp_path / "daemon")
    dead.process.kill()  # SIGKILL: the socket and the pool file stay behind
    dead.process.wait()
    assert Path(dead.ready["socket"]).exists()
    again = serve()  # the same directory: its socket is stale
    with ChunkStoreClient(again.unix) as client:
        assert client.stats().entries == 0
    blocker = tmp_path / "other" / "chunkstore.sock"
    blocker.parent.mkdir(mode=0o700)
    blocker.write_text("not a socket")
    run = serve_once(tmp_path / "other")
    assert run.returncode == 2 and "is not a socket; refusing to replace it" in run.stderr
    assert blocker.read_text() == "not a socket"


@pytest.mark.parametrize("mode", [0o777, 0o1777, 0o770], ids=oct)
def test_a_socket_directory_others_can_write_is_refused(tmp_path: Path, mode: int) -> None:
    workdir = tmp_path / "shared"
    workdir.mkdir()
    workdir.chmod(mode)
    run = serve_once(workdir)
    assert run.returncode == 2, run.stderr
    assert f"socket directory {workdir} is owned by uid" in run.stderr
    assert "writable by nobody else" in run.stderr
    assert not list(workdir.glob("chunkstore-*"))  # no pool file left either


def test_a_group_writable_socket_directory_is_fine_with_group_access(serve, tmp_path: Path) -> None:
    workdir = tmp_path / "daemon"
    workdir.mkdir()
    workdir.chmod(0o770)
    running = serve("--group-access")
    with ChunkStoreClient(running.unix) as client:
        assert client.put(entry_key(1), *random_kv(4), 0)


def test_pool_files_of_dead_daemons_are_reclaimed_at_start_up(serve, tmp_path: Path) -> None:
    workdir = tmp_path / "daemon"
    dead = start_daemon(workdir, pool_bytes=1 << 20)
    dead.process.send_signal(signal.SIGKILL)
    dead.process.wait()
    (workdir / "chunkstore.sock").unlink()
    ended = subprocess.Popen(["true"])  # a pid whose process has ended
    ended.wait()
    older = workdir / f"chunkstore-{os.getuid()}-{ended.pid}-0000"
    older.write_bytes(bytes(1 << 20))
    left = [Path(dead.ready["shm_path"]), older]
    assert all(p.exists() for p in left)
    # Not ours to take: a live process's pool, and a file that only looks like a pool.
    live = workdir / f"chunkstore-{os.getuid()}-{os.getppid()}-live"
    live.write_bytes(b"x")
    odd = workdir / f"chunkstore-{os.getuid()}-notapid-x"
    odd.write_bytes(b"x")
    running = serve(pool_bytes=1 << 20)
    assert not any(p.exists() for p in left)
    assert live.exists() and odd.exists()
    assert Path(running.ready["shm_path"]).exists()
    log = running.log()
    assert all(f"removed {p} (1048576 bytes)" in log for p in left), log


def test_a_reserve_that_cannot_fit_evicts_nothing(serve) -> None:
    running = serve(pool_bytes=1 << 20, block_size=1 << 16)  # 16 blocks
    with ChunkStoreClient(running.unix) as client:
        small = [entry_key(i) for i in range(4)]
        for i, k in enumerate(small):
            assert client.put(k, *random_kv(40, seed=i), 0)  # 2 blocks each
        [lease] = client.acquire([entry_key(0)])
        pinned = entry_key(9)
        assert client.put(pinned, *random_kv(100, seed=9), 0)  # 5 blocks
        client.pin([pinned])
        # 15 blocks of 16 are free or evictable only after the leased and pinned ones go.
        with pytest.raises(Exhausted, match="evictable"):
            client.put(entry_key(20), *random_kv(300), 0)
        stats = client.stats()
        assert stats.entries == 5 and not stats.evictions.get("capacity")
        assert all(client.lookup(small + [pinned]))
        client.release([lease.lease_id])


def test_pin_with_an_unknown_key_pins_nothing(daemon: RunningDaemon) -> None:
    with ChunkStoreClient(daemon.unix) as client:
        assert client.put(entry_key(1), *random_kv(4), 0)
        with pytest.raises(NotFound, match=entry_key(2).hex()):
            client.pin([entry_key(1), entry_key(2)])
        assert client.stats().pinned_entries == 0
        assert client.pin([entry_key(1), entry_key(1)]) == 1
        with pytest.raises(NotFound):
            client.unpin([entry_key(1), entry_key(3)])
        assert client.stats().pinned_entries == 1


@pytest.fixture
def daemon(serve) -> RunningDaemon:
    return serve("--lease-ttl-s", "2")


PAUSED_WRITER = """
import sys
import numpy as np, torch
from chunkstore.client import ChunkStoreClient, as_bytes
from chunkstore.errors import StoreError
from chunkstore.kv.entry import layout_of
from chunkstore.kv.sparse import EntryBlocks, block_digests
from chunkstore.protocol import chunkstore_pb2 as pb
from chunkstore.protocol.shm import scatter
from chunkstore.protocol.shm import EntryDigest
from chunkstore.protocol.convert import layout_to_proto
c = ChunkStoreClient({address!r}, transport="shm")
k = torch.zeros(2, 40, 3, 64)
layout = layout_of(k, k, 0)
res = c._call(c.stub.Reserve, pb.ReserveRequest(session_id=c.session, key=b"w" * 16,
              layout=layout_to_proto(layout), nbytes=layout.nbytes))
junk = np.full(layout.nbytes, 0xAB, dtype=np.uint8)
scatter(c.region, res.blocks, c.block_size, junk[: layout.nbytes // 2])
print("half written", flush=True)
sys.stdin.readline()  # SIGSTOPped here; resumed long past the TTL
scatter(c.region, res.blocks, c.block_size, junk)  # the late writer copies on, into its blocks
try:
    c._call(c.stub.Commit, pb.CommitRequest(session_id=c.session,
            reservation_id=res.reservation_id, checksum=0))
except StoreError as err:
    print(f"commit refused: {{type(err).__name__}}: {{err}}", flush=True)
c.close()
"""


def paused(script: str, address: str, ready: str) -> subprocess.Popen[str]:
    """Run a client script until it prints ``ready``, then SIGSTOP it (its stdin resumes it
    after a SIGCONT)."""
    process = subprocess.Popen(
        [sys.executable, "-c", script.format(address=address)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert process.stdout is not None and process.stdin is not None
    assert process.stdout.readline() == ready + "\n"
    process.send_signal(signal.SIGSTOP)
    return process


def resume(process: subprocess.Popen[str]) -> None:
    assert process.stdin is not None
    process.send_signal(signal.SIGCONT)
    process.stdin.write("go\n")
    process.stdin.flush()


def test_a_paused_writer_cannot_corrupt_another_keys_entry(serve) -> None:
    running = serve("--lease-ttl-s", "1", pool_bytes=1 << 20, block_size=1 << 16)
    writer = paused(PAUSED_WRITER, running.unix, "half written")
    assert writer.stdout is not None
    try:
        with ChunkStoreClient(running.unix) as client:
            wait_for(lambda: client.stats().active_reservations == 0)  # expired
            assert client.stats().blocks_quarantined == 2  # the writer lives: kept from others
            k, v = random_kv(40, seed=3)
            assert client.put(entry_key(1), k, v, 0)  # the pool has room elsewhere
            resume(writer)
            assert writer.stdout.readline().startswith("commit refused: WrongState")
            assert writer.wait(timeout=30) == 0
            stored = client.get(entry_key(1))  # untouched by the late writer
            assert stored is not None
            assert torch.equal(stored.keys, k) and torch.equal(stored.values, v)
            wait_for(lambda: client.stats().sessions == 1)
            stats = client.stats()
            assert stats.blocks_quarantined == 0 and stats.active_reservations == 0
            assert stats.blocks_free == 16 - 2  # only entry 1's blocks are held
    finally:
        writer.kill()


def test_quarantined_blocks_return_when_the_paused_writer_dies(serve) -> None:
    running = serve("--lease-ttl-s", "1", pool_bytes=1 << 20, block_size=1 << 16)
    writer = paused(PAUSED_WRITER, running.unix, "half written")
    with ChunkStoreClient(running.unix) as client:
        wait_for(lambda: client.stats().blocks_quarantined == 2)
        writer.kill()
        writer.wait()
        wait_for(lambda: client.stats().blocks_quarantined == 0)
        stats = client.stats()
        assert stats.blocks_free == 16 and stats.sessions == 1


def test_an_entry_that_fails_its_checksum_is_evicted_at_once(daemon: RunningDaemon) -> None:
    with (
        ChunkStoreClient(daemon.unix) as client,
        ChunkStoreClient(daemon.unix) as holder,
    ):
        k, v = random_kv(16)
        assert client.put(entry_key(1), k, v, 0)
        [held] = holder.acquire([entry_key(1)])  # another reader holds it meanwhile
        assert held is not None and client.region is not None
        client.region[held.blocks[0] * client.block_size + 5] ^= 0xFF  # a bit rots
        free_before = client.stats().blocks_free
        with pytest.raises(ChecksumMismatch):
            client.get(entry_key(1))
        assert client.lookup([entry_key(1)]) == [None]  # gone from the index at once
        assert client.stats().evictions["corrupt"] == 1
        assert client.stats().blocks_free == free_before  # the holder's lease keeps its blocks
        assert client.put(entry_key(1), k, v, 0)  # a re-put replaces it
        stored = client.get(entry_key(1))
        assert stored is not None and torch.equal(stored.keys, k)
        holder.release([held.lease_id])
        assert client.stats().blocks_free == free_before  # the bad copy's blocks are back...
        assert client.stats().entries == 1  # ...and the new one holds as many
        assert daemon.scrape()['chunkstore_evictions_total{reason="corrupt"}'] == 1
        assert f"entry {entry_key(1).hex()} failed its checksum" in daemon.log()


def test_one_rotten_entry_in_a_batch_read_fails_alone(daemon: RunningDaemon) -> None:
    """A worker reads a step's entries in one call (two threads, its own helper): the one
    that fails its checksum is reported, the others are read and checked as if alone."""
    with ChunkStoreClient(daemon.unix) as client, ThreadPoolExecutor(1) as helper:
        kvs = [random_kv(800, seed=i) for i in range(3)]  # three 1 MiB stripes each
        for i, (k, v) in enumerate(kvs):
            assert client.put(entry_key(10 + i), k, v, 0)
        held = client.acquire([entry_key(10 + i) for i in range(3)])
        assert all(h is not None for h in held) and client.region is not None
        entries = [h for h in held if h is not None]
        client.region[entries[1].blocks[-1] * client.block_size + 7] ^= 0xFF
        outs = [torch.empty(e.nbytes, dtype=torch.uint8) for e in entries]
        verdicts = client.read_each(entries, outs, threads=2, helper=helper)
        assert verdicts[0] is None and verdicts[2] is None
        assert isinstance(verdicts[1], ChecksumMismatch)
        for i in (0, 2):
            k, v = kvs[i]
            assert outs[i].numpy().tobytes() == as_bytes(k).tobytes() + as_bytes(v).tobytes()
        with pytest.raises(ChecksumMismatch):  # read_many raises the first failure
            client.read_many(entries[1:], outs[1:])


def test_a_read_of_some_blocks_is_checked_by_their_digests(daemon: RunningDaemon) -> None:
    """A sparse read (issue 74) copies only some blocks of an entry out of the pool and checks
    each against its block digest: the bytes a whole read gives there, counted as read; a
    rotten byte in a block it reads fails it (and the daemon evicts the entry), one in a
    block it skips does not; bad spans and the stream are refused, typed."""
    k, v = random_kv(100, seed=3)  # 2 layers, 100 tokens: 7 blocks of 16, the last of 4
    blocks = EntryBlocks.of(layout_of(k, v, 0), 16)
    digests = block_digests(k, v, 16)
    with ChunkStoreClient(daemon.unix) as client:
        assert client.put(entry_key(20), k, v, 0)
        [entry] = client.acquire([entry_key(20)])
        assert entry is not None and client.region is not None
        layer, picked = 1, [0, 3, 6]
        spans = blocks.spans(layer, picked)
        expected = blocks.expected(digests, layer, picked)
        out = torch.empty(sum(hi - lo for lo, hi in spans), dtype=torch.uint8)
        assert client.read_spans(entry, spans, expected, out) is None
        rows = torch.cat([torch.arange(i * 16, min(i * 16 + 16, 100)) for i in picked])
        want = torch.cat([k[layer, rows], v[layer, rows]]).contiguous().view(torch.uint8)
        assert torch.equal(out, want.reshape(-1))
        assert out.numel() < entry.nbytes / 4

        with pytest.raises(InvalidRequest):  # a span past the entry's end
            client.read_spans(
                entry,
                [(0, entry.nbytes + 1)],
                [0],
                torch.empty(entry.nbytes + 1, dtype=torch.uint8),
            )
        with pytest.raises(InvalidRequest):  # an out of another length
            client.read_spans(entry, spans, expected, out[1:])

        skipped = blocks.spans(layer, [1])[0][0]  # a byte of a block it does not read
        pool_at = entry.blocks[skipped // client.block_size] * client.block_size
        client.region[pool_at + skipped % client.block_size] ^= 0xFF
        assert client.read_spans(entry, spans, expected, out) is None
        client.region[pool_at + skipped % client.block_size] ^= 0xFF

        read = spans[2][0] + 5  # a byte of block 6's keys, which it reads
        pool_at = entry.blocks[read // client.block_size] * client.block_size
        client.region[pool_at + read % client.block_size] ^= 0xFF
        failure = client.read_spans(entry, spans, expected, out)
        assert isinstance(failure, ChecksumMismatch) and "1 of 6 spans" in str(failure)
        assert client.lookup([entry_key(20)]) == [None]  # the daemon checked it: evicted
        client.release([entry.lease_id])
        read_bytes = daemon.scrape()['chunkstore_bytes_total{direction="read",transport="shm"}']
        assert read_bytes == 3 * out.numel()  # the spans copied, never the whole entry
    with ChunkStoreClient(daemon.tcp, transport="stream") as client:
        assert client.put(entry_key(21), k, v, 0)
        [entry] = client.acquire([entry_key(21)])
        assert entry is not None
        with pytest.raises(InvalidRequest, match="shared-memory pool"):
            client.read_spans(entry, spans, expected, out)


def commit_unwritten(client: ChunkStoreClient, key: bytes) -> None:
    """A faulty writer: reserves, writes nothing, commits the checksum of bytes it meant to
    write."""
    k, v = random_kv(16)
    layout = layout_of(k, v, 0)
    res = client._call(
        client.stub.Reserve,
        pb.ReserveRequest(
            session_id=client.session, key=key, layout=layout_to_proto(layout), nbytes=layout.nbytes
        ),
    )
    digest = EntryDigest()
    digest.update(as_bytes(k).data)
    digest.update(as_bytes(v).data)
    client._call(
        client.stub.Commit,
        pb.CommitRequest(
            session_id=client.session,
            reservation_id=res.reservation_id,
            checksum=digest.intdigest(),
        ),
    )


def test_a_bad_write_committed_unverified_is_never_read(daemon: RunningDaemon) -> None:
    """By default a commit is not re-hashed (every read is): the bad entry is refused at its
    first read and evicted, and the next put replaces it."""
    with ChunkStoreClient(daemon.unix) as client:
        commit_unwritten(client, entry_key(1))
        assert client.lookup([entry_key(1)]) != [None]  # committed...
        with pytest.raises(ChecksumMismatch):
            client.get(entry_key(1))  # ...never served
        assert client.lookup([entry_key(1)]) == [None]
        assert client.stats().evictions["corrupt"] == 1
        k, v = random_kv(16, seed=3)
        assert client.put(entry_key(1), k, v, 0)
        stored = client.get(entry_key(1))
        assert stored is not None and torch.equal(stored.keys, k)


def test_verify_commits_refuses_a_bad_write_at_commit(serve) -> None:
    running = serve("--verify-commits", "true")
    with ChunkStoreClient(running.unix) as client:
        with pytest.raises(ChecksumMismatch, match="aborted"):
            commit_unwritten(client, entry_key(1))
        assert client.lookup([entry_key(1)]) == [None]
        assert client.stats().evictions["corrupt"] == 0


def test_a_client_reopens_its_session_after_the_daemon_restarts(serve, caplog) -> None:
    first = serve("--lease-ttl-s", "1")
    with ChunkStoreClient(first.unix, transport="shm") as client:
        assert client.put(entry_key(1), *random_kv(4), 0)
        old_session, old_pool = client.session, client.server_info.shm_path
        assert first.stop() == 0
        second = serve("--lease-ttl-s", "1")  # the same socket path, a new pool
        wait_for(lambda: client.sessions_reopened == 1, timeout=60)
        assert client.session != old_session
        assert client.server_info.shm_path == second.ready["shm_path"] != old_pool
        k, v = random_kv(8, seed=2)
        assert client.put(entry_key(2), k, v, 0)  # through the new pool's mapping
        stored = client.get(entry_key(2))
        assert stored is not None and torch.equal(stored.keys, k)
        assert client.lookup([entry_key(1)]) == [None]  # the old daemon's entries went with it
        assert client.stats().sessions == 1
        assert client.sessions_reopened == 1
    assert f"chunkstore session {old_session} at {first.unix} was lost" in caplog.text


def test_a_call_under_a_lost_session_raises_session_lost_and_the_client_reopens_it(
    serve, caplog
) -> None:
    """A daemon restarted between two heartbeats has forgotten the session before the
    heartbeat reopens it (a third of the lease TTL after its stream ended): the first call
    that notices opens a new session. One that refers to what the old session held raises
    SessionLost (by type: a NotFound, not an unknown lease); one that starts something is
    made again under the new session."""
    flags = ("--lease-ttl-s", "120", "--drain-timeout-s", "1")  # the heartbeat waits 40 s
    first = serve(*flags)
    with ChunkStoreClient(first.unix, transport="shm", fast=False) as client:
        assert client.put(entry_key(1), *random_kv(4), 0)
        [lease] = client.acquire([entry_key(1)])
        assert lease is not None
        old_session = client.session
        first.stop()
        serve(*flags)  # the same socket path, a new pool
        with pytest.raises(SessionLost, match="NOT_FOUND: no session"):
            client.release([lease.lease_id])
        assert client.sessions_reopened == 1 and client.session != old_session
        k, v = random_kv(8, seed=2)
        assert client.put(entry_key(2), k, v, 0)  # through the new pool's mapping
        stored = client.get(entry_key(2))
        assert stored is not None and torch.equal(stored.keys, k)
        assert client.sessions_reopened == 1
    assert f"chunkstore session {old_session} at {first.unix} was lost" in caplog.text


def test_session_lost_travels_by_type_over_grpc_and_the_fast_path(daemon: RunningDaemon) -> None:
    """NOT_FOUND answers an unknown session, key or lease alike; only the session's comes
    back as SessionLost, whichever way the call went."""
    with ChunkStoreClient(daemon.unix) as client:
        assert client.fast  # Acquire over the fast path; Abort has only gRPC
        acquire = pb.AcquireRequest(session_id="gone", keys=[entry_key(1)])
        with pytest.raises(SessionLost, match="NOT_FOUND: no session 'gone'"):
            client._call(client.stub.Acquire, acquire)
        abort = pb.AbortRequest(session_id="gone", reservation_id=1)
        with pytest.raises(SessionLost, match="NOT_FOUND: no session 'gone'"):
            client._call(client.stub.Abort, abort)
        with pytest.raises(NotFound, match="no lease") as unknown_lease:
            client.release([12345])
        assert not isinstance(unknown_lease.value, SessionLost)
        assert client.sessions_reopened == 0


def test_errors_the_code_alone_would_not_name_travel_by_name_with_their_message() -> None:
    """SessionLost (a NOT_FOUND) and PoolFull (a RESOURCE_EXHAUSTED, as Busy) come back as
    themselves; their siblings stay what their code says."""
    for err, kind in (
        (SessionLost("no session 'x'"), SessionLost),
        (PoolFull("need 8 blocks", needed=512), PoolFull),
        (NotFound("no lease 3"), NotFound),
        (Busy("64 sessions are open"), Exhausted),
    ):
        code, details = status_of(err)
        back = error_of(code.name, details)
        assert type(back) is kind and str(back) == f"{code.name}: {err}"


PAUSED_READER = """
import sys
from chunkstore.client import ChunkStoreClient, as_bytes
from chunkstore.errors import NotFound
from chunkstore.testing.entries import entry_key, random_kv
c = ChunkStoreClient({address!r})
[lease] = c.acquire([entry_key(1)])
print("leased", flush=True)
sys.stdin.readline()  # SIGSTOPped here, past the TTL
try:
    c.release([lease.lease_id])
except NotFound as err:
    print("lease expired:", err, flush=True)
assert c.put(entry_key(2), *random_kv(4, seed=2), 0)
assert c.get(entry_key(2)) is not None
print("reopened", c.sessions_reopened, flush=True)
c.close()
"""


def test_a_client_paused_past_the_ttl_keeps_its_session(daemon: RunningDaemon) -> None:
    with ChunkStoreClient(daemon.unix) as client:
        assert client.put(entry_key(1), *random_kv(4), 0)
        reader = paused(PAUSED_READER, daemon.unix, "leased")
        assert reader.stdout is not None
        try:
            wait_for(lambda: client.stats().active_leases == 0)  # its lease expired...
            assert client.stats().sessions == 2  # ...its session did not: its stream is open
            resume(reader)
            assert reader.stdout.readline().startswith("lease expired: NOT_FOUND: no lease")
            assert reader.stdout.readline() == "reopened 0\n"  # the same session served on
            assert reader.wait(timeout=30) == 0
        finally:
            reader.kill()


PAUSED_BEFORE_READING = """
import sys
import torch
from chunkstore.client import ChunkStoreClient
from chunkstore.errors import StoreError
from chunkstore.testing.entries import entry_key
c = ChunkStoreClient({address!r}, transport="shm", token="user")
[lease] = c.acquire([entry_key(1)])
print("leased", flush=True)
sys.stdin.readline()  # SIGSTOPped here, past the TTL: the blocks go to other entries
try:
    c.read_into(lease, torch.empty(lease.nbytes, dtype=torch.uint8))
    print("read", flush=True)
except StoreError as err:
    print(type(err).__name__, flush=True)
c.close()
"""


def test_a_read_under_a_lease_that_lapsed_fails_as_lapsed_not_as_corrupt(serve) -> None:
    """A reader paused past the TTL between its lease and its copy reads blocks that hold
    another entry by then: the bytes are refused, and the failure names the lapsed lease
    (a retry reads the entry again), not corruption (the daemon's bytes are sound)."""
    flags = ("--lease-ttl-s", "1", "--token", "user", "--admin-token", "admin")
    running = serve(*flags, pool_bytes=1 << 20, block_size=1 << 16)
    with (
        ChunkStoreClient(running.unix, token="user") as client,
        ChunkStoreClient(running.unix, token="admin") as admin,
    ):
        assert client.put(entry_key(1), *random_kv(40, seed=1), 0)  # 2 of the 16 blocks
        [held] = client.acquire([entry_key(1)])
        client.release([held.lease_id])
        reader = paused(PAUSED_BEFORE_READING, running.unix, "leased")
        assert reader.stdout is not None
        try:
            wait_for(lambda: client.stats().active_leases == 0)
            assert admin.evict([entry_key(1)]).evicted == 1  # the lease lapsed: not busy
            for i in range(10, 30):  # new entries until one is written over entry 1's blocks
                assert client.put(entry_key(i), *random_kv(40, seed=i), 0)
                [lease] = client.acquire([entry_key(i)])
                client.release([lease.lease_id])
                if set(lease.blocks) & set(held.blocks):
                    break
            else:
                raise AssertionError("entry 1's blocks never went to another entry")
            resume(reader)
            assert reader.stdout.readline() == "LeaseLapsed\n"
            assert reader.wait(timeout=30) == 0
            assert client.stats().evictions.get("corrupt", 0) == 0  # the daemon's bytes are sound
        finally:
            reader.kill()


def faulty(armed: Path, *fault: str) -> tuple[str, ...]:
    """The launcher of a daemon that fails on purpose (``fault``) once ``armed`` exists."""
    return ("chunkstore.testing.dying_daemon", *fault, "--armed-by", str(armed))


@pytest.mark.parametrize("malformed", ["dtype", "count"])
def test_a_malformed_peer_answer_fails_one_fetch_and_the_fetcher_goes_on(
    serve, tmp_path: Path, malformed: str
) -> None:
    armed = tmp_path / "armed"
    with RedisServer(tmp_path / "redis") as redis_server:
        # A failed pull leaves its leases on the bad peer until their TTL: stopping, it need
        # not wait the default 10 s drain for them.
        cluster = ("--redis", redis_server.url, "--directory-ttl-s", "2", "--drain-timeout-s", "1")
        bad = serve(*cluster, name="bad", launcher=faulty(armed, "--bad-acquire", malformed))
        good = serve(*cluster, name="good")
        here = serve(*cluster, name="here")
        with (
            ChunkStoreClient(bad.unix) as on_bad,
            ChunkStoreClient(good.unix) as on_good,
            ChunkStoreClient(here.unix) as on_here,
        ):
            assert on_bad.put(entry_key(1), *random_kv(4), 0)
            k, v = random_kv(4, seed=2)
            assert on_good.put(entry_key(2), k, v, 0)
            armed.touch()
            failed = 'chunkstore_remote_fetches_total{result="failed"}'
            # The bad peer's claim reaches Redis, then a miss here pulls from it and fails.
            wait_for(
                lambda: on_here.lookup([entry_key(1)]) == [None] and here.scrape()[failed] > 0,
                timeout=30,
            )
            # The fetcher lives on: the next miss is pulled from the good peer.
            wait_for(lambda: on_here.lookup([entry_key(2)]) != [None], timeout=30)
            stored = on_here.get(entry_key(2))
            assert stored is not None and torch.equal(stored.keys, k)
            assert health(here) == "SERVING"
            assert on_here.lookup([entry_key(1)]) == [None]  # nothing of the bad answer stored
            assert ("float12" if malformed == "dtype" else "2 leases for one key") in here.log()


def health(daemon: RunningDaemon) -> str:
    with grpc.insecure_channel(daemon.tcp) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(), timeout=5
        )
    return str(health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status))


def test_a_background_thread_survives_errors_and_its_death_is_not_serving(
    serve, tmp_path: Path
) -> None:
    armed = tmp_path / "armed"
    failing = serve(name="failing", launcher=faulty(armed, "--reaper-raises", "RuntimeError"))
    dying = serve(name="dying", launcher=faulty(armed, "--reaper-raises", "SystemExit"))
    assert health(failing) == health(dying) == "SERVING"
    armed.touch()
    errors = 'chunkstore_background_errors_total{thread="reap"}'
    wait_for(lambda: failing.scrape()[errors] >= 3)  # it failed, and failed again: alive
    assert health(failing) == "SERVING"
    assert "background thread reap: a step failed; it goes on" in failing.log()
    wait_for(lambda: health(dying) == "NOT_SERVING", timeout=30)
    assert "health: NOT_SERVING: background thread(s) reap died" in dying.log()


def test_512_clients_are_served_and_health_always_answers(serve) -> None:
    running = serve()
    clients: list[ChunkStoreClient] = []
    try:
        for _ in range(512):  # each holds a heartbeat stream (it froze the daemon at 32)
            clients.append(ChunkStoreClient(running.unix, transport="stream", timeout=30))
        assert health(running) == "SERVING"
        assert clients[0].stats().sessions == 512
        k, v = random_kv(4)
        assert clients[-1].put(entry_key(1), k, v, 0)
        stored = clients[0].get(entry_key(1))  # a Read stream, another client
        assert stored is not None and torch.equal(stored.keys, k)
    finally:
        for client in clients:
            client.close()


def test_clients_beyond_max_sessions_are_refused_clearly(serve) -> None:
    running = serve("--max-sessions", "8")
    clients = [ChunkStoreClient(running.unix) for _ in range(8)]
    try:
        with pytest.raises(Exhausted, match="8 sessions are open, the most --max-sessions"):
            ChunkStoreClient(running.unix)
        assert health(running) == "SERVING"
        clients.pop().close()
        wait_for(lambda: clients[0].stats().sessions == 7)
        clients.append(ChunkStoreClient(running.unix))  # room again
        assert clients[-1].put(entry_key(1), *random_kv(4), 0)
    finally:
        for client in clients:
            client.close()


def test_transfer_streams_beyond_max_transfers_are_refused_clearly(serve) -> None:
    running = serve("--max-transfers", "1")
    with (
        ChunkStoreClient(running.unix, transport="stream") as holder,
        ChunkStoreClient(running.unix, transport="stream") as other,
    ):
        k, v = random_kv(4)
        layout = layout_of(k, v, 0)
        reply = holder.stub.Reserve(
            pb.ReserveRequest(
                session_id=holder.session,
                key=entry_key(9),
                layout=layout_to_proto(layout),
                nbytes=layout.nbytes,
            )
        )
        release = threading.Event()

        def pieces():
            yield pb.WritePiece(
                session_id=holder.session, reservation_id=reply.reservation_id, data=b"\0"
            )
            release.wait(30)  # the stream stays open: it holds the one transfer slot

        writing = holder.stub.Write.future(pieces())
        try:
            attempts = itertools.count(100)  # a new key each: one may land before the slot goes
            wait_for(lambda: _refused(other, entry_key(next(attempts)), k, v))
            assert health(running) == "SERVING"
        finally:
            release.set()
            writing.result(timeout=30)
        assert other.put(entry_key(1), k, v, 0)  # the slot is free again


def _refused(client: ChunkStoreClient, key: bytes, k, v) -> bool:
    try:
        client.put(key, k, v, 0)
    except Exhausted as err:
        assert "1 Read / Write streams are in progress, the most --max-transfers" in str(err)
        return True
    return False


def test_undecodable_requests_answer_invalid_argument_and_cost_no_memory(serve) -> None:
    running = serve("--token", "s3cret")
    bad = b"\xff\xff\xff\xff\x0f"  # not a protobuf message: a tag that never ends
    token = (("authorization", "Bearer s3cret"),)
    with grpc.insecure_channel(running.tcp) as channel:
        calls = {
            "/grpc.health.v1.Health/Check": (),  # health needs no token
            "/chunkstore.v1.ChunkStore/Lookup": token,
            "/chunkstore.v1.ChunkStore/Read": token,
        }

        def send(count: int) -> set[str]:
            codes = set()
            for method, metadata in calls.items():
                call = (
                    channel.unary_stream(method)
                    if method.endswith("Read")
                    else channel.unary_unary(method)
                )
                for _ in range(count):
                    try:
                        answer = call(bad, timeout=10, metadata=metadata)
                        if method.endswith("Read"):
                            list(answer)  # the stream's status comes with its end
                    except grpc.RpcError as err:
                        codes.add(err.code().name)
            return codes

        assert send(200) == {"INVALID_ARGUMENT"}  # warm-up
        before = running.rss_kib()
        assert send(1000) == {"INVALID_ARGUMENT"}
        grown = running.rss_kib() - before
    # grpcio's own decoding kept ~19 KB per request: 3000 of them were ~57 MB.
    assert grown < 6 * 1024, f"the daemon grew {grown} KiB over 3000 undecodable requests"
    assert "Traceback" not in running.log()
    assert health(running) == "SERVING"


def test_admin_calls_need_the_admin_token_and_a_drain_can_be_undone(serve) -> None:
    running = serve("--token", "user", "--admin-token", "admin")
    with (
        ChunkStoreClient(running.tcp, token="user") as user,
        ChunkStoreClient(running.tcp, token="admin") as admin,
    ):
        assert user.put(entry_key(1), *random_kv(4), 0)
        for call in (
            lambda: user.evict([entry_key(1)]),
            user.clear,
            lambda: user.pin([entry_key(1)]),
            lambda: user.drain(0),
            user.undrain,
        ):
            with pytest.raises(Forbidden, match="is an admin call: it needs the admin token"):
                call()
        assert user.lookup([entry_key(1)]) != [None]  # nothing happened
        assert admin.pin([entry_key(1)]) == 1  # the admin token is good for admin calls...
        assert admin.put(entry_key(2), *random_kv(4), 0)  # ...and for the others
        assert admin.drain(0) == 0
        assert health(running) == "NOT_SERVING"
        with pytest.raises(WrongState, match="draining"):
            user.put(entry_key(3), *random_kv(4), 0)
        assert admin.undrain() is True
        assert health(running) == "SERVING"
        assert user.put(entry_key(3), *random_kv(4), 0)
        assert admin.undrain() is False
    cli = [sys.executable, "-m", "chunkstore.cli", "drain", "--address", running.tcp]
    refused = subprocess.run([*cli, "--token", "user"], capture_output=True, text=True)
    assert refused.returncode == 1 and "PERMISSION_DENIED" in refused.stderr


def test_without_an_admin_token_admin_calls_are_refused(serve) -> None:
    running = serve("--token", "user")
    with ChunkStoreClient(running.tcp, token="user") as user:
        with pytest.raises(Forbidden, match="the daemon has no --admin-token"):
            user.drain(0)
        assert health(running) == "SERVING"


def test_another_client_cannot_end_a_session_with_a_heartbeat(daemon: RunningDaemon) -> None:
    with ChunkStoreClient(daemon.unix) as victim, ChunkStoreClient(daemon.unix) as other:
        assert victim.put(entry_key(1), *random_kv(4), 0)
        [lease] = victim.acquire([entry_key(1)])
        assert lease is not None
        stream = other.stub.Heartbeat(iter([pb.Ping(session_id=victim.session)]))
        with pytest.raises(grpc.RpcError) as refused:
            list(stream)
        assert refused.value.code() == grpc.StatusCode.ALREADY_EXISTS
        time.sleep(0.5)  # the refused stream has ended: the victim's session must stand
        assert victim.stats().sessions == 2 and victim.stats().active_leases == 1
        victim.release([lease.lease_id])  # still its session, still its lease
