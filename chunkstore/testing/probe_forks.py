"""vLLM probes forked from a process that has imported vLLM once, for the tests.

Importing vLLM costs ~17 s of CPU on this machine's 2 cores, and the suite runs ~60 probes. A
fork server (multiprocessing's "forkserver") imports vLLM and the probe once; each probe is
then a fork of it that runs ``vllm_probe.main`` with its own arguments, environment, stdout
and stderr, exactly as ``python -m chunkstore.processes.vllm_probe`` would. Nothing is
started in the server before it forks (no engine, no threads, no numba), so each child builds
its engine from scratch. tests/conftest.py installs ``run`` as ``vllm_probe.runner``; the
benches keep plain subprocesses, so their figures are a user's.
"""

from __future__ import annotations

import multiprocessing
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

# What the server imports before it forks: vLLM's offline entry point and the probe itself.
PRELOAD = ["vllm.entrypoints.llm", "vllm.sampling_params", "chunkstore.processes.vllm_probe"]

_context: Any = None


def _forks() -> Any:
    global _context
    if _context is None:
        _context = multiprocessing.get_context("forkserver")
        _context.set_forkserver_preload(PRELOAD)
    return _context


def _probe(args: list[str], env: dict[str, str], stdout: str, stderr: str) -> None:
    """In the child: the probe's streams and environment, then its main."""
    for fd, path in ((1, stdout), (2, stderr)):
        target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.dup2(target, fd)
        os.close(target)
    os.environ.clear()
    os.environ.update(env)
    from chunkstore.processes import vllm_probe

    sys.argv = ["vllm_probe", *args]
    vllm_probe.main(args)
    sys.stdout.flush()
    sys.stderr.flush()


def run(args: list[str], env: dict[str, str], timeout: float) -> tuple[int, str, str]:
    """``vllm_probe.runner``: (exit code, stdout, stderr) of a forked probe."""
    with tempfile.TemporaryDirectory(prefix="probe-") as folder:
        out, err = Path(folder) / "stdout", Path(folder) / "stderr"
        child = _forks().Process(target=_probe, args=(args, env, str(out), str(err)))
        child.start()
        child.join(timeout)
        if child.exitcode is None:
            child.kill()
            child.join()
            raise subprocess.TimeoutExpired(["vllm_probe", *args], timeout)
        return child.exitcode, _text(out), _text(err)


def _text(path: Path) -> str:
    return path.read_text(errors="replace") if path.exists() else ""
