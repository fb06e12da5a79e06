"""Shared fixtures: the test models, built once and cached (chunkstore.models), and
real ``chunkstore serve`` processes (chunkstore.processes.daemon).

vLLM runs in the tests with its engine in the process that drives it
(VLLM_ENABLE_V1_MULTIPROCESSING=0, set here for the whole session): a vLLM probe then starts
one Python process instead of three (driver, engine core, worker), each of which imports torch
and vLLM; that is ~30 s of a ~45 s probe on 2 cores, and the suite starts ~60 probes. The
connector is the same code either way (its scheduler and worker sides are separate objects).
What the deployed process layout adds, the metadata pickled from the scheduler to the workers,
stays covered: every ``vllm serve`` the tests start (chunkstore.processes.vllm_server, the
README quickstart) and every tensor-parallel run keeps its engine and workers in processes.
And each probe is forked from a process that imported vLLM once (chunkstore.testing.probe_forks:
~17 s of CPU less per probe); the benches the tests run (through the ``chunkstore`` command)
start theirs as users do.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from chunkstore.models import model_dir
from chunkstore.processes import vllm_probe
from chunkstore.processes.daemon import RunningDaemon, start_daemon
from chunkstore.testing import probe_forks


@pytest.fixture(scope="session", autouse=True)
def vllm_engine_in_process() -> Iterator[None]:
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        patch.setattr(vllm_probe, "runner", probe_forks.run)
        yield


@pytest.fixture(scope="session")
def tiny_model_dir() -> Path:
    return model_dir("tiny")


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    return model_dir("smollm2")


@pytest.fixture(scope="session")
def qwen05_dir() -> Path:
    """Qwen2.5-Coder-0.5B-Instruct in fp32 (2.4 GB): a Qwen2, with QKV bias and rope_theta
    1e6, where SmolLM2 is a Llama."""
    return model_dir("qwen2.5-0.5b")


@pytest.fixture
def serve(tmp_path: Path) -> Iterator[Callable[..., RunningDaemon]]:
    """``serve(*flags, name="daemon", pool_bytes=..., block_size=..., launcher=...)`` starts a
    real daemon in ``tmp_path / name`` on free ports. When the test ends every daemon still
    running is stopped (SIGTERM) and must drain and exit 0; of one the test killed only the
    pool file it left is removed (in /dev/shm it holds memory)."""
    started: list[RunningDaemon] = []

    def start(*flags: str, name: str = "daemon", **options: Any) -> RunningDaemon:
        daemon = start_daemon(tmp_path / name, *flags, **options)
        started.append(daemon)
        return daemon

    try:
        yield start
    finally:
        running = [daemon for daemon in started if daemon.process.poll() is None]
        codes = {daemon.workdir.name: (daemon.stop(), daemon) for daemon in running}
        for daemon in started:
            if daemon not in running:
                daemon.stop()
    unclean = {name: daemon.log()[-2000:] for name, (code, daemon) in codes.items() if code}
    assert not unclean, f"daemons did not drain and exit 0: {unclean}"
