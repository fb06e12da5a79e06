"""Prometheus metrics of the daemon (names listed in docs/operations.md, "Daemon metrics").

Counts the index already keeps (lookups, hits, evictions, entries, leases) are read from it at
scrape time, so the metrics move exactly as the operations did; what only the server sees
(bytes moved, RPC latency, errors) it records here.
"""

from __future__ import annotations

import hmac
import threading
from collections.abc import Iterator
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, make_server

from prometheus_client import CollectorRegistry, Counter, Histogram, make_wsgi_app
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import ThreadingWSGIServer

from chunkstore.daemon.index import Index
from chunkstore.daemon.spill import DiskStats
from chunkstore.daemon.tenants import SHARED_LABEL

PREFIX = "chunkstore"


class IndexCollector:
    def __init__(self, index: Index, node: str) -> None:
        self.index = index
        self.node = node

    def collect(self) -> Iterator[Metric]:
        s = self.index.stats()
        node = [self.node]
        counts = (
            ("lookup_chunks", "Chunks looked up", s.lookups),
            ("hit_chunks", "Chunks found committed", s.hits),
            ("lookup_tokens", "Tokens looked up", s.lookup_tokens),
            ("hit_tokens", "Tokens found committed", s.hit_tokens),
        )
        for name, doc, value in counts:
            family = CounterMetricFamily(f"{PREFIX}_{name}", doc, labels=["node"])
            family.add_metric(node, value)
            yield family
        # The same by entry kind (chunk: sys and chunk segments; prefix: exact prefix blocks).
        by_kind = (
            ("lookup_tokens_by_kind", "Tokens looked up, by entry kind", "lookup_tokens"),
            ("hit_tokens_by_kind", "Tokens found committed, by entry kind", "hit_tokens"),
            ("hit_chunks_by_kind", "Entries found committed, by entry kind", "hits"),
        )
        for name, doc, field in by_kind:
            family = CounterMetricFamily(f"{PREFIX}_{name}", doc, labels=["node", "kind"])
            for kind, kind_counts in s.kinds.items():
                family.add_metric([self.node, kind], kind_counts[field])
            yield family
        for name, doc, field in (
            ("entries_by_kind", "Committed entries, by entry kind", "entries"),
            ("entry_bytes_by_kind", "Bytes of committed entries, by entry kind", "bytes"),
        ):
            gauge = GaugeMetricFamily(f"{PREFIX}_{name}", doc, labels=["node", "kind"])
            for kind, kind_counts in s.kinds.items():
                gauge.add_metric([self.node, kind], kind_counts[field])
            yield gauge
        evictions = CounterMetricFamily(
            f"{PREFIX}_evictions", "Entries evicted", labels=["node", "reason"]
        )
        for reason in ("capacity", "quota", "watermark", "admin", "clear", "corrupt"):
            evictions.add_metric([self.node, reason], s.evictions.get(reason, 0))
        yield evictions
        holds = CounterMetricFamily(
            f"{PREFIX}_holds",
            "Holds of committed entries (Commit's hold_ms, the router's cold chunks): ended by "
            "their first read, lapsed, evicted by an admin; refused (held entries at half "
            "the pool)",
            labels=["node", "outcome"],
        )
        for outcome in ("read", "lapsed", "evicted", "refused"):
            holds.add_metric([self.node, outcome], s.holds.get(outcome, 0))
        yield holds
        gauges = {
            "pool_bytes_used": ("Pool bytes held by entries and reservations", s.bytes_used),
            "pool_bytes_capacity": ("Pool size in bytes", s.bytes_capacity),
            "entries": ("Committed entries", s.entries),
            "pinned_entries": ("Pinned entries", s.pinned_entries),
            "held_entries": ("Entries held from eviction until their first read", s.held_entries),
            "active_leases": ("Leases held by readers", s.active_leases),
            "active_reservations": ("Reservations being written", s.active_reservations),
            "sessions": ("Client sessions", s.sessions),
            "pool_importers": ("Processes holding the device pool by IPC", s.pool_importers),
            "pool_blocks_quarantined": (
                "Blocks of expired reservations kept from reuse while their writer lives",
                s.blocks_quarantined,
            ),
            "draining": ("1 while draining", int(s.draining)),
        }
        yield from self._gauges(gauges)
        if s.disk is not None:
            yield from self._disk(s.disk)
        yield from self._tenants(s.tenants)

    def _tenants(self, tenants: dict[str, dict[str, int]]) -> Iterator[Metric]:
        """By tenant ("shared": the shared namespace): as many series as the tenants file
        names, and a removed tenant's go with its last entry."""
        families = (
            (CounterMetricFamily, "tenant_lookup_chunks", "Entries looked up", "lookups"),
            (CounterMetricFamily, "tenant_hit_chunks", "Entries found committed", "hits"),
            (CounterMetricFamily, "tenant_lookup_tokens", "Tokens looked up", "lookup_tokens"),
            (CounterMetricFamily, "tenant_hit_tokens", "Tokens found committed", "hit_tokens"),
            (CounterMetricFamily, "tenant_evictions", "Entries evicted, any reason", "evictions"),
            (GaugeMetricFamily, "tenant_entries", "Committed entries", "entries"),
            (GaugeMetricFamily, "tenant_entry_bytes", "Bytes of committed entries", "bytes"),
            (
                GaugeMetricFamily,
                "tenant_held_bytes",
                "Pool bytes its entries and reservations hold (what its quota bounds)",
                "held_bytes",
            ),
            (GaugeMetricFamily, "tenant_quota_bytes", "Its quota (0: none)", "quota_bytes"),
            (
                GaugeMetricFamily,
                "tenant_reserved_bytes",
                "Its reserved share: never evicted for another tenant",
                "reserved_bytes",
            ),
        )
        for kind, name, doc, field in families:
            family = kind(f"{PREFIX}_{name}", f"{doc}, by tenant", labels=["node", "tenant"])
            for tenant, counts in tenants.items():
                family.add_metric([self.node, tenant or SHARED_LABEL], counts[field])
            yield family

    def _gauges(self, gauges: dict[str, tuple[str, int]]) -> Iterator[Metric]:
        """One gauge per name: (help, value), labelled with the node."""
        for name, (doc, value) in gauges.items():
            gauge = GaugeMetricFamily(f"{PREFIX}_{name}", doc, labels=["node"])
            gauge.add_metric([self.node], value)
            yield gauge

    def _disk(self, d: DiskStats) -> Iterator[Metric]:
        """The disk tier's series (present only with one)."""
        node = [self.node]
        gauges = {
            "disk_entries": ("Entries in the disk tier", d.entries),
            "disk_bytes_used": ("Disk tier file bytes, headers included", d.bytes_used),
            "disk_bytes_capacity": ("Disk tier size in bytes (--disk-size)", d.bytes_capacity),
            "disk_spill_queue_bytes": (
                "Bytes of committed entries waiting to be written to disk",
                d.spill_queue_bytes,
            ),
            "disk_removed_at_start": (
                "Torn or stray files removed when this daemon started",
                d.removed_at_start,
            ),
        }
        yield from self._gauges(gauges)
        counts = {
            "disk_spills": ("Entries written to the disk tier", "spills"),
            "disk_spill_bytes": ("Entry bytes written to the disk tier", "spill_bytes"),
            "disk_promotions": ("Disk hits read back into the pool", "promotions"),
            "disk_promoted_bytes": ("Entry bytes read back from disk", "promoted_bytes"),
            "disk_evictions": ("Entries the disk tier evicted for room", "evictions"),
        }
        for name, (doc, field) in counts.items():
            family = CounterMetricFamily(f"{PREFIX}_{name}", doc, labels=["node"])
            family.add_metric(node, d.counts.get(field, 0))
            yield family
        labelled: tuple[tuple[str, str, str, dict[str, float]], ...] = (
            (
                "disk_spills_dropped",
                "Entries never written to disk: the queue was full, or they left memory first",
                "reason",
                {r: d.counts.get(f"dropped_{r}", 0) for r in ("queue_full", "evicted")},
            ),
            (
                "disk_errors",
                "Disk tier failures: write (disk full, read-only, I/O), read (checksum, I/O, "
                "file gone), promote (no room in the pool for a disk hit)",
                "op",
                {op: d.counts.get(f"errors_{op}", 0) for op in ("write", "read", "promote")},
            ),
            (
                "disk_seconds",
                "Seconds spent writing and reading the disk tier (summed over reads at once)",
                "op",
                {op: d.seconds.get(op, 0.0) for op in ("write", "read")},
            ),
        )
        for name, doc, label, values in labelled:
            family = CounterMetricFamily(f"{PREFIX}_{name}", doc, labels=["node", label])
            for value_label, value in values.items():
                family.add_metric([self.node, value_label], value)
            yield family


