"""Prometheus metrics of the daemon (names listed in the README).

Counts the index already keeps (lookups, hits, evictions, entries, leases) are read from it at
scrape time, so the metrics move exactly as the operations did; what only the server sees
(bytes moved, RPC latency, errors) it records here.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from chunkstore.index import Index

PREFIX = "chunkstore"


class IndexCollector:
    def __init__(self, index: Index) -> None:
        self.index = index

    def collect(self) -> Iterator[Metric]:
        s = self.index.stats()
        for unit, looked, hit in (
            ("chunks", s.lookups, s.hits),
            ("tokens", s.lookup_tokens, s.hit_tokens),
        ):
            yield CounterMetricFamily(
                f"{PREFIX}_lookup_{unit}", f"{unit.capitalize()} looked up", value=looked
            )
            yield CounterMetricFamily(
                f"{PREFIX}_hit_{unit}", f"{unit.capitalize()} found committed", value=hit
            )
        evictions = CounterMetricFamily(f"{PREFIX}_evictions", "Entries evicted", labels=["reason"])
        for reason in ("capacity", "watermark", "admin", "clear"):
            evictions.add_metric([reason], s.evictions.get(reason, 0))
        yield evictions
        gauges = {
            "pool_bytes_used": ("Pool bytes held by entries and reservations", s.bytes_used),
            "pool_bytes_capacity": ("Pool size in bytes", s.bytes_capacity),
            "entries": ("Committed entries", s.entries),
            "pinned_entries": ("Pinned entries", s.pinned_entries),
            "active_leases": ("Leases held by readers", s.active_leases),
            "active_reservations": ("Reservations being written", s.active_reservations),
            "sessions": ("Client sessions", s.sessions),
            "draining": ("1 while draining", int(s.draining)),
        }
        for name, (doc, value) in gauges.items():
            yield GaugeMetricFamily(f"{PREFIX}_{name}", doc, value=value)


class Metrics:
    def __init__(self, index: Index) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(IndexCollector(index))
        self.bytes = Counter(
            f"{PREFIX}_bytes",
            "Entry bytes moved",
            ["transport", "direction"],
            registry=self.registry,
        )
        self.rpc_seconds = Histogram(
            f"{PREFIX}_rpc_seconds",
            "RPC latency",
            ["method"],
            registry=self.registry,
            buckets=(
                0.0001,
                0.00025,
                0.0005,
                0.001,
                0.0025,
                0.005,
                0.01,
                0.025,
                0.05,
                0.1,
                0.25,
                0.5,
                1,
                2.5,
                5,
                10,
            ),
        )
        self.errors = Counter(
            f"{PREFIX}_errors", "RPCs answered with an error", ["code"], registry=self.registry
        )
        self._http: Any = None

    def serve(self, address: str) -> int:
        """Serve /metrics; returns the bound port (address port 0 picks one)."""
        host, port = address.rsplit(":", 1)
        server, _ = start_http_server(int(port), addr=host.strip("[]"), registry=self.registry)
        self._http = server
        return int(server.server_port)

    def close(self) -> None:
        if self._http is not None:
            self._http.shutdown()
