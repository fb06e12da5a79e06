"""The router's own bounds, tested on a real router process over real sockets, where no
instance is asked (so no vLLM is needed): bodies too big or too slow, half-sent requests,
too many connections, JSON it cannot read; and an upstream's cookies kept from other
clients (a stand-in upstream: vLLM sets no cookies). The bounds on work for a real vLLM's
requests: tests/test_router.py."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

from chunkstore.kv.keyspace import KeySpace, Plan
from chunkstore.processes.router import RunningRouter
from chunkstore.router import app, limits, prompt_ids
from chunkstore.router.instances import Instance


@pytest.fixture(scope="module")
def upstream() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), CookieSetter)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_port}"
    server.shutdown()


@pytest.fixture(scope="module")
def router(upstream, tmp_path_factory) -> Iterator[RunningRouter]:
    running = RunningRouter(
        tmp_path_factory.mktemp("limits"),
        "--instance",
        upstream,
        "--max-body-bytes",
        str(1 << 20),
        "--body-timeout",
        "2",
        "--header-timeout",
        "2",
        "--max-client-connections",
        "16",
    )
    yield running
    assert running.stop() == 0, running.log_path.read_text()


def address(router: RunningRouter) -> tuple[str, int]:
    host, port = router.url.removeprefix("http://").rsplit(":", 1)
    return host, int(port)


def reply_to(sock: socket.socket) -> bytes:
    """What the router sends back until it closes the connection (b"": closed at once)."""
    sock.settimeout(30)  # far past every bound under test: a hang fails, never a slow pass
    answer = b""
    while part := sock.recv(65536):
        answer += part
        if b"\r\n\r\n" in answer and b'"error"' in answer:
            break
    return answer


def test_a_body_over_the_limit_is_refused_while_it_is_read_not_after(router) -> None:
    """413 from the declared length before a byte of the body, and from the bytes read so far
    for a chunked body that never ends (the router used to wait for the whole body)."""
    with socket.create_connection(address(router)) as sock:
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: r\r\nContent-Type: application/json\r\n"
            b"Content-Length: 600000000\r\n\r\n"
        )
        assert reply_to(sock).startswith(b"HTTP/1.1 413")
    with socket.create_connection(address(router)) as sock:
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: r\r\nContent-Type: application/json\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n"
        )
        piece = b"x" * (64 << 10)
        chunk = b"%x\r\n%s\r\n" % (len(piece), piece)
        sending = threading.Thread(target=lambda: _send_quietly(sock, chunk * 24), daemon=True)
        sending.start()  # 1.5 MiB, never the terminating chunk
        answer = reply_to(sock)
        assert answer.startswith(b"HTTP/1.1 413"), answer[:200]
        assert b"over 1048576 bytes" in answer


def _send_quietly(sock: socket.socket, data: bytes) -> None:
    with contextlib.suppress(OSError):  # the router answered and closed: what the test wants
        sock.sendall(data)


def test_a_body_that_does_not_come_is_refused_in_time(router) -> None:
    with socket.create_connection(address(router)) as sock:
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: r\r\nContent-Type: application/json\r\n"
            b"Content-Length: 100\r\n\r\n{"
        )
        answer = reply_to(sock)
        assert answer.startswith(b"HTTP/1.1 408"), answer[:200]


def test_half_sent_requests_are_closed_and_connections_are_capped(router) -> None:
    assert httpx.get(f"{router.url}/health", timeout=30).status_code == 200
    held = [socket.create_connection(address(router)) for _ in range(15)]
    try:
        for sock in held:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: r\r\n")  # headers not done
        # Past --max-client-connections (16, this one included): 503, nothing else done.
        over = httpx.get(f"{router.url}/health", timeout=30)
        assert over.status_code == 503, over.text
        # --header-timeout (2 s): every half-sent request's connection is closed.
        for sock in held:
            assert reply_to(sock) == b""
    finally:
        for sock in held:
            sock.close()
    assert httpx.get(f"{router.url}/health", timeout=30).status_code == 200


@pytest.mark.parametrize(
    ("raw", "says"),
    [
        (b"[" * 100_000 + b"]" * 100_000, "nested too deeply"),
        (b'{"prompt": "a", "max_tokens":', "not JSON"),
        (b"\xff\xfe", "not JSON"),
        (b"[1, 2]", "JSON object"),
    ],
)
def test_json_the_router_cannot_read_is_a_400_that_says_why(router, raw, says) -> None:
    reply = httpx.post(
        f"{router.url}/v1/completions",
        content=raw,
        headers={"content-type": "application/json"},
        timeout=30,
    )
    assert reply.status_code == 400, reply.text
    assert says in reply.json()["error"]["message"]


class CookieSetter(BaseHTTPRequestHandler):
    """An upstream that sets a cookie per client, as a proxy with sticky sessions in front of
    an instance does (vLLM sets none), and writes back the Cookie header it was sent."""

    def do_GET(self) -> None:
        self._answer({"object": "list", "data": [{"id": "m", "max_model_len": 1 << 30}]})

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if self.path == "/tokenize":  # a token per character, past the tiny model's separator
            self._answer({"tokens": [100 + ord(c) % 100 for c in body["prompt"]]})
            return
        if body.get("user") == "slow":
            time.sleep(5)  # past a router's --timeout of 0.5 s
        sent = self.headers.get("Cookie")
        self._answer(
            {"choices": [{"index": 0, "text": sent or "", "finish_reason": "length"}]},
            cookie=f"session={body['user']}",
        )

    def _answer(self, reply: dict, cookie: str | None = None) -> None:
        data = json.dumps(reply).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        if cookie:
            self.send_header("Set-Cookie", f"{cookie}; Path=/")
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args: object) -> None:
        pass


def test_an_upstreams_cookies_never_reach_another_clients_request(router) -> None:
    seen = []
    for user in ("alice", "bob"):
        reply = httpx.post(
            f"{router.url}/v1/completions",
            json={"prompt": "hi", "max_tokens": 1, "user": user},
            timeout=30,
        )
        assert reply.status_code == 200, reply.text
        seen.append(reply.json()["choices"][0]["text"])
    assert seen == ["", ""]  # bob's request carried no alice cookie


def test_a_big_body_is_read_and_planned_off_the_event_loop(
    upstream, tiny_model_dir, monkeypatch
) -> None:
    """The router's own app in this process, in front of the stand-in upstream: a 4 MB body
    of token IDs is parsed, read and keyed on worker threads, so other requests are served
    meanwhile (a 20 MiB body used to stall every other client's /health for 8 s), and so is
    the instance's /tokenize answer for a long text; a small body stays on the loop, where a
    thread's hand-off would cost more than it saves."""
    keys = KeySpace.for_model(tiny_model_dir, "float32")
    where: dict[str, list[bool]] = {"parse": [], "plan": [], "tokens": []}
    parse, plan, token_ids = limits.parse_body, KeySpace.plan, prompt_ids._token_ids

    def parse_body(raw: bytes) -> dict:
        where["parse"].append(threading.current_thread() is threading.main_thread())
        return parse(raw)

    def plan_of(self: KeySpace, ids: list[int], salt: str = "") -> Plan:
        where["plan"].append(threading.current_thread() is threading.main_thread())
        return plan(self, ids, salt)

    def tokens_of(reply: httpx.Response) -> list[int]:
        where["tokens"].append(threading.current_thread() is threading.main_thread())
        return token_ids(reply)

    monkeypatch.setattr(app, "parse_body", parse_body)
    monkeypatch.setattr(KeySpace, "plan", plan_of)
    monkeypatch.setattr(prompt_ids, "_token_ids", tokens_of)
    router = app.Router(app.RouterSettings(keys, [Instance(upstream, "unix:/nowhere")]))

    async def ask(ids: list[int] | str) -> int:
        transport = httpx.ASGITransport(app=router.app(), client=("127.0.0.1", 1))
        async with httpx.AsyncClient(transport=transport, base_url="http://router") as client:
            body = {"model": "m", "prompt": ids, "max_tokens": 1, "user": "big"}
            reply = await client.post("/v1/completions", json=body)
        return reply.status_code

    assert asyncio.run(ask(list(range(10, 60)))) == 200
    assert where == {"parse": [True], "plan": [True], "tokens": []}
    assert asyncio.run(ask(list(range(10, 600_010)))) == 200
    assert where == {"parse": [True, False], "plan": [True, False], "tokens": []}
    assert asyncio.run(ask("a few words")) == 200
    assert where["tokens"] == [True]
    assert asyncio.run(ask("word " * 20_000)) == 200  # 100 kB of text: 100,000 IDs back
    assert where["tokens"] == [True, False]


def test_an_instance_that_does_not_answer_is_named_by_its_place_not_its_address(
    upstream, tmp_path
) -> None:
    """A 502 tells the client which instance (its place in --instance), never its URL (the
    router's log has it)."""
    router = RunningRouter(tmp_path, "--instance", upstream, "--timeout", "0.5")
    try:
        reply = httpx.post(
            f"{router.url}/v1/completions",
            json={"prompt": "hi", "max_tokens": 1, "user": "slow"},
            timeout=30,
        )
        assert reply.status_code == 502, reply.text
        assert "instance 1 did not answer" in reply.json()["error"]["message"]
        assert upstream.removeprefix("http://") not in reply.text
    finally:
        assert router.stop() == 0
    assert upstream.removeprefix("http://") in router.log_path.read_text()
