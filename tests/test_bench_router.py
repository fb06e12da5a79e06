"""``chunkstore bench router`` through two real ``vllm serve`` instances (the tiny model, the
hook off), their daemons sharing a real Redis, and a real router process."""

from __future__ import annotations

import json

import pytest

from chunkstore.testing.cli import chunkstore


@pytest.mark.release  # a bench mode's plumbing (~2 min): before a release, not in CI's budget
def test_bench_router_on_the_tiny_model() -> None:
    run = chunkstore(
        "bench", "router", "--json", "--model", "tiny", "--requests", "4", "--doc-words", "30-60"
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    rows = {row["phase"]: row for row in map(json.loads, run.stdout.splitlines())}
    assert list(rows) == ["cold", "warm", "placement"]
    for row in rows.values():
        assert row["router_p50_s"] > 0 and row["straight_p50_s"] > 0
        ratio = row["router_p50_s"] / row["straight_p50_s"]
        assert row["router_vs_straight"] == pytest.approx(ratio, abs=0.01)
    # Every request over the second node's documents went to the second node.
    assert rows["placement"]["placed"] == 1.0
