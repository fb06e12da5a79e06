"""``chunkstore bench workload``: the trace it generates, what each eviction policy keeps of
it, and the bench through real ``vllm serve`` processes on the tiny model."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

from chunkstore.bench.cpu import processes, tree_seconds
from chunkstore.bench.workload import connector_settings, spill_rules
from chunkstore.bench.workload_replay import furthest_next_use_hit_rate, replay_hit_rate
from chunkstore.bench.workload_trace import Trace, make_trace, prompt_text, write_dataset
from chunkstore.testing.cli import chunkstore


def test_the_trace_draws_k_documents_by_popularity_in_varying_orders() -> None:
    trace = make_trace(50, (5, 9), 400, 3, skew=1.2, rate=4.0, seed=3)
    assert trace == make_trace(50, (5, 9), 400, 3, skew=1.2, rate=4.0, seed=3)  # seeded
    assert all(len(set(r.docs)) == 3 for r in trace.requests)
    drawn = Counter(d for r in trace.requests for d in r.docs)
    ranked = [count for _, count in drawn.most_common()]
    assert ranked[0] > 5 * ranked[len(ranked) // 2]  # Zipf: a head of popular documents
    top = drawn.most_common(1)[0][0]
    places = {r.docs.index(top) for r in trace.requests if top in r.docs}
    assert places == {0, 1, 2}  # the same document, retrieved at every position
    arrivals = [r.at for r in trace.requests]
    assert arrivals == sorted(arrivals) and 60 < arrivals[-1] < 140  # ~400 / 4 per second
    assert all(5 <= len(doc.split()) <= 9 for doc in trace.docs)
    assert len({r.question for r in trace.requests}) == 400


def test_worth_keeps_more_of_a_zipf_trace_than_lru_in_a_quarter_of_its_working_set() -> None:
    """Replayed through the daemon's index (exact, no timing), a word a token."""
    for seed in (0, 1, 2):
        trace = make_trace(200, (40, 160), 300, 3, skew=1.0, rate=0.0, seed=seed)
        tokens = [len(doc.split()) for doc in trace.docs]
        lru, worth = (replay_hit_rate(trace, tokens, 0.25, p) for p in ("lru", "worth"))
        offline = furthest_next_use_hit_rate(trace, tokens, 0.25)
        assert lru + 0.03 < worth < offline, (seed, lru, worth, offline)
        # With room for everything, every policy misses only each document's first use.
        whole = {p: replay_hit_rate(trace, tokens, 1.0, p) for p in ("lru", "worth")}
        first_uses = sum(tokens[d] for d in {d for r in trace.requests for d in r.docs})
        looked = sum(tokens[d] for r in trace.requests for d in r.docs)
        assert whole["lru"] == whole["worth"] == 1 - first_uses / looked
    # Popularity that changes halfway (another ranking of the same corpus): worth follows.
    first = make_trace(200, (40, 160), 600, 3, skew=1.0, rate=0.0, seed=0)
    then = make_trace(200, (40, 160), 600, 3, skew=1.0, rate=0.0, seed=1)
    shifted = Trace(first.docs, first.requests + then.requests)
    tokens = [len(doc.split()) for doc in first.docs]
    assert replay_hit_rate(shifted, tokens, 0.25, "worth") > replay_hit_rate(
        shifted, tokens, 0.25, "lru"
    )


