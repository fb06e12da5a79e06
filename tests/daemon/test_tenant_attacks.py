"""Tenants under attack (issue 48's campaign, each hole as a test that failed before its fix):
real daemons, real tokens, raw gRPC where a client library would not send the call. A
tenant's entries are reachable only through its token; a call is its caller's from start to
end; what one call can make the daemon do is bounded."""

from __future__ import annotations

import hashlib
import signal
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import grpc
import pytest
from test_tenants import ADMIN, PEER, TOKEN, TOKENS, as_tenant, holds, put, tenants_file

from chunkstore.client import ChunkStoreClient
from chunkstore.daemon.tenants import namespace_secret, tenant_key
from chunkstore.kv.keys import KEY_BYTES
from chunkstore.protocol import chunkstore_pb2 as pb
from chunkstore.protocol import chunkstore_pb2_grpc as pb_grpc
from chunkstore.testing.entries import entry_key, random_kv


def unkeyed_tenant_key(tenant: str, key: bytes) -> bytes:
    """How a tenant's key was derived before the namespace secret: anyone could compute it."""
    return hashlib.blake2b(
        b"tenant\0" + tenant.encode() + b"\0" + key, digest_size=KEY_BYTES
    ).digest()


@pytest.fixture
def guarded(serve, tmp_path: Path):  # type: ignore[no-untyped-def]
    """alice (reads shared), carol (does not); a shared token, an admin, a peer token (so the
    test can derive the namespace secret, as a peer node does)."""
    path = tenants_file(tmp_path / "tenants.toml", alice={}, carol={"shared": False})
    daemon = serve(
        "--token", TOKEN, "--admin-token", ADMIN, "--peer-token", PEER,
        "--allow-insecure-peers", "--tenants", str(path), pool_bytes=4 << 20,
    )  # fmt: skip
    return daemon, path


def test_a_shared_client_cannot_name_a_tenants_entry(guarded) -> None:  # type: ignore[no-untyped-def]
    """Item 1: a lookup, an acquire or a verify by a shared-namespace client of the key alice's
    entry has in the index answers as absent, whether computed the old way (unkeyed) or with
    the daemon's own secret: a key names an entry only in its own namespace."""
    daemon, _ = guarded
    with as_tenant(daemon, "alice") as alice, ChunkStoreClient(daemon.tcp, token=TOKEN) as shared:
        assert put(alice, 1)
        for key in (
            unkeyed_tenant_key("alice", entry_key(1)),
            tenant_key("alice", entry_key(1), namespace_secret(PEER, "")),
        ):
            assert shared.lookup([key]) == [None]
            assert shared.acquire([key]) == [None]
        assert holds(alice, 1)


def test_a_shared_client_cannot_squat_a_tenants_key(guarded) -> None:  # type: ignore[no-untyped-def]
    """Item 2: a key a shared client stores first, computed as alice's namespace key was, is
    not alice's: her own put of that key stores her bytes and she reads them."""
    daemon, _ = guarded
    with ChunkStoreClient(daemon.tcp, token=TOKEN) as shared, as_tenant(daemon, "alice") as alice:
        keys, values = random_kv(TOKENS, seed=666)
        assert shared.put(unkeyed_tenant_key("alice", entry_key(1)), keys, values, 0)
        assert put(alice, 1)
        assert holds(alice, 1)  # her bytes, not the squatter's


def test_a_call_in_flight_during_a_reload_stays_its_callers(guarded) -> None:  # type: ignore[no-untyped-def]
    """Item 3: SIGHUPs that remove and restore carol (shared = false) while she looks up a
    shared entry and asks for Stats: she is either herself or refused, never the shared
    namespace (before: shared entries seen in 12 of 40 rounds, the whole pool's Stats in 17)."""
    daemon, path = guarded
    with ChunkStoreClient(daemon.tcp, token=TOKEN) as shared:
        assert put(shared, 7)
    raw = pb_grpc.ChunkStoreStub(grpc.insecure_channel(daemon.tcp))
    carol = (("authorization", "Bearer carol-secret"),)
    leaks: list[str] = []
    stop = threading.Event()

    def ask() -> None:
        while not stop.is_set():
            try:
                found = raw.Lookup(pb.LookupRequest(keys=[entry_key(7)]), metadata=carol)
                if any(found.present):
                    leaks.append("lookup found a shared entry")
                stats = raw.Stats(pb.StatsRequest(), metadata=carol)
                if stats.entries or set(stats.tenants) - {"carol"}:
                    leaks.append(f"stats beyond carol's: {sorted(stats.tenants)}")
            except grpc.RpcError as err:
                assert err.code() == grpc.StatusCode.UNAUTHENTICATED, err

    askers = [threading.Thread(target=ask) for _ in range(4)]
    for thread in askers:
        thread.start()
    try:
        deadline = time.monotonic() + 8
        for round_ in range(40):
            if time.monotonic() > deadline:
                break
            tenants = (
                {"alice": {}} if round_ % 2 == 0 else {"alice": {}, "carol": {"shared": False}}
            )
            tenants_file(path, **tenants)  # type: ignore[arg-type]
            daemon.process.send_signal(signal.SIGHUP)
            time.sleep(0.1)
    finally:
        stop.set()
        for thread in askers:
            thread.join()
    assert not leaks, leaks[:3]


