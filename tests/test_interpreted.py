"""The Triton kernels under Triton's interpreter, in a process of their own
(tests/interpreted/conftest.py says why): every test there passes, and there are some."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

INTERPRETED = Path(__file__).parent / "interpreted"


def test_the_triton_kernels_write_and_gather_as_the_torch_paths_under_the_interpreter() -> None:
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(INTERPRETED)],
        env={**os.environ, "TRITON_INTERPRET": "1"},
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-2000:]
    assert " passed" in run.stdout and " failed" not in run.stdout
