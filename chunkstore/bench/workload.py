"""``chunkstore bench workload``: RAG traffic through vLLM's OpenAI server, three ways in one run.

A generated trace: a corpus of ``--docs`` documents of ``--doc-tokens`` tokens (a range),
each request ``--k`` of them drawn by Zipf popularity (``--skew``) in a shuffled order, under
a question of its own; arrivals Poisson at ``--rate`` requests/s (or ``--concurrency`` at
once). The same requests, through the stock ``openai`` client (streamed, so TTFT is the first
token's arrival), are sent to:
- ``apc``: vLLM with its own prefix caching and no connector;
- ``lru`` and ``worth``: vLLM (prefix caching on too) with the connector and a daemon whose
  pool holds ``--pool-shares`` of the trace's working set (the KV of every document it
  uses), evicting by that policy (``serve --eviction``); with several ``--connector``
  settings, each pool share and policy once per setting (the way's name says which);
- with ``--router``, each of those ways once more behind ``chunkstore router`` with the
  connector's in-band hook off (``inband_isolation: false``: what a CUDA or Ascend back end
  runs): the router sends a request's missing documents as their own prompts first and its
  relevant documents last, computed there by vLLM (the way's name ends in `` router``; its
  ``router`` figures: requests reordered, cold prefills sent). Its ``prompt_hit_rate`` and
  ``store_hit_rate`` count those prefills too (each new document computed once as its own
  prompt, then loaded by its request): compare its requests/s and TTFTs, not its hit rates.
Per way: ``prompt_hit_rate`` (prompt tokens vLLM did not compute: its prefix cache's hits
and what chunkstore supplied, over all), ``store_hit_rate`` (the daemon's, of the chunk
tokens looked up: what the policies compete on), TTFT p50/p90/p99, TPOT, a request's whole
time (``latency_p50_s``, p99), request throughput, ``cpu_ms_per_request`` (CPU over the
traffic a request: vLLM's processes, the daemon, the router, the bench's own client: they
share the host's cores); and ``throughput_vs_apc``, ``ttft_p50_vs_apc``,
``ttft_p99_vs_apc`` (APC's TTFT over the way's: above 1 is faster); ``*_warm`` TTFTs leave
out the first fifth of the trace, the cold start (``ttft_p99_warm_vs_apc``). With
``--disk-share``, each way's daemon has a disk tier too, once per ``--spills`` rule (``serve
--spill``): the way reports the disk bytes written a request and the bytes the tier served.
Before them, the trace replayed through the daemon's own index at ``--curve`` pool shares
for each policy and for furthest-next-use (Belady's offline rule: the headroom above them):
the hit-rate curve to size a pool by (``--curve-only``: just that, in seconds); with
``--disk-shares``, also over a disk tier of each share, per spill rule (``serve --spill``):
the hit rate of both tiers and the disk tokens written a request.
The trace is also written as a JSONL dataset ``vllm bench serve --dataset-name custom``
replays (``--dataset``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from chunkstore.bench.cpu import cpu_per_request
from chunkstore.bench.workload_replay import furthest_next_use_hit_rate, replay, replay_hit_rate
from chunkstore.bench.workload_trace import Trace, make_trace, prompt_text, write_dataset
from chunkstore.bench.workload_traffic import prompt_hit_rate, router_figures, scrape, send
from chunkstore.models import kv_bytes_per_token, resolve

if TYPE_CHECKING:
    from chunkstore.processes.router import RunningRouter

BLOCK = 64 << 10  # the daemon's block: small, so that a pool share is what entries get


@dataclass(frozen=True)
class Setup:
    """What every way of one run shares: the trace, its prompts and its sizes."""

    model: Path
    trace: Trace
    prompts: list[str]
    doc_tokens: list[int]  # each corpus document's tokens
    used: list[int]  # the documents the trace's requests retrieve
    working_set: int  # the KV bytes of those documents
    max_len: int  # vLLM's --max-model-len for the longest prompt
    figures: dict[str, Any]  # the trace's own figures, in every row


def run(args: argparse.Namespace) -> Iterator[dict[str, Any]]:
    connectors = connector_settings(args.connector)  # a typo fails here, not after apc
    spills = spill_rules(args)
    setup = _setup(args)
    yield from _curve(args, setup)
    if args.curve_only:
        return
    from chunkstore.processes.vllm_server import VllmServer

    with tempfile.TemporaryDirectory(prefix="chunkstore-workload-") as tmp:
        work = Path(tmp)
        _progress(f"apc: {len(setup.prompts)} requests, working set {setup.working_set >> 20} MiB")
        server = VllmServer(
            setup.model, work / "apc", None, setup.max_len, extra=APC_FLAG, env=CPU_ENV
        )
        try:
            cpu: dict[str, Any] = {}
            with cpu_per_request({"vllm": server.process.pid}, len(setup.prompts), cpu):
                apc = send(server.url, str(setup.model), setup.trace, setup.prompts, args)
            apc |= cpu
            apc["prompt_hit_rate"] = prompt_hit_rate(scrape(server.url))
        finally:
            server.stop()
        _write_ttfts(args, "apc", apc)
        yield {"way": "apc", **setup.figures, **apc}
        ways = [
            Way(share, policy, settings, rule, router)
            for share in [float(s) for s in args.pool_shares.split(",")]
            for policy in args.policies.split(",")
            for settings in connectors
            for rule in spills
            for router in ((False, True) if args.router else (False,))
        ]
        for index, way in enumerate(ways):
            # The way's folder is not named after it: a socket path must stay short.
            figures = _chunkstore_way(args, setup, way, work / f"way{index}")
            _compare(figures, apc)
            _write_ttfts(args, way.name, figures)
            yield {"way": way.name, **setup.figures, **figures}


APC_FLAG = ("--enable-prefix-caching",)
# The same CPU binding for every way: vLLM otherwise reserves one more core for itself when a
# connector is configured (docs/benchmarks.md, bench e2e).
CPU_ENV = {"VLLM_CPU_NUM_OF_RESERVED_CPU": "1"}


@dataclass(frozen=True)
class Way:
    """One chunkstore way: a pool share, an eviction policy, connector settings and (with a
    disk tier) a spill rule ("" without one)."""

    share: float
    policy: str
    settings: dict[str, Any]
    spill: str
    router: bool = False  # behind ``chunkstore router``, the connector's hook off

    @property
    def name(self) -> str:
        name = f"{self.policy}@{self.share:g}"
        name += "".join(f" {k}={v}" for k, v in self.settings.items())
        name += f" spill={self.spill}" if self.spill else ""
        return name + (" router" if self.router else "")


def spill_rules(args: argparse.Namespace) -> list[str]:
    """The ``--spills`` rules with a disk tier (checked before any way runs), else [""]."""
    from chunkstore.daemon.spill import SpillWhen

    if not args.disk_share:
        return [""]
    rules = args.spills.split(",")
    known = [str(w) for w in SpillWhen]
    if unknown := [r for r in rules if r not in known]:
        raise SystemExit(f"--spills {','.join(unknown)}: not a spill rule ({', '.join(known)})")
    return rules


def _setup(args: argparse.Namespace) -> Setup:
    from transformers import AutoTokenizer

    from chunkstore.prompts import AUTO, separator_ids

    model = resolve(args.model)
    tok = AutoTokenizer.from_pretrained(model)
    separator = str(tok.decode(separator_ids(tok, AUTO)))
    low, _, high = args.doc_words.partition("-")
    trace = make_trace(
        args.docs, (int(low), int(high or low)), args.requests, args.k, args.skew, args.rate
    )
    prompts = [prompt_text(trace, r, separator) for r in trace.requests]
    used = sorted({d for r in trace.requests for d in r.docs})
    doc_tokens = [len(tok.encode(doc, add_special_tokens=False)) for doc in trace.docs]
    working_set = sum(doc_tokens[d] for d in used) * kv_bytes_per_token(model)
    longest = max(len(tok.encode(p)) for p in prompts)
    if args.dataset:
        write_dataset(Path(args.dataset), prompts, args.output_tokens)
    figures = {
        "bench": "workload",
        "model": args.model,
        "requests": len(prompts),
        "docs": args.docs,
        "docs_used": len(used),
        "k": args.k,
        "skew": args.skew,
        "rate": args.rate,
        "concurrency": args.concurrency,
        "output_tokens": args.output_tokens,
        "working_set_bytes": working_set,
        "prompt_tokens_max": longest,
    }
    max_len = max(2048, 1 << (longest + args.output_tokens + 64).bit_length())
    return Setup(model, trace, prompts, doc_tokens, used, working_set, max_len, figures)


def _curve(args: argparse.Namespace, setup: Setup) -> Iterator[dict[str, Any]]:
    """The curve to size a pool by: hit rate against pool share, by the daemon's index alone;
    with ``--disk-shares``, over a disk tier too: what each spill rule writes, and the hit
    rate it keeps."""
    from chunkstore.daemon.spill import SpillWhen

    trace, doc_tokens = setup.trace, setup.doc_tokens
    for share in [float(x) for x in args.curve.split(",") if x]:
        curve = {
            **{p: replay_hit_rate(trace, doc_tokens, share, p) for p in args.policies.split(",")},
            "furthest_next_use": furthest_next_use_hit_rate(trace, doc_tokens, share),
        }
        for policy, rate in curve.items():
            row = {"policy": policy, "pool_share": share, "store_hit_rate": round(rate, 4)}
            yield {"way": "replay", **setup.figures, **row}
        for disk_share in [float(x) for x in args.disk_shares.split(",") if x]:
            for policy in args.policies.split(","):
                for spill in SpillWhen:
                    got = replay(trace, doc_tokens, share, policy, disk_share, spill.value)
                    row = {"policy": policy, "pool_share": share, "disk_share": disk_share}
                    row |= {"spill": spill, **{k: round(v, 4) for k, v in got.items()}}
                    yield {"way": "replay-disk", **setup.figures, **row}


def _chunkstore_way(
    args: argparse.Namespace, setup: Setup, way: Way, way_dir: Path
) -> dict[str, Any]:
    """The trace through vLLM with the connector over a daemon of ``way``'s pool: the
    client's figures, the connector's counters a request, the daemon's hit rate (and its
    disk tier's bytes)."""
    from chunkstore.daemon.disk import HEADER
    from chunkstore.processes.daemon import memory_dir, start_daemon
    from chunkstore.processes.vllm_server import VllmServer

    pool = max(16 * BLOCK, int(way.share * setup.working_set))
    _progress(f"{way.name}: pool {pool >> 20} MiB")
    tier: tuple[str, ...] = ()
    if way.spill:  # a disk tier of --disk-share of the working set, and its files' headers
        disk_bytes = int(args.disk_share * setup.working_set) + 4 * HEADER * len(setup.used)
        tier = ("--disk-dir", str(way_dir / "disk"), "--disk-size", str(disk_bytes))
        tier += ("--spill", way.spill)
    with start_daemon(
        way_dir,
        *("--eviction", way.policy, *tier),
        pool_bytes=pool,
        block_size=BLOCK,
        shm_dir=memory_dir(pool),
    ) as daemon:
        connector = {**way.settings, "address": daemon.unix}
        if way.router:
            connector["inband_isolation"] = False
        server = VllmServer(
            setup.model, way_dir, connector, setup.max_len, extra=APC_FLAG, env=CPU_ENV
        )
        try:
            front = _front(way, server.url, daemon.unix, setup.model, way_dir, connector)
            with front as (url, router):
                pids = {"vllm": server.process.pid, "daemon": daemon.process.pid}
                if router is not None:
                    pids["router"] = router.process.pid
                cpu: dict[str, Any] = {}
                with cpu_per_request(pids, len(setup.prompts), cpu):
                    figures = send(url, str(setup.model), setup.trace, setup.prompts, args)
                figures |= cpu
                if router is not None:
                    figures["router"] = router_figures(router)
            figures["prompt_hit_rate"] = prompt_hit_rate(scrape(server.url))
            # The connector's own counters a request: where its time went.
            requests = len(setup.prompts)
            counters = sorted(server.counters().items())
            figures["connector"] = {k: round(v / requests, 4) for k, v in counters}
        finally:
            server.stop()
        stats = daemon.scrape()
    chunk = 'kind="chunk"'
    looked = stats.get(f"chunkstore_lookup_tokens_by_kind_total{{{chunk}}}", 0.0)
    found = stats.get(f"chunkstore_hit_tokens_by_kind_total{{{chunk}}}", 0.0)
    figures["store_hit_rate"] = round(found / looked, 4) if looked else None
    if way.spill:  # what the disk tier wrote and served
        figures["disk_share"], figures["spill"] = args.disk_share, way.spill
        written = stats.get("chunkstore_disk_spill_bytes_total", 0.0)
        figures["disk_bytes_written_per_request"] = round(written / len(setup.prompts))
        figures["disk_hit_bytes"] = stats.get("chunkstore_disk_promoted_bytes_total", 0)
    figures["pool_share"] = way.share
    figures["pool_bytes"] = pool
    return figures


