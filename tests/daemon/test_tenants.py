"""Tenants (serve --tenants): real daemons, real tokens. A tenant reads its own entries and,
if its file says so, the shared namespace's; never another tenant's, and it cannot tell
another's entry from no entry. Quotas evict the tenant's own entries first; a reserved share
is never evicted for anyone else; the file reloads on SIGHUP under load with nothing dropped;
peers pull for a tenant they know and refuse one they do not."""

from __future__ import annotations

import signal
import threading
from pathlib import Path

import grpc
import pytest
import redis
import torch

from chunkstore.client import ChunkStoreClient
from chunkstore.daemon.directory import directory_key
from chunkstore.daemon.tenants import hash_token, namespace_secret, tenant_key
from chunkstore.errors import Forbidden, PoolFull, Unauthenticated
from chunkstore.processes.redis import RedisServer
from chunkstore.protocol import chunkstore_pb2 as pb
from chunkstore.protocol import chunkstore_pb2_grpc as pb_grpc
from chunkstore.testing.entries import entry_key, random_kv, wait_for

BLOCK = 1 << 16
TOKENS = 21  # 21 tokens x 3,072 bytes: one 64 KiB block an entry
TOKEN, ADMIN, PEER = "shared-secret", "admin-secret", "peer-secret"


def tenants_file(path: Path, **tenants: dict[str, object]) -> Path:
    """A tenants file; each tenant's token is "<name>-secret"."""
    lines = []
    for name, fields in tenants.items():
        lines.append(f"[tenants.{name}]")
        lines.append(f'token_sha256 = "{hash_token(name + "-secret")}"')
        lines += [
            f"{k} = {v!r}".replace("True", "true").replace("False", "false")
            for k, v in fields.items()
        ]
    path.write_text("\n".join(lines) + "\n")
    return path


def as_tenant(daemon, name: str) -> ChunkStoreClient:  # type: ignore[no-untyped-def]
    return ChunkStoreClient(daemon.tcp, token=f"{name}-secret")


def put(client: ChunkStoreClient, i: int, seed: int = 0) -> bool:
    k, v = random_kv(TOKENS, seed=seed or i)
    return client.put(entry_key(i), k, v, virtual_start=0)


def holds(client: ChunkStoreClient, i: int, seed: int = 0) -> bool:
    """Whether the client's get of key i is the bytes stored for (i, seed): checked bytes."""
    stored = client.get(entry_key(i))
    if stored is None:
        return False
    k, v = random_kv(TOKENS, seed=seed or i)
    assert torch.equal(stored.keys, k) and torch.equal(stored.values, v), f"wrong bytes at {i}"
    return True


@pytest.fixture
def three(serve, tmp_path: Path):  # type: ignore[no-untyped-def]
    path = tenants_file(
        tmp_path / "tenants.toml",
        alice={"quota": "1M"},
        bob={"reserved": "1M"},
        carol={"shared": False},
    )
    daemon = serve(
        "--token", TOKEN, "--admin-token", ADMIN, "--tenants", str(path), pool_bytes=4 << 20
    )
    return daemon, path


