"""The scheduler's sparse planning (scheduler process): which chunks of a request load
sparse (docs/sparse-loads.md), with which share, and their loads made sparse where a summary
and digests are stored beside the chunk. The workers read the sparse part at the request's
question (``sparse_reads``)."""

from __future__ import annotations

import logging
from dataclasses import replace

from chunkstore.connector_config import ConnectorConfig
from chunkstore.kv.entry import EntryKind
from chunkstore.kv.keys import digests_key, summary_key
from chunkstore.policy.selection import TransferParams
from chunkstore.policy.treatment import BackEnd

from .common import LoadItem, SparseSource
from .leases import Held, Leases
from .metrics import ConnectorStats
from .tracked import Tracked

log = logging.getLogger("chunkstore.connector")


class SparsePlan:
    def __init__(
        self, config: ConnectorConfig, back_end: BackEnd, stats: ConnectorStats, leases: Leases
    ) -> None:
        self.config = config
        self.back_end = back_end
        self.stats = stats
        self.leases = leases

    def share(self, req_id: str, params: TransferParams, name: str) -> float:
        """The request's ``name`` (``sparse_threshold`` or ``sparse_candidates``: its
        ``kv_transfer_params``', else the connector's); a malformed one is ignored, said and
        counted."""
        default = float(getattr(self.config, name))
        why = params.why_ignored(name)
        if why is not None:
            log.warning("chunkstore: request %s: kv_transfer_params ignored: %s", req_id, why)
            self.stats.add("bad_transfer_params")
            return default
        value = getattr(params, name)
        if value is None:
            return default
        if value and not (self.back_end.inband and self.config.sparse_summary_tokens):
            log.warning(
                "chunkstore: request %s: %s ignored: sparse loads need the in-band hook "
                "and sparse_summary_tokens > 0",
                req_id,
                name,
            )
            return 0.0
        return float(value)

    def eligible(self, tracked: Tracked) -> list[tuple[int, int]]:
        """The request's chunks that are loaded sparse if stored with their summaries."""
        if not tracked.sparse_threshold:
            return []
        return tracked.sparse_eligible(self.config.sparse_summary_tokens)

    def loads(self, tracked: Tracked, held: Held, loads: list[LoadItem]) -> list[LoadItem]:
        """The loads of whole chunks that may load sparse (``eligible``) and have a summary
        and digests stored beside them, made sparse (their leases held with the request's
        until it ends: the workers read them at its question)."""
        eligible = set(self.eligible(tracked))
        wanted = [
            i
            for i, item in enumerate(loads)
            if (item.actual_start, item.actual_start + item.num_tokens) in eligible
            and item.entry_offset == 0
            and item.num_tokens == item.lease.layout.num_tokens
        ]
        tracked.sparse = ()
        if not wanted:
            return loads
        block = self.config.sparse_block
        keys = [
            k
            for i in wanted
            for k in (
                summary_key(loads[i].key, block),
                digests_key(loads[i].key, block, loads[i].lease.checksum),
            )
        ]
        found = self.leases.acquire_more(held, keys, EntryKind.SUMMARY, "summaries")
        if found is None:
            return loads
        loads = list(loads)
        sparse = []
        for n, i in enumerate(wanted):
            summary, digests = found[2 * n], found[2 * n + 1]
            if summary is None or digests is None:
                continue
            item = loads[i]
            source = SparseSource(
                summary, digests, block, tracked.sparse_threshold, tracked.sparse_candidates
            )
            loads[i] = replace(item, sparse=source)
            sparse.append((item.actual_start, item.actual_start + item.num_tokens))
        tracked.sparse = tuple(sparse)
        self.stats.add("sparse_chunks", len(sparse))
        return loads
