"""vLLM's connector base classes that the connector's plain data subclass (the metadata the
scheduler hands the workers, what workers hand back, the metrics): vLLM's own where vLLM is
installed; where it is not, plain stand-ins of the same names, so that the worker's data
paths (``loads``, ``saves``, the caches they write) import and run without vLLM. That is
the device check's case: the GPU / NPU machine it runs on has no vLLM
(tests/device/test_connector_on_device.py). None of these classes carries behaviour the
connector relies on: markers, and the stats' ``data`` dict."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING or importlib.util.find_spec("vllm") is not None:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (
        KVConnectorMetadata,
        KVConnectorWorkerMetadata,
    )
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
        KVConnectorPromMetrics,
        KVConnectorStats,
    )
else:  # no vLLM on this machine: stand-ins, never handed to a vLLM (there is none)

    class KVConnectorMetadata:
        """Stand-in: vLLM's is an empty marker."""

    class KVConnectorWorkerMetadata:
        """Stand-in: vLLM's declares ``aggregate``, which the subclass defines."""

    @dataclass
    class KVConnectorStats:
        """Stand-in: vLLM's holds the ``data`` dict the subclass counts into."""

        data: dict[str, Any] = field(default_factory=dict)

    class KVConnectorPromMetrics:
        """Stand-in: only vLLM's metrics logger makes one."""


__all__ = [
    "KVConnectorMetadata",
    "KVConnectorPromMetrics",
    "KVConnectorStats",
    "KVConnectorWorkerMetadata",
]