def test_a_tenant_never_sees_another_tenants_entries(three) -> None:  # type: ignore[no-untyped-def]
    daemon, _ = three
    with (
        ChunkStoreClient(daemon.tcp, token=TOKEN) as shared,
        as_tenant(daemon, "alice") as alice,
        as_tenant(daemon, "bob") as bob,
        as_tenant(daemon, "carol") as carol,
    ):
        assert put(shared, 0) and put(alice, 1)
        # Bob cannot look up, acquire or learn the size of alice's key 1: it answers exactly
        # as key 9, which nobody stored.
        assert bob.lookup([entry_key(1), entry_key(9)]) == [None, None]
        assert bob.acquire([entry_key(1), entry_key(9)]) == [None, None]
        raw = pb_grpc.ChunkStoreStub(grpc.insecure_channel(daemon.tcp))
        bearer = (("authorization", "Bearer bob-secret"),)
        replies = [
            raw.Lookup(pb.LookupRequest(keys=[entry_key(i)]), metadata=bearer) for i in (1, 9)
        ]
        assert replies[0].SerializeToString() == replies[1].SerializeToString()
        # Nor does writing it tell him anything: his key 1 is his own entry.
        assert put(bob, 1, seed=101)
        assert holds(bob, 1, seed=101) and holds(alice, 1)
        # The shared namespace: alice and bob read it, carol's file says she does not.
        assert holds(alice, 0) and holds(bob, 0)
        assert carol.lookup([entry_key(0)]) == [None] and carol.get(entry_key(0)) is None
        # A tenant's session is not another's: bob naming alice's session finds none.
        with pytest.raises(grpc.RpcError) as stolen:
            raw.Acquire(
                pb.AcquireRequest(session_id=alice.session, keys=[entry_key(1)]), metadata=bearer
            )
        assert stolen.value.code() == grpc.StatusCode.NOT_FOUND
        assert "no session" in stolen.value.details()
        # Only a peer names a tenant; admin calls stay admin-only.
        with pytest.raises(grpc.RpcError) as refused:
            raw.Acquire(pb.AcquireRequest(session_id=bob.session, tenant="alice"), metadata=bearer)
        assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
        with pytest.raises(Forbidden):
            bob.evict([entry_key(1)])
        # A tenant's Stats holds its own figures only.
        own = alice.stats()
        assert set(own.tenants) == {"alice"} and own.tenants["alice"].entries == 1
        assert own.bytes_capacity == 0 and own.entries == 0
        with ChunkStoreClient(daemon.tcp, token=ADMIN) as admin:
            every = admin.stats().tenants
            assert {name: t.entries for name, t in every.items()} == {
                "shared": 1,
                "alice": 1,
                "bob": 1,
                "carol": 0,
            }
            assert every["alice"].quota_bytes == 1 << 20 and every["bob"].reserved_bytes == 1 << 20
            # The admin evicts a tenant's entry by the key its tenant knows.
            assert admin.evict([entry_key(1)], tenant="alice").evicted == 1
        assert alice.lookup([entry_key(1)]) == [None] and holds(bob, 1, seed=101)
    for wrong in ("nobody-secret", ""):
        with pytest.raises(Unauthenticated):
            ChunkStoreClient(daemon.tcp, token=wrong or None)
    scraped = daemon.scrape()
    assert scraped['chunkstore_tenant_entries{tenant="bob"}'] == 1
    assert scraped['chunkstore_tenant_hit_chunks_total{tenant="carol"}'] == 0
    assert scraped['chunkstore_tenant_quota_bytes{tenant="alice"}'] == 1 << 20


def test_a_quota_evicts_the_tenants_own_entries_and_a_reserved_share_is_kept(three) -> None:  # type: ignore[no-untyped-def]
    daemon, _ = three
    with (
        as_tenant(daemon, "carol") as carol,
        as_tenant(daemon, "alice") as alice,
        as_tenant(daemon, "bob") as bob,
    ):
        for i in range(16):  # bob's reserved megabyte, all of it
            assert put(bob, i)
        for i in range(100, 140):  # alice writes 40 blocks under a quota of 16
            assert put(alice, i)
            assert alice.stats().tenants["alice"].held_bytes <= 1 << 20
        alice_has = [i for i in range(100, 140) if alice.lookup([entry_key(i)])[0] is not None]
        assert alice_has == list(range(124, 140))  # her own oldest went, nobody else's
        for i in range(1000, 1200):  # carol, without a quota, floods a pool of 64 blocks
            assert put(carol, i)
        assert all(holds(bob, i) for i in range(16)), "bob's reserved share was evicted"
        # An entry alice holds leased cannot be evicted for her: at her quota, she is refused.
        leases = alice.acquire([entry_key(i) for i in range(100, 140)])
        held = [lease for lease in leases if lease is not None]
        with ChunkStoreClient(daemon.tcp, token=ADMIN) as admin:
            stats = admin.stats()
        if stats.tenants["alice"].held_bytes == 1 << 20:
            with pytest.raises(PoolFull, match="tenant alice is at its quota"):
                put(alice, 999)
        alice.release([lease.lease_id for lease in held])
    assert stats.tenants["bob"].evictions == 0
    assert stats.evictions["quota"] >= 24
    assert stats.tenants["alice"].evictions >= 24