def raw_stub(daemon) -> pb_grpc.ChunkStoreStub:  # type: ignore[no-untyped-def]
    return pb_grpc.ChunkStoreStub(grpc.insecure_channel(daemon.tcp))


def bearer(token: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {token}"),)


def refused(call, *args, **kwargs) -> grpc.RpcError:  # type: ignore[no-untyped-def]
    with pytest.raises(grpc.RpcError) as err:
        call(*args, **kwargs)
    return err.value


def test_a_malformed_key_leaves_no_lease_behind(guarded) -> None:  # type: ignore[no-untyped-def]
    """Item 5 (and the cost of a huge call): keys are checked before any is hashed or leased,
    so Acquire([own key, malformed key]) keeps nothing, and 4,097 keys are refused at once."""
    daemon, _ = guarded
    raw = raw_stub(daemon)
    with as_tenant(daemon, "alice") as alice:
        assert put(alice, 1)
    session = raw.Hello(pb.HelloRequest(), metadata=bearer("alice-secret")).session_id
    bad = pb.AcquireRequest(session_id=session, keys=[entry_key(1), b"short"])
    err = refused(raw.Acquire, bad, metadata=bearer("alice-secret"))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    with ChunkStoreClient(daemon.tcp, token=ADMIN) as admin:
        assert admin.stats().active_leases == 0
        assert admin.evict([entry_key(1)], tenant="alice").evicted == 1  # nobody holds it
    many = pb.LookupRequest(keys=[entry_key(i) for i in range(4097)])
    err = refused(raw.Lookup, many, metadata=bearer("alice-secret"))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "at most 4096" in err.details()


def test_calls_tell_nothing_of_other_tenants(guarded) -> None:  # type: ignore[no-untyped-def]
    """Item 6: a tenant name in Acquire is refused alike whether it exists; a session id is
    answered alike whether it is another tenant's live one or none; lease and reservation ids
    are not a shared counter; a reservation's outcome is told only to its session."""
    daemon, _ = guarded
    raw = raw_stub(daemon)
    alice, carol = bearer("alice-secret"), bearer("carol-secret")
    mine = raw.Hello(pb.HelloRequest(), metadata=alice).session_id
    theirs = raw.Hello(pb.HelloRequest(), metadata=carol).session_id
    answers = []
    for name in ("carol", "nobody"):
        request = pb.AcquireRequest(session_id=mine, keys=[entry_key(1)], tenant=name)
        err = refused(raw.Acquire, request, metadata=alice)
        answers.append((err.code(), err.details()))
    assert answers[0] == answers[1]
    answers = []
    for session in (theirs, "0123456789abcdef"):
        err = refused(raw.Release, pb.ReleaseRequest(session_id=session), metadata=alice)
        answers.append((err.code(), err.details().replace(session, "S")))
    assert answers[0] == answers[1] and answers[0][0] == grpc.StatusCode.NOT_FOUND
    with as_tenant(daemon, "alice") as client:
        assert put(client, 1) and put(client, 2)
        leases = client.acquire([entry_key(1), entry_key(2)])
        ids = [lease.lease_id for lease in leases if lease is not None]
        assert len(ids) == 2 and abs(ids[0] - ids[1]) > 1 and min(ids) > 1 << 20
        client.release(ids)
    layout = pb.EntryLayout(
        num_layers=1, num_kv_heads=1, head_dim=4, dtype="float32", kind="kv", num_tokens=1
    )
    reserve = pb.ReserveRequest(session_id=mine, key=entry_key(3), layout=layout, nbytes=32)
    reservation = raw.Reserve(reserve, metadata=alice).reservation_id
    raw.Abort(pb.AbortRequest(session_id=mine, reservation_id=reservation), metadata=alice)
    err = refused(
        raw.Commit, pb.CommitRequest(session_id=theirs, reservation_id=reservation), metadata=carol
    )
    assert err.code() == grpc.StatusCode.NOT_FOUND and "aborted" not in err.details()
    err = refused(
        raw.Commit, pb.CommitRequest(session_id=mine, reservation_id=reservation), metadata=alice
    )
    assert "aborted" in err.details()  # its own session is told


def test_stats_are_the_callers_namespaces(guarded) -> None:  # type: ignore[no-untyped-def]
    """Item 7: with tenants, Stats is all of it for the admin only; a --token client sees the
    shared namespace's figures, a tenant its own."""
    daemon, _ = guarded
    with (
        as_tenant(daemon, "alice") as alice,
        ChunkStoreClient(daemon.tcp, token=TOKEN) as shared,
        ChunkStoreClient(daemon.tcp, token=ADMIN) as admin,
    ):
        assert put(alice, 1) and put(shared, 2)
        assert set(shared.stats().tenants) == {"shared"} and shared.stats().entries == 0
        assert set(alice.stats().tenants) == {"alice"}
        assert admin.stats().entries == 2 and {"alice", "shared"} <= set(admin.stats().tenants)


def test_a_tenant_holds_at_most_its_sessions(serve, tmp_path: Path) -> None:
    """One tenant cannot take every --max-sessions slot: its file entry caps its own."""
    path = tenants_file(tmp_path / "t.toml", alice={"sessions": 2}, bob={})
    daemon = serve("--tenants", str(path), "--max-sessions", "4")
    raw = raw_stub(daemon)
    for _ in range(2):
        raw.Hello(pb.HelloRequest(), metadata=bearer("alice-secret"))
    err = refused(raw.Hello, pb.HelloRequest(), metadata=bearer("alice-secret"))
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "tenant alice" in err.details()
    raw.Hello(pb.HelloRequest(), metadata=bearer("bob-secret"))  # others still get theirs


def test_a_read_in_one_byte_pieces_is_refused(guarded) -> None:  # type: ignore[no-untyped-def]
    """Item 10: piece_bytes has a floor; a 64 KiB entry in 1-byte pieces was 65,536 messages."""
    daemon, _ = guarded
    raw = raw_stub(daemon)
    with ChunkStoreClient(daemon.tcp, token=TOKEN) as shared:
        assert put(shared, 1)
    session = raw.Hello(pb.HelloRequest(), metadata=bearer(TOKEN)).session_id
    request = pb.AcquireRequest(session_id=session, keys=[entry_key(1)])
    [lease] = raw.Acquire(request, metadata=bearer(TOKEN)).leases
    read = pb.ReadRequest(session_id=session, lease_id=lease.lease_id, piece_bytes=1)
    err = refused(lambda: list(raw.Read(read, metadata=bearer(TOKEN))))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "piece_bytes 1" in err.details()


def test_a_disk_only_key_cannot_be_reserved_again(serve, tmp_path: Path) -> None:
    """Item 8: an entry only the disk tier holds (after a restart) is committed: Reserve
    answers ALREADY_EXISTS, as for one in memory."""
    flags = ("--disk-dir", str(tmp_path / "disk"), "--disk-size", "64M")
    daemon = serve(*flags, name="first")
    with ChunkStoreClient(daemon.unix) as client:
        assert put(client, 1)
    assert daemon.stop() == 0  # the drain writes the spill queue out
    daemon = serve(*flags, name="second")
    with ChunkStoreClient(daemon.unix) as client:
        assert client.stats().entries == 0 and client.stats().disk.entries == 1
        keys, values = random_kv(TOKENS, seed=99)
        assert not client.put(entry_key(1), keys, values, 0)  # False: it is there already
        assert holds(client, 1)  # the first bytes, promoted from the disk, not the new ones


def test_metrics_answer_only_the_metrics_token(serve, tmp_path: Path) -> None:
    """Item 7, /metrics: it names each tenant's figures; with --metrics-token set, a scrape
    without the token is refused (401) and one with it answers."""
    path = tenants_file(tmp_path / "t.toml", alice={})
    daemon = serve("--tenants", str(path), "--metrics-token", "scrape-secret")
    url = daemon.metrics_url
    with pytest.raises(urllib.error.HTTPError) as refused_scrape:
        urllib.request.urlopen(url, timeout=10)
    assert refused_scrape.value.code == 401
    wrong = urllib.request.Request(url, headers={"Authorization": "Bearer alice-secret"})
    with pytest.raises(urllib.error.HTTPError):
        urllib.request.urlopen(wrong, timeout=10)
    right = urllib.request.Request(url, headers={"Authorization": "Bearer scrape-secret"})
    with urllib.request.urlopen(right, timeout=10) as answer:
        assert 'tenant="alice"' in answer.read().decode()


def test_a_tenants_entries_on_disk_keep_their_keys_across_a_restart(serve, tmp_path: Path) -> None:
    """Without a peer token the namespace secret lives in the disk tier's folder (0600, the
    tier's own: a restart is not refused as foreign), so alice reads her entry after a
    restart, and only she does."""
    path = tenants_file(tmp_path / "t.toml", alice={}, bob={})
    flags = ("--tenants", str(path), "--disk-dir", str(tmp_path / "disk"), "--disk-size", "64M")
    daemon = serve(*flags, name="first")
    with as_tenant(daemon, "alice") as alice:
        assert put(alice, 1)
    assert daemon.stop() == 0
    secret = tmp_path / "disk" / "namespace.secret"
    assert secret.stat().st_mode & 0o777 == 0o600 and len(secret.read_bytes()) == 32
    daemon = serve(*flags, name="second")
    with as_tenant(daemon, "alice") as alice, as_tenant(daemon, "bob") as bob:
        assert bob.lookup([entry_key(1)]) == [None]
        assert holds(alice, 1)
