"""What every bench times with."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any


def timed(fn: Callable[[], Any]) -> float:
    """Seconds ``fn()`` took (wall clock)."""
    began = time.perf_counter()
    fn()
    return time.perf_counter() - began