def test_the_tenants_file_reloads_under_load_with_nothing_dropped(three) -> None:  # type: ignore[no-untyped-def]
    daemon, path = three
    errors: list[BaseException] = []
    stop = threading.Event()
    done = {"alice": 0}

    def alice_works() -> None:  # one session all along: put, read back checked, evict-free
        try:
            with as_tenant(daemon, "alice") as alice:
                i = 0
                while not stop.is_set():
                    put(alice, 5000 + i % 12)  # 12 blocks: within her quota, never evicted
                    assert holds(alice, 5000 + i % 12)
                    i += 1
                done["alice"] = i
        except BaseException as err:  # noqa: BLE001 - the test reports it
            errors.append(err)

    worker = threading.Thread(target=alice_works)
    worker.start()
    try:
        wait_for(lambda: daemon.scrape().get('chunkstore_tenant_entries{tenant="alice"}', 0) >= 3)
        with as_tenant(daemon, "bob") as bob:
            assert put(bob, 1)
            # Dave joins, bob leaves, alice's quota grows.
            tenants_file(path, alice={"quota": "2M"}, carol={"shared": False}, dave={})
            daemon.process.send_signal(signal.SIGHUP)
            wait_for(lambda: daemon.scrape()['chunkstore_tenant_reloads_total{result="ok"}'] == 1)
            with pytest.raises(Unauthenticated):
                bob.lookup([entry_key(1)])  # his token is no longer any tenant's
        with as_tenant(daemon, "dave") as dave:
            assert put(dave, 1) and holds(dave, 1)
        # A broken file changes nothing: the tenants in force stay.
        path.write_text("[tenants.alice]\nquota = 'a lot'\n")
        daemon.process.send_signal(signal.SIGHUP)
        wait_for(lambda: daemon.scrape()['chunkstore_tenant_reloads_total{result="failed"}'] == 1)
        with as_tenant(daemon, "dave") as dave:
            assert holds(dave, 1)
        with ChunkStoreClient(daemon.tcp, token=ADMIN) as admin:
            assert admin.stats().tenants["alice"].quota_bytes == 2 << 20
    finally:
        stop.set()
        worker.join(timeout=60)
    assert not errors, errors
    assert done["alice"] > 0
    assert "the tenants in force stay as they were" in daemon.log()


