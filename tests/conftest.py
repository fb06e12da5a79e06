"""Shared fixtures: the test models, built once and cached (chunkstore.models), and
real ``chunkstore serve`` processes (chunkstore.processes.daemon)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from chunkstore.models import model_dir
from chunkstore.processes.daemon import RunningDaemon, start_daemon


@pytest.fixture(scope="session")
def tiny_model_dir() -> Path:
    return model_dir("tiny")


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    return model_dir("smollm2")


@pytest.fixture
def serve(tmp_path: Path) -> Iterator[Callable[..., RunningDaemon]]:
    """``serve(*flags, name="daemon", pool_bytes=..., block_size=..., launcher=...)`` starts a
    real daemon in ``tmp_path / name`` on free ports. When the test ends every daemon still
    running is stopped (SIGTERM) and must drain and exit 0; one the test killed is left be."""
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
    unclean = {name: daemon.log()[-2000:] for name, (code, daemon) in codes.items() if code}
    assert not unclean, f"daemons did not drain and exit 0: {unclean}"
