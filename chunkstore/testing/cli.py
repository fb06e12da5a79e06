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