def test_a_peer_pulls_for_a_tenant_it_knows_and_refuses_one_it_does_not(
    serve, tmp_path: Path
) -> None:  # type: ignore[no-untyped-def]
    path = tenants_file(tmp_path / "tenants.toml", alice={}, bob={})
    with RedisServer(tmp_path / "redis") as server:
        flags = (
            "--redis",
            server.url,
            "--directory-ttl-s",
            "2",
            "--tenants",
            str(path),
            "--peer-token",
            PEER,
            "--allow-insecure-peers",
        )
        a, b = (serve("--node", name, *flags, name=name) for name in ("node-a", "node-b"))
        directory = redis.Redis.from_url(server.url, decode_responses=True)
        with (
            as_tenant(a, "alice") as on_a,
            as_tenant(b, "alice") as on_b,
            as_tenant(b, "bob") as bob_b,
        ):
            assert put(on_a, 1)
            secret = namespace_secret(PEER, "")  # what both nodes derive from the peer token
            published = directory_key(tenant_key("alice", entry_key(1), secret))
            wait_for(lambda: directory.zscore(published, a.tcp) is not None)
            assert bob_b.lookup([entry_key(1)]) == [None]  # bob's miss pulls nothing of alice's
            assert on_b.lookup([entry_key(1)]) == [None]  # alice's miss queues the pull
            wait_for(lambda: on_b.lookup([entry_key(1)])[0] is not None)
            assert holds(on_b, 1)
            assert bob_b.lookup([entry_key(1)]) == [None]
        with as_tenant(b, "alice") as check:
            assert check.stats().tenants["alice"].entries == 1  # stored on b as alice's
        # A peer naming a tenant b's file lacks is refused.
        raw = pb_grpc.ChunkStoreStub(grpc.insecure_channel(b.tcp))
        bearer = (("authorization", f"Bearer {PEER}"),)
        session = raw.Hello(pb.HelloRequest(client_name="peer"), metadata=bearer).session_id
        request = pb.AcquireRequest(session_id=session, keys=[entry_key(1)], tenant="mallory")
        with pytest.raises(grpc.RpcError) as refused:
            raw.Acquire(request, metadata=bearer)
        assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert "unknown here" in refused.value.details()
        # Naming the right tenant, it reads alice's entry as b holds it.
        request.tenant = "alice"
        request.keys[:] = [tenant_key("alice", entry_key(1), namespace_secret(PEER, ""))]
        [lease] = raw.Acquire(request, metadata=bearer).leases
        assert lease.lease_id and lease.nbytes == TOKENS * 3072
        # And under another tenant's name, the same key is nothing.
        request.tenant = "bob"
        [none] = raw.Acquire(request, metadata=bearer).leases
        assert not none.lease_id
        raw.Release(
            pb.ReleaseRequest(session_id=session, lease_ids=[lease.lease_id]), metadata=bearer
        )


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("[tenants.Alice]\ntoken_sha256 = '{a}'\n", "a name is 1-63"),
        ("[tenants.shared]\ntoken_sha256 = '{a}'\n", "not 'shared'"),
        ("[tenants.alice]\ntoken_sha256 = 'abc'\n", "64 hex digits"),
        (
            "[tenants.alice]\ntoken_sha256 = '{a}'\n[tenants.bob]\ntoken_sha256 = '{a}'\n",
            "same token",
        ),
        (
            "[tenants.alice]\ntoken_sha256 = '{a}'\nquota = '1M'\nreserved = '2M'\n",
            "more than its quota",
        ),
        (
            "[tenants.alice]\ntoken_sha256 = '{a}'\nreserved = '60%'\n"
            "[tenants.bob]\ntoken_sha256 = '{b}'\nreserved = '50%'\n",
            "more than the pool's",
        ),
        ("[tenants.alice]\ntoken_sha256 = '{a}'\nquotas = 1\n", "unknown field"),
        ("[tenants.alice]\ntoken_sha256 = '{a}'\nshared = 'yes'\n", "true or false"),
        ("[tenant.alice]\n", "unknown section"),
        ("[tenants.alice\n", "not TOML"),
    ],
)
def test_a_bad_tenants_file_is_refused_with_what_is_wrong(text: str, says: str) -> None:
    from chunkstore.daemon.tenants import parse_tenants
    from chunkstore.errors import InvalidRequest

    text = text.format(a=hash_token("a"), b=hash_token("b"))
    with pytest.raises(InvalidRequest, match=says):
        parse_tenants(text, 8 << 20)


def test_a_daemon_with_a_bad_tenants_file_does_not_start(tmp_path: Path) -> None:
    from chunkstore.processes.daemon import start_daemon

    path = tenants_file(tmp_path / "tenants.toml", alice={"reserved": "9M"})
    with pytest.raises(RuntimeError, match="reserve .* more than the pool"):
        start_daemon(tmp_path / "d", "--tenants", str(path), pool_bytes=4 << 20, timeout=20)
    # Nor one whose tenant holds the daemon's own token.
    path = tenants_file(tmp_path / "tenants.toml", alice={})
    with pytest.raises(RuntimeError, match="use the daemon's --token"):
        start_daemon(tmp_path / "e", "--token", "alice-secret", "--tenants", str(path), timeout=20)