@contextlib.contextmanager
def _front(
    way: Way, instance: str, daemon: str, model: Path, way_dir: Path, connector: dict[str, Any]
) -> Iterator[tuple[str, RunningRouter | None]]:
    """Where a way's requests go: the instance, or a ``chunkstore router`` before it, on the
    instance's own settings (``connector``: its kv_connector_extra_config)."""
    if not way.router:
        yield instance, None
        return
    from chunkstore.processes.router import RunningRouter

    router = RunningRouter(
        way_dir / "router",
        *("--instance", instance, "--address", daemon, "--model", model),
        *("--connector-config", json.dumps(connector)),
    )
    try:
        yield router.url, router
    finally:
        router.stop()


def _write_ttfts(args: argparse.Namespace, way: str, figures: dict[str, Any]) -> None:
    """A way's per-request TTFTs (trace order) to ``--ttfts``, a JSON line a way; out of the
    figures either way (300 numbers a row)."""
    ttfts = figures.pop("ttfts_s")
    if args.ttfts:
        with open(args.ttfts, "a") as out:
            out.write(json.dumps({"way": way, "ttfts_s": ttfts}) + "\n")


def _compare(figures: dict[str, Any], apc: dict[str, Any]) -> None:
    """A way's figures against APC's: above 1 is better."""
    figures["throughput_vs_apc"] = round(figures["throughput_rps"] / apc["throughput_rps"], 3)
    for ttft in ("ttft_p50", "ttft_p99", "ttft_p99_warm"):
        figures[f"{ttft}_vs_apc"] = round(apc[f"{ttft}_s"] / figures[f"{ttft}_s"], 3)


