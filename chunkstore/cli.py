"""The ``chunkstore`` command."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from chunkstore.bench import remap as remap_bench
from chunkstore.testing.models import MODELS

BENCHES: dict[
    str,
    tuple[
        Callable[[argparse.ArgumentParser], None],
        Callable[[argparse.Namespace], Iterator[dict[str, Any]]],
        str,
    ],
] = {
    "remap": (
        remap_bench.add_arguments,
        remap_bench.run,
        "RoPE remap + paged write of a chunk against a plain copy (ratio_vs_copy)",
    ),
}


def _print_table(rows: list[dict[str, Any]]) -> None:
    if not rows:
        return
    columns = list(rows[0])
    widths = [max(len(c), *(len(str(r.get(c, ""))) for r in rows)) for c in columns]
    print("  ".join(c.ljust(w) for c, w in zip(columns, widths, strict=True)))
    for row in rows:
        print("  ".join(str(row.get(c, "")).ljust(w) for c, w in zip(columns, widths, strict=True)))


def _bench(args: argparse.Namespace) -> int:
    rows = []
    for row in BENCHES[args.name][1](args):
        if args.json:
            print(json.dumps(row), flush=True)
        rows.append(row)
    if not args.json:
        _print_table(rows)
    return 0


def _models(args: argparse.Namespace) -> int:
    from chunkstore.testing.models import model_dir

    unknown = sorted(set(args.names) - set(MODELS))
    if unknown:
        print(
            f"chunkstore models: unknown model {', '.join(unknown)}; known: {', '.join(MODELS)}",
            file=sys.stderr,
        )
        return 2
    for name in args.names or MODELS:
        print(model_dir(name, args.cache_dir), flush=True)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="chunkstore",
        description="Position-independent KV-cache service for LLM serving.",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    bench = commands.add_parser(
        "bench",
        help="measure against a baseline, side by side in one run",
        description="Benchmarks. Each prints a table, or with --json one JSON object per line "
        "with a 'bench' field and its figures; ratios are measured side by side.",
    )
    benches = bench.add_subparsers(dest="name", required=True, metavar="NAME")
    for name, (add_arguments, _, summary) in BENCHES.items():
        sub = benches.add_parser(name, help=summary, description=summary)
        add_arguments(sub)
        sub.add_argument("--json", action="store_true", help="one JSON object per line")
        sub.set_defaults(func=_bench)

    models = commands.add_parser(
        "models",
        help="build the test models (tiny random Llama, SmolLM2) once and cache them",
        description="Build the models tests and benches use. A present model is never "
        "rebuilt. Default location: $CHUNKSTORE_MODEL_CACHE or "
        "~/.cache/chunkstore/models.",
    )
    models.add_argument("names", nargs="*", help=f"any of {', '.join(MODELS)} (default: all)")
    models.add_argument("--cache-dir", type=Path, default=None)
    models.set_defaults(func=_models)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    result: int = args.func(args)
    return result


if __name__ == "__main__":
    sys.exit(main())
