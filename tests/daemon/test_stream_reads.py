"""Reads over the gRPC stream (issue 93's items 1 and 2), against real daemons: every byte a
reader receives was read under a lease it still holds, however long it pauses mid-stream;
and what one run read may ask of the daemon is bounded by its count of runs, not only its
bytes."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import torch
from test_tenants import ADMIN, TOKEN, tenants_file

from chunkstore.client import ChunkStoreClient
from chunkstore.daemon.auth import SERVICE
from chunkstore.daemon.index import Index
from chunkstore.daemon.pool import SharedMemoryPool
from chunkstore.device.device_ipc import keyed_run_sums
from chunkstore.errors import InvalidRequest, LeaseLapsed, NotFound
from chunkstore.kv.entry import EntryLayout
from chunkstore.protocol import chunkstore_pb2 as pb
from chunkstore.protocol import chunkstore_pb2_grpc as pb_grpc
from chunkstore.protocol.wire import MAX_RUNS, typed_error
from chunkstore.testing.entries import entry_key, random_kv

ENTRY_TOKENS = 2048  # x 3,072 bytes (random_kv's 2 layers x 3 heads x 64 dims, fp32): 6 MiB
FILLER_TOKENS = 341  # about 1 MiB an entry of the other tenant's
POOL = 8 << 20
PIECE = 16 << 10  # the smallest a Read allows: most of the entry waits in the daemon
READS = 3  # million-run reads measured
DEFAULT_TTL = 30.0  # ServeConfig.lease_ttl_s


def stored_bytes(tokens: int, seed: int) -> torch.Tensor:
    """The bytes of the entry ``random_kv(tokens, seed)`` makes: keys, then values."""
    keys, values = random_kv(tokens, seed=seed)
    return torch.cat([t.flatten().view(torch.uint8) for t in (keys, values)])


def bearer(token: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {token}"),)


@pytest.mark.parametrize("ttl", [1.0, DEFAULT_TTL], ids=["ttl-1s", "ttl-default"])
def test_a_paused_streamed_reader_gets_only_its_own_bytes(
    serve, tmp_path: Path, ttl: float
) -> None:  # type: ignore[no-untyped-def]
    """Alice streams her 6 MiB entry in 16 KiB pieces, takes one and stops reading (flow
    control parks the daemon's side), with no heartbeat. Past her lease's TTL bob's puts
    evict the entry and fill the pool, its blocks included. When she reads on she gets her
    own bytes, then LeaseLapsed; never bob's (before: 6,193,152 of 6,291,456 bytes were his).
    With the default TTL the test waits it out (30 s), as a stalled reader would."""
    path = tenants_file(tmp_path / "tenants.toml", alice={}, bob={})
    # LRU: bob's puts evict the oldest entry, hers once her lease lapsed (under the default
    # policy his own, as worthy per byte and ranked later, can go first for good).
    flags = ["--token", TOKEN, "--admin-token", ADMIN, "--tenants", str(path), "--eviction", "lru"]
    if ttl != DEFAULT_TTL:
        flags += ["--lease-ttl-s", str(ttl)]
    daemon = serve(*flags, pool_bytes=POOL)
    alice = bearer("alice-secret")
    with ChunkStoreClient(daemon.tcp, token="alice-secret") as writer:
        assert writer.put(entry_key(1), *random_kv(ENTRY_TOKENS, seed=1), virtual_start=0)
    expected = stored_bytes(ENTRY_TOKENS, seed=1).numpy().tobytes()
    # No BDP probing: the stream's window stays at 64 KiB, so the daemon parks within it.
    channel = grpc.insecure_channel(daemon.tcp, options=[("grpc.http2.bdp_probe", 0)])
    raw = pb_grpc.ChunkStoreStub(channel)
    session = raw.Hello(pb.HelloRequest(), metadata=alice).session_id  # and no heartbeat
    acquired = raw.Acquire(
        pb.AcquireRequest(session_id=session, keys=[entry_key(1)]), metadata=alice
    )
    [lease] = acquired.leases
    assert lease.lease_id and lease.nbytes == len(expected)
    read = pb.ReadRequest(session_id=session, lease_id=lease.lease_id, piece_bytes=PIECE)
    stream = raw.Read(read, metadata=alice, timeout=ttl + 120)
    received = bytearray(next(stream).data)

    deadline = time.monotonic() + ttl + 60
    evicted_puts = 0
    with ChunkStoreClient(daemon.tcp, token="bob-secret") as bob:
        for i in range(100, 100_000):
            assert time.monotonic() < deadline, "alice's entry was never evicted"
            assert bob.put(entry_key(i), *random_kv(FILLER_TOKENS, seed=i), virtual_start=0)
            present = raw.Lookup(pb.LookupRequest(keys=[entry_key(1)], probe=True), metadata=alice)
            if not present.present[0]:
                evicted_puts += 1
                if evicted_puts * FILLER_TOKENS * 3072 * 2 > POOL:  # every block rewritten
                    break
            else:
                time.sleep(0.2)  # her lease holds it: wait for it to lapse

    failure = None
    try:
        for piece in stream:
            received += piece.data
    except grpc.RpcError as err:
        failure = typed_error(err)
    channel.close()
    print(f"alice received {len(received)} of {len(expected)} bytes, then {failure!r}")
    foreign = sum(a != b for a, b in zip(received, expected[: len(received)], strict=True))
    assert foreign == 0, f"{foreign} of the {len(received)} bytes alice received were not hers"
    assert len(received) < len(expected), "all sent before the lapse: the reader never paused"
    assert isinstance(failure, LeaseLapsed), failure


@contextlib.contextmanager
def looking_up(client: ChunkStoreClient, key: bytes) -> Iterator[list[float]]:
    """A thread of the client's Lookups of ``key`` while in the block: how long each took."""
    waits: list[float] = []
    stop = threading.Event()

    def look_up() -> None:
        while not stop.is_set():
            began = time.perf_counter()
            client.lookup([key])
            waits.append(time.perf_counter() - began)
            time.sleep(0.002)

    looker = threading.Thread(target=look_up)
    looker.start()
    try:
        yield waits
    finally:
        stop.set()
        looker.join()


def test_a_run_read_of_a_million_runs_is_refused_in_bounded_memory(serve) -> None:  # type: ignore[no-untyped-def]
    """A Read of 1,000,000 one-byte runs over a 6 MiB entry (inside its bytes; 3 MB on the
    wire) is refused by its count, before the runs become arrays, and another client's
    Lookups meanwhile are not held up (before: served; 16M such runs took 4.8 s and 664 MiB
    and held Lookups 1.8 s). What such a Read still costs the daemon is receiving and
    parsing its message, as any call of 3 MB: glibc keeps some of that in its per-thread
    arenas (up to ~14 MiB more RSS here, whether the Read is refused for its runs or for
    its lease), so the same message under a lease it does not hold goes first, and the
    bound is well under the 129 MiB one served read of these runs took."""
    daemon = serve(pool_bytes=POOL)
    with ChunkStoreClient(daemon.tcp) as owner, ChunkStoreClient(daemon.tcp) as other:
        assert owner.put(entry_key(1), *random_kv(ENTRY_TOKENS, seed=1), virtual_start=0)
        [lease] = owner.acquire([entry_key(1)])
        assert lease is not None
        # Serialized once, sent as bytes: building it holds this process's GIL ~0.1 s, which
        # its Lookups would count as the daemon's delay.
        channel = grpc.insecure_channel(daemon.tcp, options=[("grpc.max_send_message_length", -1)])
        read = channel.unary_stream(
            f"/{SERVICE}/Read", response_deserializer=pb.ReadPiece.FromString
        )
        runs = pb.ReadRequest(session_id=owner.session, run_starts=range(10**6), run_bytes=1)
        wire = runs.SerializeToString()
        for _ in range(20):
            other.lookup([entry_key(1)])
        with looking_up(other, entry_key(1)) as waits:
            for _ in range(10):  # for the allocator to settle on the message's own cost
                with pytest.raises(grpc.RpcError) as unknown:
                    list(
                        read(wire + pb.ReadRequest(lease_id=lease.lease_id + 1).SerializeToString())
                    )
                assert unknown.value.code() == grpc.StatusCode.NOT_FOUND
            before = daemon.rss_kib()
            for _ in range(READS):
                with pytest.raises(grpc.RpcError) as refused:
                    list(read(wire + pb.ReadRequest(lease_id=lease.lease_id).SerializeToString()))
                error = typed_error(refused.value)
                assert isinstance(error, InvalidRequest) and f"at most {MAX_RUNS}" in str(error)
            grown = daemon.rss_kib() - before
        channel.close()
        print(f"RSS grew {grown} KiB; {len(waits)} lookups, the slowest {max(waits):.4f} s")
        assert grown < 32 << 10, f"the daemon's RSS grew {grown} KiB"
        assert max(waits) < 0.5, f"another client's Lookup waited {max(waits):.3f} s"


def test_a_client_splits_runs_past_the_limit_over_several_reads(serve) -> None:  # type: ignore[no-untyped-def]
    """The stream transport's ``read_runs`` of more runs than one Read carries gathers them
    over several Reads of the lease: the bytes and the sums are those of one read."""
    daemon = serve(pool_bytes=POOL)
    stored = stored_bytes(ENTRY_TOKENS, seed=1)
    with ChunkStoreClient(daemon.tcp, transport="stream") as client:
        assert client.put(entry_key(1), *random_kv(ENTRY_TOKENS, seed=1), virtual_start=0)
        [lease] = client.acquire([entry_key(1)], summed=True)
        assert lease is not None
        length = 8
        starts = torch.arange(2 * MAX_RUNS + 5) * 3  # overlapping runs, in 3 Reads
        out = torch.empty(len(starts) * length, dtype=torch.uint8)
        sums = client.read_runs(lease, starts, length, out)
        gathered = stored[(starts[:, None] + torch.arange(length)).flatten()]
        assert torch.equal(out, gathered)
        assert torch.equal(sums, keyed_run_sums(gathered, starts, length, lease.sum_tables()))
        client.release([lease.lease_id])


def test_a_lease_past_its_ttl_is_lapsed_before_the_reaper_runs(tmp_path: Path) -> None:
    """The index's reaper runs every so often (a quarter TTL, at most a second); a streamed
    Read checks its lease between pieces, and a lease past its TTL is no lease there even
    when the reaper has not yet dropped it: it is dropped then."""
    now = [0.0]
    pool = SharedMemoryPool(64, 4, directory=tmp_path)
    index = Index(pool, lease_ttl=10.0, clock=lambda: now[0])
    session = index.open_session("reader")
    layout = EntryLayout(1, 1, 4, "float32", "mla", 4, 0)  # 64 bytes
    reservation = index.reserve(session, entry_key(1), layout, layout.nbytes)
    index.commit(session, reservation.id, 0)
    [acquired] = index.acquire(session, [entry_key(1)])
    assert acquired is not None
    lease, entry = acquired
    assert index.lease(session, lease.id) is entry
    now[0] = 10.0
    with pytest.raises(NotFound):
        index.lease(session, lease.id)
    assert index.stats().active_leases == 0
    pool.close()
