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
tokens looked up: what the policies compete on), TTFT p50/p90/p99, TPOT, request
throughput; and ``throughput_vs_apc``, ``ttft_p50_vs_apc``, ``ttft_p99_vs_apc`` (APC's TTFT
over the way's: above 1 is faster); ``*_warm`` TTFTs leave out the first fifth of the
trace, the cold start (``ttft_p99_warm_vs_apc``). With ``--disk-share``, each way's daemon
has a disk tier too, once per ``--spills`` rule (``serve --spill``): the way reports the disk
bytes written a request and the bytes the tier served.
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
import random
import statistics
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from chunkstore.models import WORDS, kv_bytes_per_token, resolve

if TYPE_CHECKING:
    from chunkstore.processes.router import RunningRouter

BLOCK = 64 << 10  # the daemon's block: small, so that a pool share is what entries get
SYS = "You are a helpful assistant. Answer the question using only the documents below."
QUESTION = "Question {n}: which of these documents says the most about {word}?"


@dataclass(frozen=True)
class Request:
    docs: tuple[int, ...]  # corpus indices, in the order the retriever returned them
    question: str
    at: float  # seconds after the start (Poisson arrivals; 0 for all under a concurrency)


@dataclass(frozen=True)
class Trace:
    docs: list[str]
    requests: list[Request]


def make_trace(
    docs: int,
    doc_words: tuple[int, int],
    requests: int,
    k: int,
    skew: float,
    rate: float,
    seed: int = 0,
) -> Trace:
    """The corpus (texts of ``doc_words`` words, a range) and the requests: ``k`` distinct
    documents each, drawn with Zipf weights 1 / rank^``skew`` (the popular ones shuffled
    through the corpus), shuffled; Poisson arrivals at ``rate`` (0: all at once)."""
    rng = random.Random(seed)
    corpus = [
        " ".join(rng.choice(WORDS) for _ in range(rng.randint(*doc_words))).capitalize() + "."
        for _ in range(docs)
    ]
    popularity = list(range(docs))
    rng.shuffle(popularity)
    weights = [0.0] * docs
    for rank, doc in enumerate(popularity, start=1):
        weights[doc] = 1.0 / rank**skew
    out, at = [], 0.0
    for n in range(requests):
        chosen: list[int] = []
        while len(chosen) < k:
            doc = rng.choices(range(docs), weights)[0]
            if doc not in chosen:
                chosen.append(doc)
        if rate:
            at += rng.expovariate(rate)
        out.append(Request(tuple(chosen), QUESTION.format(n=n, word=rng.choice(WORDS)), at))
    return Trace(corpus, out)


def prompt_text(trace: Trace, request: Request, separator: str) -> str:
    """``sys SEP doc SEP doc ... SEP question``: the connector's chunked prompt, as text."""
    parts = [SYS, *(trace.docs[d] for d in request.docs), request.question]
    return separator.join(parts)


def write_dataset(path: Path, prompts: list[str], output_tokens: int) -> None:
    """The trace as ``vllm bench serve --dataset-name custom --dataset-path PATH`` reads it
    (one JSON object a line: prompt, output_tokens); replay it with --disable-shuffle to
    keep the trace's order."""
    with path.open("w") as out:
        for prompt in prompts:
            out.write(json.dumps({"prompt": prompt, "output_tokens": output_tokens}) + "\n")


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def send(url: str, model: str, trace: Trace, prompts: list[str], args: Any) -> dict[str, Any]:
    """Every request through the OpenAI client, as the trace times them (or ``concurrency``
    at once); per request the wall time of its first and last token."""
    from openai import OpenAI

    client = OpenAI(base_url=f"{url}/v1", api_key="unused", timeout=600)
    rows: list[dict[str, float]] = []
    lock = threading.Lock()

    def one(index: int, prompt: str) -> None:
        sent = time.perf_counter()
        first, tokens = None, 0
        stream = client.completions.create(
            model=model,
            prompt=prompt,
            max_tokens=args.output_tokens,
            temperature=0.0,
            stream=True,
            stream_options={"include_usage": True},
            # Every way generates the same number of tokens, whatever its KV makes of them.
            extra_body={"ignore_eos": True},
        )
        for chunk in stream:
            if chunk.choices and chunk.choices[0].text and first is None:
                first = time.perf_counter()
            if chunk.usage is not None:
                tokens = chunk.usage.completion_tokens
        done = time.perf_counter()
        with lock:
            rows.append(
                {"i": index, "sent": sent, "first": first or done, "done": done, "tokens": tokens}
            )

    began = time.perf_counter()
    workers = args.concurrency or 64
    with ThreadPoolExecutor(workers) as pool:
        futures = []
        for index, (request, prompt) in enumerate(zip(trace.requests, prompts, strict=True)):
            if not args.concurrency:  # Poisson: wait for the request's arrival
                time.sleep(max(0.0, began + request.at - time.perf_counter()))
            futures.append(pool.submit(one, index, prompt))
        for future in futures:
            future.result()
    rows.sort(key=lambda r: r["i"])  # trace order
    ttfts = [r["first"] - r["sent"] for r in rows]
    # Past the cold start (the first fifth of the trace, when little is stored yet).
    warm = [t for r, t in zip(rows, ttfts, strict=True) if r["i"] >= len(rows) // 5]
    tpots = [(r["done"] - r["first"]) / (r["tokens"] - 1) for r in rows if r["tokens"] > 1]
    span = max(r["done"] for r in rows) - min(r["sent"] for r in rows)
    return {
        "ttft_p50_s": round(_percentile(ttfts, 0.5), 4),
        "ttft_p90_s": round(_percentile(ttfts, 0.9), 4),
        "ttft_p99_s": round(_percentile(ttfts, 0.99), 4),
        "ttft_p50_warm_s": round(_percentile(warm, 0.5), 4),
        "ttft_p99_warm_s": round(_percentile(warm, 0.99), 4),
        "tpot_s": round(statistics.median(tpots), 4) if tpots else None,
        "throughput_rps": round(len(rows) / span, 4),
        "completion_tokens_min": min(int(r["tokens"]) for r in rows),
        "ttfts_s": [round(t, 4) for t in ttfts],
    }


def _scrape(url: str) -> dict[str, float]:
    text = urllib.request.urlopen(f"{url}/metrics", timeout=10).read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            out[name] = out.get(name, 0.0) + float(value)
    return out


def _summed(scraped: dict[str, float], prefix: str) -> float:
    return sum(v for k, v in scraped.items() if k.partition("{")[0] == prefix)


def _prompt_hit_rate(scraped: dict[str, float]) -> float | None:
    """Prompt tokens vLLM did not compute (its prefix cache's hits, and what chunkstore
    supplied beyond them) over all prompt tokens, from its /metrics."""
    prompt = _summed(scraped, "vllm:prompt_tokens_total")
    saved = _summed(scraped, "vllm:prefix_cache_hits_total")
    saved += _summed(scraped, "vllm:chunkstore_hit_tokens_total")
    return round(saved / prompt, 4) if prompt else None


def replay_hit_rate(trace: Trace, doc_tokens: list[int], share: float, policy: str) -> float:
    """The token hit rate the daemon's own index, evicting by ``policy``, gets on the trace
    with a pool of ``share`` of its working set (``replay``)."""
    return replay(trace, doc_tokens, share, policy)["store_hit_rate"]


def replay(
    trace: Trace,
    doc_tokens: list[int],
    share: float,
    policy: str,
    disk_share: float = 0.0,
    spill: str = "commit",
) -> dict[str, Any]:
    """The trace replayed through the daemon's own index, as the connector drives it (each
    request acquires its documents, stores the ones missed), with a pool of ``share`` of its
    working set, evicting by ``policy``, and with ``disk_share`` a disk tier of that share
    under it, spilling by ``spill`` (``serve --spill``; the spill thread run to the end after
    each request): no vLLM, no timing, exact. Its token hit rate (both tiers), and the disk
    tier's: hit tokens, tokens written a request (bytes: times the model's KV a token)."""
    from chunkstore.daemon.disk import HEADER, DiskTier
    from chunkstore.daemon.index import Index
    from chunkstore.daemon.pool import SharedMemoryPool
    from chunkstore.daemon.spill import SpillWhen
    from chunkstore.kv.entry import EntryLayout

    block = 64  # 16 bytes a token below: 4 tokens a block
    used = {d for r in trace.requests for d in r.docs}
    blocks = max(1, int(share * sum(-(-doc_tokens[d] * 16 // block) for d in used)))
    with tempfile.TemporaryDirectory(prefix="chunkstore-replay-") as tmp:
        pool = SharedMemoryPool(block, blocks, directory=tmp)
        disk = None
        if disk_share:
            files = sum(HEADER + doc_tokens[d] * 16 for d in used)
            disk = DiskTier(Path(tmp) / "disk", max(HEADER + 4096, int(disk_share * files)))
        index = Index(
            pool,
            high_watermark=1.0,
            low_watermark=1.0,
            eviction=policy,
            disk=disk,
            spill_when=SpillWhen(spill),
        )
        session = index.open_session("replay")
        looked = hit = 0
        for request in trace.requests:
            keys = [d.to_bytes(16, "little") for d in request.docs]
            got = index.acquire(session, keys)
            index.release(session, [g[0].id for g in got if g is not None])
            for doc, key, found in zip(request.docs, keys, got, strict=True):
                looked += doc_tokens[doc]
                if found is not None:
                    hit += doc_tokens[doc]
                    continue
                layout = EntryLayout(1, 1, 4, "float32", "mla", doc_tokens[doc], 0)
                if layout.nbytes > pool.capacity:
                    continue  # never fits: computed every time
                reservation = index.reserve(session, key, layout, layout.nbytes)
                checksum = pool.checksum(reservation.blocks, layout.nbytes)  # a disk read checks
                index.commit(session, reservation.id, checksum)
            while disk is not None and index.spill_one(0):
                pass
        stats = index.disk_stats()
        pool.close()
    counts = stats.counts if stats is not None else {}
    return {
        "store_hit_rate": hit / looked,
        "disk_hit_tokens": counts.get("promoted_bytes", 0) // 16,
        "disk_tokens_written_per_request": counts.get("spill_bytes", 0) / 16 / len(trace.requests),
    }


def furthest_next_use_hit_rate(trace: Trace, doc_tokens: list[int], share: float) -> float:
    """Belady's offline rule (evict what is next needed furthest ahead) on the same trace and
    room: what a policy that knew the future would get, near enough with entries of
    different sizes to show the headroom left above LRU."""
    accesses = [d for r in trace.requests for d in r.docs]
    used = set(accesses)
    room = share * sum(doc_tokens[d] for d in used)
    upcoming: dict[int, list[int]] = {}
    for i in reversed(range(len(accesses))):
        upcoming.setdefault(accesses[i], []).append(i)
    held: set[int] = set()
    filled = looked = hit = 0
    for doc in accesses:
        upcoming[doc].pop()
        looked += doc_tokens[doc]
        if doc in held:
            hit += doc_tokens[doc]
            continue
        if doc_tokens[doc] > room:
            continue
        held.add(doc)
        filled += doc_tokens[doc]
        while filled > room:
            victim = max(held, key=lambda d: upcoming[d][-1] if upcoming[d] else len(accesses))
            held.discard(victim)
            filled -= doc_tokens[victim]
    return hit / looked


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
            apc = send(server.url, str(setup.model), setup.trace, setup.prompts, args)
            apc["prompt_hit_rate"] = _prompt_hit_rate(_scrape(server.url))
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
            with _front(way, server.url, daemon.unix, setup.model, way_dir) as (url, router):
                figures = send(url, str(setup.model), setup.trace, setup.prompts, args)
                if router is not None:
                    figures["router"] = _router_figures(router)
            figures["prompt_hit_rate"] = _prompt_hit_rate(_scrape(server.url))
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
    way: Way, instance: str, daemon: str, model: Path, way_dir: Path
) -> Iterator[tuple[str, RunningRouter | None]]:
    """Where a way's requests go: the instance, or a ``chunkstore router`` before it."""
    if not way.router:
        yield instance, None
        return
    from chunkstore.processes.router import RunningRouter

    router = RunningRouter(
        way_dir / "router", "--instance", instance, "--address", daemon, "--model", model
    )
    try:
        yield router.url, router
    finally:
        router.stop()


def _router_figures(router: RunningRouter) -> dict[str, float]:
    """What the router did for the trace: requests it reordered (relevant documents last),
    cold chunks it sent as their own prompts, requests it passed on without its work."""
    scraped = _scrape(router.url)
    return {
        "reordered": _summed(scraped, "chunkstore_router_reordered_total"),
        "cold_chunks_sent": _summed(scraped, "chunkstore_router_cold_chunks_sent_total"),
        "cold_chunks_failed": _summed(scraped, "chunkstore_router_cold_chunks_failed_total"),
        **_failed_by_why(scraped),
        "fallbacks": _summed(scraped, "chunkstore_router_fallbacks_total"),
    }


def _failed_by_why(scraped: dict[str, float]) -> dict[str, float]:
    """Cold chunks the router sent and its request did not find, by why: ``prefill_error``,
    ``not_stored`` (gone before its request looked: a full or evicting pool), ``client_share``."""
    found = {}
    prefix = 'chunkstore_router_cold_chunks_failed_total{why="'
    for name, value in scraped.items():
        if name.startswith(prefix) and value:
            why = name.removeprefix(prefix).split('"')[0]
            found[f"cold_chunks_failed_{why}"] = value
    return found


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