def connector_settings(given: list[str] | None) -> list[dict[str, Any]]:
    """The ``--connector`` settings, parsed (the defaults, ``{}``, when none is given)."""
    settings = []
    for text in given or ["{}"]:
        try:
            parsed = json.loads(text)
        except json.JSONDecodeError as err:
            raise SystemExit(f"--connector {text!r}: not JSON ({err})") from None
        if not isinstance(parsed, dict):
            raise SystemExit(f"--connector {text!r}: a JSON object of connector settings")
        settings.append(parsed)
    return settings


def _progress(what: str) -> None:
    print(f"bench workload: {what}", file=sys.stderr, flush=True)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    _trace_arguments(parser)
    _pool_arguments(parser)
    _way_arguments(parser)


def _trace_arguments(parser: argparse.ArgumentParser) -> None:
    """The trace: its corpus, its requests and their arrivals."""
    parser.add_argument("--model", default="smollm2", help="model name or folder")
    parser.add_argument("--docs", type=int, default=200, help="documents in the corpus (200)")
    parser.add_argument(
        "--doc-words", default="40-160", help="words a document has, a range (40-160)"
    )
    parser.add_argument("--requests", type=int, default=300, help="requests in the trace (300)")
    parser.add_argument("--k", type=int, default=3, help="documents a request retrieves (3)")
    parser.add_argument("--skew", type=float, default=1.0, help="Zipf skew of popularity (1.0)")
    parser.add_argument(
        "--rate", type=float, default=2.0, help="Poisson arrivals a second (2; 0: all at once)"
    )
    parser.add_argument(
        "--concurrency", type=int, default=0, help="requests in flight instead of arrivals (0)"
    )
    parser.add_argument("--output-tokens", type=int, default=8, help="tokens generated (8)")


