"""The worker's layer-by-layer loads (``LayerLoads``): the model never passes a layer before
its KV is written, a failing write never leaves the model waiting, and the worker can tell
whether every layer was waited for. (vLLM itself drives it in tests/test_connector.py, and
the packed reads that mark several layers at once in tests/connector/test_prefix.py.)"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from typing import Any

import pytest

from chunkstore_vllm.layer_loads import LayerLoads

LAYERS = 6


class RecordingWorker:
    """Stands in for WorkerSide: writes are recorded, slowly, and may fail at one layer."""

    def __init__(self, fail_at: int = -1) -> None:
        self.written: list[tuple[Any, int]] = []
        self.fail_at = fail_at
        self.gate = threading.Event()
        self.settled: list[bool] = []

    def _write_layer(self, entry: Any, layer: int) -> None:
        self.gate.wait(5)  # the background thread starts only when the test lets it
        if layer == self.fail_at:
            raise RuntimeError(f"write of layer {layer} failed")
        self.written.append((entry, layer))
        self.cpus = os.sched_getaffinity(0)

    def loads(self, entries: list[Any], overlap: bool, **kwargs: Any) -> LayerLoads:
        def produce(mark: Callable[[int], None]) -> None:
            for layer in range(LAYERS):
                for entry in entries:
                    self._write_layer(entry, layer)
                mark(layer + 1)

        return LayerLoads(LAYERS, produce, self.settled.append, overlap, **kwargs)


def test_each_wait_returns_only_once_its_layer_is_written() -> None:
    worker = RecordingWorker()
    loads = worker.loads(["a", "b"], overlap=True)
    assert worker.written == []  # nothing yet: the writes wait on the gate
    worker.gate.set()
    for layer in range(LAYERS):
        loads.wait(layer)
        assert ("a", layer) in worker.written and ("b", layer) in worker.written
    assert loads.finish() is None
    assert loads.all_waited()
    assert worker.written == [(e, layer) for layer in range(LAYERS) for e in ("a", "b")]


def test_a_failed_write_releases_every_waiter_and_is_reported() -> None:
    worker = RecordingWorker(fail_at=2)
    worker.gate.set()
    loads = worker.loads(["a"], overlap=True)
    for layer in range(LAYERS):
        loads.wait(layer)  # returns for every layer, also after the failure
    error = loads.finish()
    assert isinstance(error, RuntimeError) and "layer 2" in str(error)
    assert worker.written == [("a", 0), ("a", 1)]


def test_layers_not_waited_for_are_seen() -> None:
    worker = RecordingWorker()
    worker.gate.set()
    loads = worker.loads(["a"], overlap=True)
    loads.wait(0)
    assert loads.finish() is None
    assert not loads.all_waited()  # the worker then fails these loads: vLLM computes them


@pytest.mark.parametrize("fail_at", [-1, 3])
def test_without_overlap_everything_is_written_before_the_forward(fail_at: int) -> None:
    worker = RecordingWorker(fail_at)
    worker.gate.set()
    loads = worker.loads(["a"], overlap=False)
    assert loads.all_waited()
    assert len(worker.written) == (LAYERS if fail_at < 0 else fail_at)
    assert (loads.finish() is None) == (fail_at < 0)


def test_only_the_time_the_model_blocked_counts_as_waited() -> None:
    """``wait_seconds`` (the connector's ``wait_seconds`` counter): a wait on a layer not yet
    written counts; a wait on a written one adds nothing; without overlap all of the writing
    is waited. (Not compared with the writing's time under overlap: the waiter measures its
    own wake-up too, which on a loaded host can outlast the last layers' writes.)"""
    worker = RecordingWorker()
    loads = worker.loads(["a"], overlap=True)
    waiter = threading.Thread(target=loads.wait, args=(0,))
    waiter.start()
    waiter.join(0.05)
    assert waiter.is_alive()  # blocked: the gate holds the writes back
    worker.gate.set()
    waiter.join()
    assert loads.finish() is None
    blocked = loads.wait_seconds
    assert blocked > 0 and loads.seconds > 0
    for layer in range(1, LAYERS):
        loads.wait(layer)  # written already
    assert loads.wait_seconds == blocked
    worker = RecordingWorker()
    worker.gate.set()
    serial = worker.loads(["a"], overlap=False)
    assert serial.wait_seconds == serial.seconds > 0  # written before the forward: all waited


def test_the_load_thread_runs_on_the_cpus_it_is_given() -> None:
    """vLLM binds its thread, and so every thread it starts, to its compute cores; the loads
    are moved to ``load_cpus`` (on 2 cores: the one vLLM keeps for its scheduler as well)."""
    main = os.sched_getaffinity(0)
    one = {min(main)}
    worker = RecordingWorker()
    worker.gate.set()
    loads = worker.loads(["a"], overlap=True, cpus=one)
    assert loads.finish() is None
    assert worker.cpus == one
    assert os.sched_getaffinity(0) == main  # the caller's own thread stays where it was
    without = RecordingWorker()
    without.gate.set()
    assert without.loads(["a"], overlap=True).finish() is None
    assert without.cpus == main
