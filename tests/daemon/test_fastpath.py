"""The fast path (Lookup, Acquire, Release framed on a unix socket beside gRPC), against a real
daemon: the same answers, counts and typed errors as gRPC, the same token rules; frames that
are not frames close only their own connection; before a client is admitted the daemon reads
no more than a token; a client without it uses gRPC."""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import struct
import time

import pytest

from chunkstore.client import ChunkStoreClient
from chunkstore.errors import InvalidRequest, NotFound, Unauthenticated
from chunkstore.processes.daemon import RunningDaemon
from chunkstore.protocol.fast import AUTH, KINDS, MAX_TOKEN, FastChannel
from chunkstore.testing.entries import entry_key, random_kv


@pytest.fixture
def daemon(serve) -> RunningDaemon:
    return serve()


def test_the_fast_path_answers_as_grpc_does(daemon: RunningDaemon) -> None:
    keys = [entry_key(i) for i in range(8)]
    with (
        ChunkStoreClient(daemon.unix) as fast,
        ChunkStoreClient(daemon.unix, fast=False) as slow,
    ):
        assert fast.fast and not slow.fast
        for key in keys[:4]:
            assert slow.put(key, *random_kv(3 + key[0]), virtual_start=0)
        assert fast.lookup(keys) == slow.lookup(keys)
        assert [hit is not None for hit in fast.lookup(keys)] == [True] * 4 + [False] * 4
        before = fast.stats()
        fast.lookup(keys, num_tokens=[10] * 8)
        after = fast.stats()
        assert after.lookup_tokens - before.lookup_tokens == 80
        assert after.hit_tokens - before.hit_tokens == 40  # counted as a gRPC lookup is
        # A lease taken over the fast path reads the right bytes and holds the entry.
        [leased] = fast.acquire([keys[1]])
        assert leased is not None and slow.evict([keys[1]]).busy == 1
        stored = slow.get(keys[1])
        assert stored is not None
        fast.release([leased.lease_id])
        assert fast.stats().active_leases == 0
        got = fast.get(keys[2])
        expected = slow.get(keys[2])
        assert got is not None and expected is not None and got.keys.equal(expected.keys)
        # Typed errors, and the connection goes on after them.
        with pytest.raises(InvalidRequest, match="a key is 16 bytes"):
            fast.lookup([b"short"])
        with pytest.raises(NotFound):
            fast.release([12345])
        assert fast.fast and fast.lookup(keys[:1])[0] is not None
    scraped = daemon.scrape()
    assert scraped['chunkstore_rpc_seconds_count{method="Lookup"}'] >= 4


def test_the_fast_path_keeps_the_token_rules(serve) -> None:
    running = serve("--token", "s3cret")
    with ChunkStoreClient(running.unix, token="s3cret") as client:
        assert client.fast and client.lookup([entry_key(1)]) == [None]
    for token in (None, "wrong"):  # refused at its Auth frame, before any call
        with pytest.raises(Unauthenticated, match="bearer token"):
            FastChannel(running.ready["fast"], token, 5.0)


def test_a_release_sent_without_waiting_ends_its_leases_before_the_next_call(
    daemon: RunningDaemon, caplog: pytest.LogCaptureFixture
) -> None:
    keys = [entry_key(i) for i in range(3)]
    with ChunkStoreClient(daemon.unix) as client, ChunkStoreClient(daemon.unix) as other:
        for key in keys:
            assert client.put(key, *random_kv(5), virtual_start=0)
        leases = client.acquire(keys)
        client.release([lease.lease_id for lease in leases if lease is not None], wait=False)
        assert client.stats().active_leases == 0  # sent and answered before this call
        # With no call after it, it goes alone, soon (another client sees the lease end).
        [lease] = client.acquire(keys[:1])
        assert lease is not None and other.stats().active_leases == 1
        client.release([lease.lease_id], wait=False)
        deadline = time.monotonic() + 10
        while other.stats().active_leases and time.monotonic() < deadline:
            time.sleep(0.01)
        assert other.stats().active_leases == 0
        # A failed one is logged, not raised, and the calls after it are answered as ever;
        # past MAX_OWED the answers are read before the next is sent (nothing blocks).
        with caplog.at_level(logging.WARNING, logger="chunkstore.client"):
            for lease_id in range(1, FastChannel.MAX_OWED + 3):
                client.release([lease_id], wait=False)
            assert client.fast and client.lookup(keys)[0] is not None
        failed = [r for r in caplog.records if "a Release sent without waiting failed" in r.message]
        assert len(failed) == FastChannel.MAX_OWED + 2
        assert "no lease 1 in session" in failed[0].message
        # Without a fast path it waits, as before, and raises.
        os.unlink(daemon.ready["fast"])
        with ChunkStoreClient(daemon.unix) as slow:
            assert not slow.fast
            [lease] = slow.acquire(keys[:1])
            assert lease is not None
            slow.release([lease.lease_id], wait=False)
            assert other.stats().active_leases == 0
            with pytest.raises(NotFound):
                slow.release([lease.lease_id], wait=False)


def _drop_fast_path(client: ChunkStoreClient) -> None:
    """What a dropped connection leaves the client: the fast path's socket shut down."""
    channel = client._calls._fast
    assert channel is not None
    channel._sock.shutdown(socket.SHUT_RDWR)


