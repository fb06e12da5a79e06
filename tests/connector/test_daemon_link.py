"""The connector's link to its daemon (``DaemonLink``) against real daemon processes: a
restarted daemon is used again without recomputing forever, and the lost session is counted."""

from __future__ import annotations

from chunkstore.connector_config import ConnectorConfig
from chunkstore.testing.entries import entry_key, random_kv, wait_for
from chunkstore_vllm.client_holder import DaemonLink
from chunkstore_vllm.metrics import ConnectorStats


def test_a_restarted_daemon_is_used_again_and_the_lost_session_counted(serve) -> None:
    first = serve("--lease-ttl-s", "1")
    stats = ConnectorStats()
    link = DaemonLink(ConnectorConfig(address=first.unix), "test", stats)
    try:
        client = link.get()
        assert client is not None and client.put(entry_key(1), *random_kv(4), 0)
        assert first.stop() == 0
        serve("--lease-ttl-s", "1")  # the same socket path
        wait_for(lambda: client.sessions_reopened == 1, timeout=60)
        assert link.get() is client  # kept: its session came back
        assert stats.data["sessions_reopened"] == 1
        assert client.put(entry_key(2), *random_kv(4), 0)
        assert link.get() is client and stats.data["sessions_reopened"] == 1  # counted once
        assert link.failures == 0
    finally:
        link.close()


def test_connecting_at_start_up_opens_the_session_or_leaves_the_first_request_to_retry(
    serve, tmp_path
) -> None:
    absent = DaemonLink(
        ConnectorConfig(address=f"unix:{tmp_path}/none.sock"), "test", ConnectorStats()
    )
    absent.connect_early()  # warned, not waited out: the first request tries again
    assert absent.failures == 1
    assert absent.get() is None and absent.failures == 2
    daemon = serve()
    link = DaemonLink(ConnectorConfig(address=daemon.unix), "test", ConnectorStats())
    try:
        assert daemon.scrape()["chunkstore_sessions"] == 0
        link.connect_early()
        assert daemon.scrape()["chunkstore_sessions"] == 1 and link.failures == 0
    finally:
        link.close()