class _Bound:
    """A labelled metric with the node label filled in."""

    def __init__(self, metric: Any, node: str) -> None:
        self.metric = metric
        self.node = node

    def labels(self, *values: str) -> Any:
        return self.metric.labels(self.node, *values)


# RPC latency: 0.1 ms to 10 s
RPC_BUCKETS: tuple[float, ...] = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025)
RPC_BUCKETS += (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)

# What the server records, in the order they are exposed: attribute, kind, name (after the
# prefix), help, labels beside ``node``, and the label values each given a series at 0 from
# the start (so that dashboards and alerts see a zero, not an absence, until the first).
SERIES: tuple[tuple[str, type, str, str, tuple[str, ...], tuple[tuple[str, ...], ...]], ...] = (
    ("bytes", Counter, "bytes", "Entry bytes moved", ("transport", "direction"), ()),
    ("rpc_seconds", Histogram, "rpc_seconds", "RPC latency", ("method",), ()),
    ("errors", Counter, "errors", "RPCs answered with an error", ("code",), ()),
    (
        "remote_fetches",
        Counter,
        "remote_fetches",
        "Local misses pulled from a peer found in the cluster directory, by result",
        ("result",),
        (("ok",), ("absent",), ("failed",), ("present",)),
    ),
    (
        "directory_errors",
        Counter,
        "directory_errors",
        "Cluster directory (Redis) or peer failures; the daemon serves on alone",
        (),
        ((),),
    ),
    (
        "background_errors",
        Counter,
        "background_errors",
        "Steps of a background thread (reap, publish, fetch) that raised; it goes on",
        ("thread",),
        (),
    ),
    (
        "peer_pull_fallbacks",
        Counter,
        "peer_pull_fallbacks",
        "Peer pulls the transfer engine could not serve, pulled over the gRPC stream "
        "instead, by why",
        ("reason",),
        (("engine_unavailable",), ("peer_without_engine",), ("read_failed",)),
    ),
    (
        "tenant_reloads",
        Counter,
        "tenant_reloads",
        "Reloads of the tenants file (SIGHUP), by result: a failed one kept the tenants",
        ("result",),
        (("ok",), ("failed",)),
    ),
)