def test_a_release_sent_without_waiting_outlives_a_fast_path_failing_before_it_went_out(
    daemon: RunningDaemon, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(FastChannel, "SEND_POSTED_S", 60.0)  # it waits for the next call
    key = entry_key(1)
    with ChunkStoreClient(daemon.unix) as client, ChunkStoreClient(daemon.unix) as other:
        assert client.put(key, *random_kv(5), virtual_start=0)
        [lease] = client.acquire([key])
        assert lease is not None
        client.release([lease.lease_id], wait=False)
        _drop_fast_path(client)
        # The call that finds the fast path failed goes on over gRPC, after the release.
        assert client.lookup([key])[0] is not None and not client.fast
        assert other.stats().active_leases == 0
        assert other.evict([key]).evicted == 1  # not pinned by the lease
        assert client.posted_calls_lost == 0


def test_a_release_the_posting_thread_cannot_send_goes_over_grpc(
    daemon: RunningDaemon,
) -> None:
    key = entry_key(1)
    with ChunkStoreClient(daemon.unix) as client, ChunkStoreClient(daemon.unix) as other:
        assert client.put(key, *random_kv(5), virtual_start=0)
        [lease] = client.acquire([key])
        assert lease is not None and other.stats().active_leases == 1
        _drop_fast_path(client)
        client.release([lease.lease_id], wait=False)  # then no call: it goes alone, and fails
        deadline = time.monotonic() + 10
        while other.stats().active_leases and time.monotonic() < deadline:
            time.sleep(0.01)
        assert other.stats().active_leases == 0
        assert other.evict([key]).evicted == 1
        assert client.lookup([key]) == [None] and not client.fast


def _raw(path: str) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(5)
    sock.connect(path)
    return sock


def test_what_is_not_a_frame_closes_only_its_connection(daemon: RunningDaemon) -> None:
    path = daemon.ready["fast"]
    with ChunkStoreClient(daemon.unix) as client:
        assert client.fast
        oversized = _raw(path)
        oversized.sendall(struct.pack("<IB", 1 << 31, 1))  # a frame of 2 GiB
        reply = oversized.recv(4096)
        assert b"at most" in reply and oversized.recv(1) == b""  # said why, then closed
        unknown = _raw(path)
        unknown.sendall(struct.pack("<IB", 1, 99))
        assert b"no method" in unknown.recv(4096) and unknown.recv(1) == b""
        garbage = _raw(path)
        garbage.sendall(struct.pack("<IB", 4, 1) + b"\xff\xff\xff")  # not a LookupRequest
        assert b"Lookup" in garbage.recv(4096)
        cut = _raw(path)
        cut.sendall(struct.pack("<IB", 100, 1) + b"abc")  # then dies halfway
        cut.close()
        for sock in (oversized, unknown, garbage):
            sock.close()
        assert client.lookup([entry_key(1)]) == [None]  # the others go on
        assert client.fast
    assert "fast path: closed a connection" in daemon.log()


def _refused(sock: socket.socket) -> bytes:
    """What the daemon said on ``sock`` before it closed it; fails (the socket's timeout) when
    it keeps the connection open instead."""
    said = b""
    with contextlib.suppress(ConnectionResetError):  # it closed with our bytes unread
        while piece := sock.recv(4096):
            said += piece
    return said


def _declare(path: str, kind: int, length: int) -> socket.socket:
    """A connection that sends a frame header declaring ``length`` payload bytes, then all of
    them as fast as the daemon takes them (stopped by its close)."""
    sock = _raw(path)
    with contextlib.suppress(BrokenPipeError, ConnectionResetError):
        sock.sendall(struct.pack("<IB", length + 1, kind) + b"x" * length)
    return sock


def test_an_auth_frame_longer_than_a_token_is_refused_unread(serve) -> None:
    running = serve("--token", "s3cret")
    path = running.ready["fast"]
    before = running.settled_rss_kib()
    held = [_declare(path, AUTH, 32 << 20) for _ in range(4)]  # 32 MiB "tokens", kept open
    for sock in held:
        assert b"a token is at most" in _refused(sock)
    assert running.rss_kib() - before < 4 << 10  # KiB: none of the 4 x 32 MiB was kept
    for sock in held:
        sock.close()
    with ChunkStoreClient(running.unix, token="s3cret") as client:
        assert client.fast and client.lookup([entry_key(1)]) == [None]


def test_a_call_before_an_admitted_auth_is_refused_unread(serve) -> None:
    running = serve("--token", "s3cret")
    path = running.ready["fast"]
    sock = _declare(path, KINDS["Lookup"], 32 << 20)  # no Auth frame first
    assert b"bearer token" in _refused(sock)
    sock.close()
    with ChunkStoreClient(running.unix, token="s3cret") as client:
        assert client.fast and client.lookup([entry_key(1)]) == [None]


def test_a_token_of_max_token_bytes_is_the_longest_the_fast_path_takes(serve) -> None:
    longest, longer = "t" * MAX_TOKEN, "a" * (MAX_TOKEN + 1)
    running = serve("--token", longest, "--admin-token", longer)
    with ChunkStoreClient(running.unix, token=longest) as client:
        assert client.fast and client.lookup([entry_key(1)]) == [None]
    with ChunkStoreClient(running.unix, token=longer) as client:
        assert not client.fast  # never offered to the fast path: gRPC carries it
        assert client.lookup([entry_key(1)]) == [None]


def test_without_the_fast_path_a_client_uses_grpc(daemon: RunningDaemon) -> None:
    os.unlink(daemon.ready["fast"])  # e.g. a tmp cleaner removed it
    with ChunkStoreClient(daemon.unix) as client:
        assert not client.fast
        assert client.put(entry_key(1), *random_kv(4), virtual_start=0)
        assert client.lookup([entry_key(1)])[0] is not None
