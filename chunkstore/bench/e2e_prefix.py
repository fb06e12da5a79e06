"""``chunkstore bench e2e --prefix [--disk] [--peers]``: exact prefix sharing of plain
prompts between vLLM processes, against computing them and against vLLM's own prefix cache
hit; from the disk tier after a restart; and the exact-prefix connectors vLLM ships (e2e.py
says more)."""

from __future__ import annotations

import argparse
import random
import re
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from chunkstore.client import ChunkStoreClient
from chunkstore.models import WORDS
from chunkstore.processes.vllm_probe import run_probe

from .e2e_shapes import VLLM_CPU_BLOCK, bench_daemon, median_ttft, scaled, spent, split


def run_prefix(args: argparse.Namespace, model: Path, encode: Any) -> dict[str, Any]:
    """Plain prompts, each a different text: computed by vLLM alone and then, in the same
    process with its prefix caching on, answered again (its own hit); through the
    connector, stored by one vLLM process and loaded by a second on the same daemon."""
    warmup, prompts = _plain_prompts(args, encode)
    computed, apc, stored, loaded, disk, peers = _runs(args, model, warmup, prompts)
    ttft = median_ttft
    worst_diff = _worst_diff_from(computed)
    hit_tokens = [int(r["connector"].get("prefix_hit_tokens", 0)) for r in loaded]
    if min(hit_tokens) < args.prefix_tokens:
        raise RuntimeError(f"not every prompt was a full prefix hit: {hit_tokens} tokens")

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
        "hit_lookup_ms": scaled(spent(loaded, "lookup"), 1e3),
        "hit_read_ms": scaled(spent(loaded, "read"), 1e3),
        "hit_write_ms": scaled(spent(loaded, "write"), 1e3),
        "hit_write_wait_ms": scaled(spent(loaded, "wait"), 1e3),
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


def _plain_prompts(args: argparse.Namespace, encode: Any) -> tuple[list[int], list[list[int]]]:
    """The warm-up and the timed prompts: each a different text of ``--prefix-tokens`` tokens
    and one more (the token computed on a hit)."""
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
    return prompts[0], prompts[1:]


def _runs(
    args: argparse.Namespace, model: Path, warmup: list[int], prompts: list[list[int]]
) -> tuple[list[Any], list[Any], list[Any], list[Any], dict[str, Any], dict[str, Any]]:
    """vLLM alone (computed, then its own hit), the connector's first process (stored) and
    second (loaded); with ``--disk``, a third after a restart; with ``--peers``, vLLM's own
    connectors."""
    max_len = max(4096, 1 << (args.prefix_tokens + 64).bit_length())
    with tempfile.TemporaryDirectory(prefix="chunkstore-e2e-") as tmp:
        work = Path(tmp)
        computed, apc = split(
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
        with bench_daemon(work, 3 << 30, *(tier if args.disk else ())) as daemon:
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

    return computed, apc, stored, loaded, disk, peers


def _worst_diff_from(computed: list[dict[str, Any]]) -> Callable[[list[dict[str, Any]]], float]:
    """The largest first-token logprob difference of a run's rows from ``computed``'s."""

    def worst_diff(rows: list[dict[str, Any]]) -> float:
        return max(
            abs(b["logprobs"][t] - lp)
            for a, b in zip(rows, computed, strict=True)
            for t, lp in a["logprobs"].items()
            if t in b["logprobs"]
        )

    return worst_diff


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
    with bench_daemon(work, 3 << 30, *tier, name="restarted") as daemon:
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
            raise PeerFailed(why(log.read_text() if log.exists() else str(err))) from err
        stalled = idle(log.read_text())
        if stalled:
            raise PeerFailed(stalled)
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


def why(log: str) -> str:
    """The line of a failed vLLM's output that says why: its first error line, less the
    log prefix, past the generic ones that point at it."""
    lines = [line for line in log.splitlines() if line.strip()]
    for line in lines:
        found = re.search(r"\b[\w.]*(Error|Exception): .*", line)
        if found and "initialization failed" not in found.group(0):
            return found.group(0).strip()[:300]
    return lines[-1].strip()[:300] if lines else "no output"


def idle(log: str) -> str | None:
    """Why a peer that started loads nothing, in its own words; None if it did not say so."""
    return f"{why(log)} (it started, in {IDLE}: loads nothing)" if IDLE in log else None


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
