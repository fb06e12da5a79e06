"""The daemon's background threads (the reaper, the directory's publisher and fetcher). Each
runs one step at a time in a loop that survives any exception in a step: logged with its
traceback, counted in ``chunkstore_background_errors_total{thread}``. A thread that is gone
anyway is reported by ``dead()``, and the daemon's health is NOT_SERVING while one is."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

log = logging.getLogger("chunkstore.serve")


class Workers:
    def __init__(self, errors: Any) -> None:
        self.errors = errors  # a counter labelled by thread name
        self.stop = threading.Event()
        self._threads: dict[str, threading.Thread] = {}

    def start(self, name: str, step: Callable[[], object], interval: float = 0.0) -> None:
        """Run ``step`` every ``interval`` seconds (back to back at 0) until ``stop``."""

        def loop() -> None:
            while not self.stop.is_set():
                try:
                    step()
                except Exception:
                    self.errors.labels(name).inc()
                    log.exception("background thread %s: a step failed; it goes on", name)
                if interval:
                    self.stop.wait(interval)

        thread = threading.Thread(target=loop, name=f"chunkstore-{name}", daemon=True)
        self._threads[name] = thread
        self.errors.labels(name)  # the series exists at 0 from the start
        thread.start()

    def dead(self) -> list[str]:
        """Threads that ended while the daemon still runs."""
        if self.stop.is_set():
            return []
        return [name for name, t in self._threads.items() if not t.is_alive()]

    def join(self, timeout: float = 5.0) -> None:
        self.stop.set()
        for thread in self._threads.values():
            thread.join(timeout)