class Metrics:
    """Every series carries ``node`` (the daemon's --node), so dashboards and rules group by
    node without relabelling, whatever discovers the targets."""

    bytes: _Bound
    rpc_seconds: _Bound
    errors: _Bound
    remote_fetches: _Bound
    directory_errors: _Bound
    background_errors: _Bound
    peer_pull_fallbacks: _Bound
    tenant_reloads: _Bound

    def __init__(self, index: Index, node: str) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(IndexCollector(index, node))
        for attr, kind, name, doc, labels, zeros in SERIES:
            extra = {"buckets": RPC_BUCKETS} if kind is Histogram else {}
            metric = kind(
                f"{PREFIX}_{name}", doc, ["node", *labels], registry=self.registry, **extra
            )
            for values in zeros:
                metric.labels(node, *values)
            setattr(self, attr, _Bound(metric, node))
        self._http: Any = None

    def serve(self, address: str, token: str = "") -> int:
        """Serve /metrics; returns the bound port (address port 0 picks one). ``token``:
        only requests bearing it are answered (401 otherwise): the figures name tenants."""
        host, port = address.rsplit(":", 1)
        app = make_wsgi_app(self.registry)
        if token:
            app = _bearer_only(app, f"Bearer {token}")
        server = make_server(
            host.strip("[]"), int(port), app, ThreadingWSGIServer, handler_class=_QuietHandler
        )
        threading.Thread(target=server.serve_forever, name="metrics", daemon=True).start()
        self._http = server
        return int(server.server_port)

    def close(self) -> None:
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()


class _QuietHandler(WSGIRequestHandler):
    """No access log line per scrape."""

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base's name
        pass


def _bearer_only(app: Any, bearer: str) -> Any:
    """``app`` answering only requests whose Authorization header is ``bearer``."""
    expected = bearer.encode()

    def guarded(environ: dict[str, Any], start_response: Any) -> Any:
        given = environ.get("HTTP_AUTHORIZATION", "").encode()
        if hmac.compare_digest(given, expected):
            return app(environ, start_response)
        start_response("401 Unauthorized", [("WWW-Authenticate", "Bearer")])
        return [b"missing or wrong bearer token\n"]

    return guarded
