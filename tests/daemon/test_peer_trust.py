"""Cluster trust (docs/daemon.md, "Trust between daemons"): the client token never leaves for
a peer, the peer token reads and nothing else, and with --peer-ca a daemon pulls only from
peers whose certificate it verifies. Real daemons, a real Redis, openssl's certificates, and a
spy gRPC server that Redis lists as a holder."""

from __future__ import annotations

import subprocess
import time
from concurrent import futures
from pathlib import Path

import grpc
import pytest
import redis
import torch

from chunkstore.client import ChunkStoreClient
from chunkstore.daemon.directory import directory_key
from chunkstore.errors import Forbidden, Unauthenticated
from chunkstore.processes.daemon import serve_command, serve_env
from chunkstore.processes.redis import RedisServer
from chunkstore.testing.entries import entry_key, random_kv, wait_for
from chunkstore.testing.pki import make_pki


class Spy(grpc.GenericRpcHandler):
    """A gRPC server that answers nothing and writes down who called with what."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, str | None]] = []
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        self.server.add_generic_rpc_handlers((self,))
        self.address = f"127.0.0.1:{self.server.add_insecure_port('127.0.0.1:0')}"
        self.server.start()

    def service(self, details):  # type: ignore[no-untyped-def]
        self.seen.append((details.method, dict(details.invocation_metadata).get("authorization")))

        def refuse(request, context):  # type: ignore[no-untyped-def]
            context.abort(grpc.StatusCode.UNAVAILABLE, "a spy")

        return grpc.unary_unary_rpc_method_handler(refuse)


def list_as_holder(url: str, address: str, key: bytes) -> None:
    redis.Redis.from_url(url).zadd(directory_key(key), {address: time.time() + 600})


def test_the_client_token_never_goes_to_a_peer(serve, tmp_path: Path) -> None:
    spy = Spy()
    with RedisServer(tmp_path / "redis") as server:
        daemon = serve(
            "--token", "client-secret", "--peer-token", "peer-secret",
            "--allow-insecure-peers", "--redis", server.url, "--directory-ttl-s", "2",
        )  # fmt: skip
        list_as_holder(server.url, spy.address, entry_key(7))
        with ChunkStoreClient(daemon.unix, token="client-secret") as client:
            assert client.lookup([entry_key(7)]) == [None]  # a miss: it pulls from the spy
            wait_for(lambda: bool(spy.seen), timeout=30)
    spy.server.stop(0)
    assert {bearer for _, bearer in spy.seen} == {"Bearer peer-secret"}


def test_a_peer_token_reads_and_nothing_else(serve) -> None:
    daemon = serve("--token", "client", "--peer-token", "peer", "--allow-insecure-peers")
    with ChunkStoreClient(daemon.tcp, token="client", transport="stream") as client:
        assert client.put(entry_key(1), *random_kv(4), 0)
    with ChunkStoreClient(daemon.tcp, token="peer", transport="stream") as peer:
        assert peer.get(entry_key(1)) is not None  # Hello, Acquire, Read, Release
        with pytest.raises(Unauthenticated):
            peer.put(entry_key(2), *random_kv(4), 0)
        with pytest.raises(Forbidden):
            peer.evict([entry_key(1)])


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (("--token", "t", "--redis", "redis://127.0.0.1:1/0"), "needs --peer-token"),
        (("--peer-token", "p"), "set --peer-ca"),
        (("--peer-ca", "/x.pem"), "--peer-ca needs --tls-cert"),
    ],
)
def test_peer_settings_that_would_leak_are_refused_at_start(
    tmp_path: Path, flags: tuple[str, ...], message: str
) -> None:
    command = serve_command(tmp_path, *flags, pool_bytes=1 << 20)
    run = subprocess.run(command, capture_output=True, text=True, timeout=60, env=serve_env())
    assert run.returncode == 2 and message in run.stderr, run.stderr


def test_peers_pull_over_mutual_tls_and_ignore_a_listed_stranger(serve, tmp_path: Path) -> None:
    pki = tmp_path / "pki"
    make_pki(pki)
    spy = Spy()
    with RedisServer(tmp_path / "redis") as server:
        tls = (
            "--tls-cert", str(pki / "server.pem"), "--tls-key", str(pki / "server.key"),
            "--tls-client-ca", str(pki / "ca.pem"), "--peer-ca", str(pki / "ca.pem"),
            "--token", "client", "--peer-token", "peer",
            "--redis", server.url, "--directory-ttl-s", "2",
        )  # fmt: skip
        a = serve(*tls, name="a")
        b = serve(*tls, name="b")
        k, v = random_kv(6)
        with (
            ChunkStoreClient(a.unix, token="client") as on_a,
            ChunkStoreClient(b.unix, token="client") as on_b,
        ):
            assert on_a.put(entry_key(1), k, v, 0)
            wait_for(lambda: on_b.lookup([entry_key(1)]) != [None], timeout=30)  # pulled, TLS
            stored = on_b.get(entry_key(1))
            assert stored is not None and torch.equal(stored.keys, k)
            list_as_holder(server.url, spy.address, entry_key(2))
            failed = 'chunkstore_remote_fetches_total{result="failed"}'
            on_b.lookup([entry_key(2)])
            wait_for(lambda: b.scrape()[failed] > 0, timeout=30)
            assert on_b.lookup([entry_key(2)]) == [None]
    spy.server.stop(0)
    assert not spy.seen  # no TLS handshake, so not one call, and no credential
