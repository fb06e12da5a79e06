"""``chunkstore bench NAME``: each bench is the module chunkstore.bench.NAME, with
add_arguments(parser) and run(args) -> rows, imported only when it runs (the benches load
torch and vLLM's helpers, seconds that ``chunkstore serve`` and the admin verbs skip). A bench
of the connector's internals (``hook``) is its module, found through the ``chunkstore.benches``
entry points (pyproject.toml): chunkstore imports nothing of ``chunkstore_vllm`` by name."""

from __future__ import annotations

import argparse
import importlib
import json
import signal
import sys
from importlib.metadata import entry_points
from typing import Any

# Bench name -> what it measures. Each is the module chunkstore.bench.NAME (or the one its
# entry point in PLUGGED names), with
# add_arguments(parser) and run(args) -> rows; imported only by `chunkstore bench` (the benches
# load torch and vLLM's helpers, seconds that `chunkstore serve` and the admin verbs skip).
BENCHES: dict[str, str] = {
    "remap": "RoPE remap + paged write of a chunk against a plain copy (ratio_vs_copy)",
    "device": "the GPU / NPU paths (remap + write, IPC get, pinned host pool) against plain "
    "device copies of the same bytes (ratio_vs_baseline)",
    "cp": "a decode context-parallel rank's part of an entry (1/dcp, summed) against the whole "
    "entry read and checked, per transport (part_vs_whole)",
    "e2e": "time to first token in vLLM: no connector, prefix caching, chunkstore (ttft_speedup)",
    "long": "answers over long stored documents (the HF fp32 reference) with every block "
    "attended against only the blocks their summaries pick (accuracy, density, bytes_share)",
    "hook": "the isolation hook's chunk rows: one call of vLLM's kernel for all chunks against "
    "a partial attention per chunk merged by log-sum-exp (speedup, max_abs_diff)",
    "pull": "a peer pull of one entry over Mooncake's Transfer Engine vs the gRPC stream "
    "(pull_engine_vs_stream)",
    "quality": "answer accuracy on generated multi-document QA, per recovery method, with TTFT",
    "router": "chunkstore router before two instances (hook off) against going straight to "
    "one: a cold and a warm request's latency, and where it places stored documents "
    "(router_vs_straight, placed)",
    "scale": "the daemon at 1k / 10k / 100k entries, with pinned entries, and with 1-8 readers",
    "store": "daemon lookups, and reads via shared memory against memcpy, Redis and gRPC",
    "workload": "RAG traffic through vLLM's OpenAI server: its prefix caching alone vs "
    "chunkstore evicting by LRU and by worth, at pool sizes (throughput_vs_apc)",
}


PLOTTED = ("quality", "workload")  # benches with --plot (chunkstore.bench.plot)
PLUGGED = "chunkstore.benches"  # the entry-point group of benches other packages hold


def _bench_module(name: str) -> Any:
    plugged = {e.name: e for e in entry_points(group=PLUGGED)}
    if name in plugged:
        return plugged[name].load()
    return importlib.import_module(f"chunkstore.bench.{name}")


def _print_table(rows: list[dict[str, Any]]) -> None:
    if not rows:
        return
    columns = list(rows[0])
    widths = [max(len(c), *(len(str(r.get(c, ""))) for r in rows)) for c in columns]
    print("  ".join(c.ljust(w) for c, w in zip(columns, widths, strict=True)))
    for row in rows:
        print("  ".join(str(row.get(c, "")).ljust(w) for c, w in zip(columns, widths, strict=True)))


def _stopped(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def run(args: argparse.Namespace) -> int:
    # SIGTERM (a timeout's, a `kill`) unwinds as Ctrl-C does: each bench's `with` and
    # `finally` stop the daemons, vLLM servers and routers it started, in their own process
    # groups, which a signal to the bench alone would otherwise leave running.
    signal.signal(signal.SIGTERM, _stopped)
    if getattr(args, "plot", ""):
        from chunkstore.bench.plot import pyplot

        pyplot()  # matplotlib missing: said now, not after the run
    rows = []
    produced = iter(_bench_module(args.name).run(args))
    try:
        for row in produced:
            if args.json:
                print(json.dumps(row), flush=True)
            rows.append(row)
    finally:  # a bench interrupted between rows unwinds now, not when (if) it is collected
        getattr(produced, "close", lambda: None)()
    if not args.json:
        _print_table(rows)
    if getattr(args, "plot", ""):
        from chunkstore.bench.plot import plot

        print(f"bench {args.name}: drew {plot(rows, args.plot)}", file=sys.stderr)
    return 0


def draw(args: argparse.Namespace) -> int:
    from chunkstore.bench.plot import RowError, numbered_rows, plot

    try:
        numbered = numbered_rows(args.rows)
        drawn = plot([row for _, row in numbered], args.out)
    except RowError as err:
        line = numbered[err.index][0]
        print(f"chunkstore plot: {args.rows}, line {line}: {err.reason}", file=sys.stderr)
        return 2
    except (OSError, ValueError) as err:
        print(f"chunkstore plot: {args.rows}: {err}", file=sys.stderr)
        return 2
    print(f"chunkstore plot: drew {drawn}", file=sys.stderr)
    return 0


def add_commands(commands: Any, bench_arguments: bool | str = True) -> None:
    """``bench_arguments``: whose own arguments (and the imports they need) the benches
    get: every bench's (True), none (False), or the one named."""
    bench = commands.add_parser(
        "bench",
        help="measure against a baseline, side by side in one run",
        description="Benchmarks. Each prints a table, or with --json one JSON object per line "
        "with a 'bench' field and its figures; ratios are measured side by side.",
    )
    benches = bench.add_subparsers(dest="name", required=True, metavar="NAME")
    for name, summary in BENCHES.items():
        sub = benches.add_parser(name, help=summary, description=summary)
        if bench_arguments is True or bench_arguments == name:
            _bench_module(name).add_arguments(sub)
        sub.add_argument("--json", action="store_true", help="one JSON object per line")
        if name in PLOTTED:
            sub.add_argument(
                "--plot", default="", metavar="FILE", help="also draw the rows to FILE (PNG)"
            )
        sub.set_defaults(func=run)
    drawn = commands.add_parser(
        "plot",
        help="draw a bench's saved --json rows (quality, workload) to a PNG",
        description="Draw the rows `chunkstore bench quality|workload --json` printed (saved "
        "to a file) as a picture: accuracy against document length per method; requests/s "
        "against vLLM's prefix caching per pool share, beside the replayed hit-rate curve.",
    )
    drawn.add_argument("rows", help="the bench's --json output, one JSON object a line")
    drawn.add_argument("out", help="the PNG to write")
    drawn.set_defaults(func=draw)