def _pool_arguments(parser: argparse.ArgumentParser) -> None:
    """The pools the ways run with, and the replayed curve's."""
    parser.add_argument(
        "--pool-shares",
        default="0.25,1.0",
        help="pool sizes as shares of the working set, one run each (0.25,1.0)",
    )
    parser.add_argument("--policies", default="lru,worth", help="eviction policies (lru,worth)")
    parser.add_argument(
        "--curve",
        default="0.1,0.25,0.5,0.75,1.0",
        help="pool shares to replay the trace at through the daemon's index alone, per policy "
        "and against furthest-next-use (offline): the hit-rate curve ('' for none)",
    )
    parser.add_argument(
        "--disk-shares",
        default="",
        help="disk tiers, as shares of the working set, to replay the curve with too (e.g. "
        "0.5,1.0): per policy and spill rule (serve --spill), the hit rate of both tiers and "
        "the disk tokens written a request (default: none)",
    )
    parser.add_argument(
        "--curve-only", action="store_true", help="only the curve: no vLLM (seconds)"
    )
    parser.add_argument(
        "--disk-share",
        type=float,
        default=0.0,
        help="give each chunkstore way's daemon a disk tier of this share of the working set "
        "(0: none), once per --spills rule: the way reports the disk bytes written a request "
        "and the bytes it served",
    )
    parser.add_argument(
        "--spills",
        default="commit,read-again",
        help="with --disk-share: the spill rules (serve --spill) to run each way with "
        "(commit,read-again)",
    )


def _way_arguments(parser: argparse.ArgumentParser) -> None:
    """The connector's settings, the router, and what is written beside the rows."""
    parser.add_argument(
        "--connector",
        action="append",
        help="the connector's settings for the chunkstore ways, JSON (default: its defaults), "
        'e.g. \'{"relevant_recompute_tokens": 0, "load_cpus": "all"}\'; given more than once, '
        "every pool share and policy runs once with each ('{}': the defaults)",
    )
    parser.add_argument(
        "--router",
        action="store_true",
        help="run every chunkstore way once more behind `chunkstore router`, the connector's "
        "in-band hook off (as on CUDA / Ascend): missing documents sent first as their own "
        "prompts, the relevant ones last (ways named '... router')",
    )
    parser.add_argument(
        "--ttfts",
        default="",
        help="append each way's per-request TTFTs (trace order) here, a JSON line a way: "
        "which requests make the p99",
    )
    parser.add_argument(
        "--dataset", default="", help="write the trace here as a vllm bench serve JSONL dataset"
    )
