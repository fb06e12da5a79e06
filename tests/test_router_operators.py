"""Who reads the router's /metrics (instance URLs, daemons, how requests went): real router
processes listening on every address, asked from this host's own non-loopback address, as a
caller on another host asks. The stand-in instance answers nothing the tests read."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest

from chunkstore.processes.router import RunningRouter

TOKEN = "operators-only"


class Silent(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture(scope="module")
def upstream() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), Silent)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_port}"
    server.shutdown()


@pytest.fixture(scope="module")
def outside() -> str:
    """This host's address on its network (a caller from it is not on loopback)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(("192.0.2.1", 9))  # no packet is sent: the route picks the address
            address = str(probe.getsockname()[0])
        except OSError:
            pytest.skip("no network address besides loopback")
    if address.startswith("127."):
        pytest.skip("no network address besides loopback")
    return address


def _start(workdir: Path, upstream: str, *flags: str) -> RunningRouter:
    return RunningRouter(workdir, "--instance", upstream, "--host", "0.0.0.0", *flags)


def _metrics(router: RunningRouter, host: str, headers: dict[str, str]) -> httpx.Response:
    port = router.url.rsplit(":", 1)[1]
    return httpx.get(f"http://{host}:{port}/metrics", headers=headers, timeout=10)


def test_an_empty_operator_token_is_refused_not_everyones(
    upstream, outside, tmp_path, monkeypatch
) -> None:
    """CHUNKSTORE_ROUTER_OPERATOR_TOKEN set but empty (an empty secret, a unit file's
    ``Environment=...=``): the router refuses to start and says why. It used to take ""
    as the token, which every caller without one presents: /metrics, instance URLs and
    all, went to anyone on the network."""
    monkeypatch.setenv("CHUNKSTORE_ROUTER_OPERATOR_TOKEN", "")
    with pytest.raises(RuntimeError, match="operator token .* is empty"):
        router = _start(tmp_path / "env", upstream)
        try:  # it started: what it now tells a caller from the network is the failure
            reply = _metrics(router, outside, {})
            assert reply.status_code == 403 and upstream not in reply.text, reply.text
        finally:
            router.stop()
    monkeypatch.delenv("CHUNKSTORE_ROUTER_OPERATOR_TOKEN")
    with pytest.raises(RuntimeError, match="operator token .* is empty"):
        _start(tmp_path / "flag", upstream, "--operator-token", " ").stop()


def test_metrics_go_to_the_token_or_else_to_this_host_only(upstream, outside, tmp_path) -> None:
    """With --operator-token, /metrics needs it (Prometheus's bearer credentials), from
    anywhere; an empty one is no token. Without one, callers on this host only (the
    shipped Prometheus config scrapes 127.0.0.1)."""
    guarded = _start(tmp_path / "guarded", upstream, "--operator-token", TOKEN)
    try:
        for headers in ({}, {"Authorization": "Bearer"}, {"x-chunkstore-operator": ""}):
            for host in (outside, "127.0.0.1"):
                refused = _metrics(guarded, host, headers)
                assert refused.status_code == 403, (host, headers)
                assert upstream not in refused.text
        told = _metrics(guarded, outside, {"Authorization": f"Bearer {TOKEN}"})
        assert told.status_code == 200 and upstream in told.text
    finally:
        assert guarded.stop() == 0
    open_here = _start(tmp_path / "open", upstream)
    try:
        assert _metrics(open_here, outside, {}).status_code == 403
        assert _metrics(open_here, "127.0.0.1", {}).status_code == 200
    finally:
        assert open_here.stop() == 0