# In CI (issue 72): the router's way with the hook off, beside APC and the store (~140 s; the
# P/D test's prompts were halved for it).
def test_bench_workload_through_vllm_serve_on_the_tiny_model(tmp_path: Path) -> None:
    dataset = tmp_path / "trace.jsonl"
    run = chunkstore(
        "bench", "workload", "--json", "--model", "tiny", "--docs", "12", "--doc-words", "30-60",
        "--requests", "16", "--concurrency", "4", "--pool-shares", "2.0", "--policies",
        "worth", "--curve", "0.5", "--dataset", str(dataset), "--disk-shares", "1.0",
        "--disk-share", "1.0", "--spills", "commit", "--ttfts", str(tmp_path / "ttfts.jsonl"),
        "--router", "--plot", str(tmp_path / "workload.png"),
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    assert (tmp_path / "workload.png").stat().st_size > 10_000  # the run's picture
    rows = [json.loads(line) for line in run.stdout.splitlines()]
    curve = [r for r in rows if r["way"] == "replay"]
    assert {r["policy"] for r in curve} == {"worth", "furthest_next_use"}
    assert all(0 < r["store_hit_rate"] <= 1 for r in curve)
    # Over a disk tier as large as the working set: write-through writes more than read-again
    # (what one request alone asks for), and loses no hit rate to it.
    disk = {r["spill"]: r for r in rows if r["way"] == "replay-disk"}
    assert list(disk) == ["commit", "read-again"]
    commit, again = disk["commit"], disk["read-again"]
    written = "disk_tokens_written_per_request"
    assert commit[written] > again[written] > 0
    assert commit["store_hit_rate"] >= again["store_hit_rate"]
    # A pool twice the working set: the tiny model's entries round up to whole blocks, and
    # the router's way stores its relevant documents too (hookless_from), so a pool of the
    # working set's bytes evicts chunks sent cold before their request loads them.
    apc, worth, routed = (r for r in rows if not r["way"].startswith("replay"))
    assert (apc["way"], worth["way"]) == ("apc", "worth@2 spill=commit")
    # Behind the router with the hook off: documents sent cold first, the relevant ones last.
    assert routed["way"] == "worth@2 spill=commit router"
    assert routed["router"]["reordered"] > 0 and routed["router"]["cold_chunks_sent"] > 0
    assert routed["router"]["cold_chunks_failed"] == 0 == routed["router"]["fallbacks"]
    assert routed["connector"]["load_failures"] == 0 < routed["connector"]["loaded_tokens"]
    # Its daemon had a disk tier, written through: every entry it stored, at least once.
    assert worth["disk_share"] == 1.0 and worth["spill"] == "commit"
    assert worth["disk_bytes_written_per_request"] > 0
    # vLLM's prefix cache reuses a prompt up to its first reordered document; the store
    # supplies the documents wherever they stand: counted by vLLM, not timed.
    assert worth["prompt_hit_rate"] > apc["prompt_hit_rate"] + 0.2, (apc, worth)
    assert worth["store_hit_rate"] > 0.3
    figures = ("throughput_vs_apc", "ttft_p50_vs_apc", "ttft_p99_vs_apc", "ttft_p99_warm_vs_apc")
    for figure in (*figures, "tpot_s"):
        assert worth[figure] > 0, figure
    assert worth["pool_bytes"] >= worth["working_set_bytes"]
    # Where each way's CPU went a request, by process tree, over its traffic alone.
    assert set(apc["cpu_ms_per_request"]) == {"vllm", "client"}
    assert set(worth["cpu_ms_per_request"]) == {"vllm", "daemon", "client"}
    assert set(routed["cpu_ms_per_request"]) == {"vllm", "daemon", "router", "client"}
    for row in (apc, worth, routed):
        assert row["cpu_ms_per_request"]["vllm"] > 0 < row["cpu_ms_per_request"]["client"]
    assert routed["cpu_ms_per_request"]["router"] > 0
    # The warm percentiles leave out the first fifth of the trace (the cold start).
    assert 0 < worth["ttft_p50_warm_s"] <= worth["ttft_p99_warm_s"]
    # A request's whole time: its first token and then its decodes.
    for row in (apc, worth, routed):
        assert row["ttft_p50_s"] < row["latency_p50_s"] <= row["latency_p99_s"]
    # Each way's TTFTs a request, in trace order, beside the figures (not in them).
    lines = (tmp_path / "ttfts.jsonl").read_text().splitlines()
    ttfts = {row["way"]: row["ttfts_s"] for row in map(json.loads, lines)}
    assert list(ttfts) == ["apc", "worth@2 spill=commit", "worth@2 spill=commit router"]
    assert "ttfts_s" not in worth
    for way, row in (("apc", apc), ("worth@2 spill=commit", worth)):
        assert len(ttfts[way]) == 16 and max(ttfts[way]) >= row["ttft_p99_s"] > 0

    lines = [json.loads(line) for line in dataset.read_text().splitlines()]
    assert len(lines) == 16 and all(line["output_tokens"] == 8 for line in lines)
    # vLLM's own `vllm bench serve` replays such a file: tests/connector/test_ingest.py.


def test_the_dataset_is_the_prompts_vllm_bench_serve_reads(tmp_path: Path) -> None:
    trace = make_trace(5, (3, 4), 4, 2, skew=1.0, rate=0.0)
    prompts = [prompt_text(trace, r, "##") for r in trace.requests]
    assert all(len(p.split("##")) == 4 for p in prompts)  # sys, two documents, the question
    write_dataset(tmp_path / "d.jsonl", prompts, 3)
    rows = [json.loads(line) for line in (tmp_path / "d.jsonl").read_text().splitlines()]
    assert rows == [{"prompt": p, "output_tokens": 3} for p in prompts]


def test_connector_settings_are_json_objects_each_a_way() -> None:
    assert connector_settings(None) == [{}]  # the connector's defaults
    assert connector_settings(["{}", '{"relevant_recompute_tokens": 0}']) == [
        {},
        {"relevant_recompute_tokens": 0},
    ]
    for bad, why in (("{", "not JSON"), ("[1]", "a JSON object")):
        with pytest.raises(SystemExit, match=why):
            connector_settings([bad])


def test_spill_rules_are_checked_before_any_way_runs() -> None:
    def rules(disk_share: float, spills: str) -> list[str]:
        return spill_rules(argparse.Namespace(disk_share=disk_share, spills=spills))

    assert rules(0.0, "commit,typo") == [""]  # no disk tier: one way each, no rule
    assert rules(0.5, "commit,read-again") == ["commit", "read-again"]
    with pytest.raises(SystemExit, match="--spills sometimes: not a spill rule"):
        rules(0.5, "commit,sometimes")


def test_cpu_counts_a_process_tree_descendants_included() -> None:
    # A shell whose child burns ~0.6 s of CPU and then sleeps: the shell's own is ~0, the
    # tree's is the child's.
    burn = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.6: pass\n"
    shell = subprocess.Popen(["sh", "-c", f"{sys.executable} -c '{burn}time.sleep(30)'; true"])
    try:
        deadline = time.monotonic() + 30
        while tree_seconds({"shell": shell.pid})["shell"] < 0.5:
            assert time.monotonic() < deadline, "the grandchild's CPU was never counted"
            time.sleep(0.1)
        assert tree_seconds({"shell": shell.pid})["shell"] < 5
        assert processes()[shell.pid][1] < 0.2  # the shell itself did not burn it
    finally:
        shell.kill()
        shell.wait()
