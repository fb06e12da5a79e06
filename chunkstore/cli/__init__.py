"""The ``chunkstore`` command: one module per command or group of verbs, each with
``add_commands(commands)`` (its parsers, their ``func``) and what they run. Every heavy
import (torch, vLLM, gRPC's stubs) happens inside the command that needs it: ``chunkstore
serve`` and the admin verbs start without torch.

Commands of the connector (``chunkstore doctor``) are found through the ``chunkstore.commands``
entry points (pyproject.toml), each a module with the same ``add_commands``: chunkstore imports
nothing of ``chunkstore_vllm`` by name, so the connector depends on it and not the reverse."""

from __future__ import annotations

import argparse
import sys
from importlib.metadata import entry_points

from chunkstore import __version__

from . import admin, bench, ingest, models, proxy, router, serve, up

COMMANDS = "chunkstore.commands"  # the entry-point group of other packages' commands


def build_parser(bench_arguments: bool | str = True) -> argparse.ArgumentParser:
    """The whole command line. ``bench_arguments``: whose own arguments (and the imports they
    need) the benches get: every bench's (True), none (False, for any command but ``bench``),
    or the one named (``chunkstore bench NAME``: a bench imports only its own module, so
    ``bench device`` runs where vLLM and Redis are not installed)."""
    parser = argparse.ArgumentParser(
        prog="chunkstore",
        description="Position-independent KV-cache service for LLM serving.",
    )
    parser.add_argument("--version", action="version", version=f"chunkstore {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    bench.add_commands(commands, bench_arguments)
    for module in (models, serve, up, admin, ingest, proxy, router):
        module.add_commands(commands)
    for command in sorted(entry_points(group=COMMANDS), key=lambda e: e.name):
        command.load().add_commands(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    named = argv[1] if argv[:1] == ["bench"] and len(argv) > 1 else argv[:1] == ["bench"]
    args = build_parser(bench_arguments=named).parse_args(argv)
    result: int = args.func(args)
    return result
