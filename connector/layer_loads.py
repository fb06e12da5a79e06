"""A step's loads made ready in vLLM's cache one layer at a time (worker process), so the
model computes layer i while layer i + 1 loads; the thread placement they run under."""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable

log = logging.getLogger("chunkstore.connector")


def place_thread(cpus: set[int] | None) -> None:
    """Let the calling thread run on ``cpus`` (None: leave it where it is)."""
    if cpus is None:
        return
    try:
        os.sched_setaffinity(0, cpus)
    except OSError as err:  # none of them allowed here: stay on vLLM's cores
        log.warning("chunkstore: load threads stay on vLLM's cores (load_cpus: %s)", err)


class LayerLoads:
    """A step's loads made ready in vLLM's cache one layer at a time on a background thread,
    so the model computes layer i while layer i + 1 loads; vLLM calls ``wait_for_layer_load``
    before each layer's attention. ``produce(mark)`` does the loading and calls ``mark(n)``
    once layers 0..n-1 are in the cache. Without ``overlap`` it all happens here, before the
    forward. ``settle(ok)`` counts the loads at the end of the step: ``ok`` False when the
    work failed or the model did not wait for every layer (then they are computed)."""

    def __init__(
        self,
        layers: int,
        produce: Callable[[Callable[[int], None]], None],
        settle: Callable[[bool], None],
        overlap: bool,
        cpus: set[int] | None = None,
        phase: str = "write",
    ) -> None:
        self.produce = produce
        self.phase = phase  # the connector's counter of its seconds: write or read
        self.settle = settle
        self.ready = [threading.Event() for _ in range(layers)]
        self.waited: set[int] = set()
        self.error: Exception | None = None
        self.seconds = 0.0  # loading, remap included
        self.wait_seconds = 0.0  # the model blocked in wait()
        self.thread: threading.Thread | None = None
        if overlap:
            self.thread = threading.Thread(
                target=self._run, args=(cpus,), name="chunkstore-load", daemon=True
            )
            self.thread.start()
        else:
            self._run()
            self.waited = set(range(len(self.ready)))
            self.wait_seconds = self.seconds  # loaded before the forward: all of it waited

    def _mark(self, layers: int) -> None:
        for ready in self.ready[:layers]:
            ready.set()

    def _run(self, cpus: set[int] | None = None) -> None:
        began = time.perf_counter()
        place_thread(cpus)
        try:
            self.produce(self._mark)
        except Exception as err:  # reported by finish(); those loads are computed
            self.error = err
        finally:
            self.seconds = time.perf_counter() - began
            self._mark(len(self.ready))  # a failure must not leave the model waiting

    def wait(self, layer: int) -> None:
        self.waited.add(layer)
        ready = self.ready[layer]
        if not ready.is_set():
            began = time.perf_counter()
            ready.wait()
            self.wait_seconds += time.perf_counter() - began

    def all_waited(self) -> bool:
        return len(self.waited) == len(self.ready)

    def finish(self) -> Exception | None:
        if self.thread is not None:
            self.thread.join()
        return self.error
