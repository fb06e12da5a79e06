"""Scheduler side: segment, key, one batch lookup per request (an Acquire: the lookup takes
the leases that keep hit entries from eviction until the workers have loaded them); say how
many tokens beyond vLLM's own prefix hits the store supplies; plan the loads and saves the
workers carry out; release the leases when the workers report the loads done or the request
ends."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from chunkstore.client import LeasedEntry
from chunkstore.errors import ChunkStoreError
from chunkstore.kv.keys import Isolation
from chunkstore.kv.segments import SegmentKind

from .client_holder import DaemonLink
from .common import ChunkStoreMetadata, LoadItem, LoadsEnded, RequestPlan, SaveItem
from .config import ConnectorConfig, unsupported_parallelism
from .keys import ModelKeys, SegmentPlan
from .metrics import ConnectorStats

log = logging.getLogger("chunkstore.connector")


@dataclass
class Lookup:
    """One request's lookup, and what the scheduler learns of it step by step."""

    segments: list[SegmentPlan]
    present: list[bool]
    local_computed: int  # tokens vLLM's own prefix cache had
    hit_end: int  # end of the run of stored segments from the start
    block_ids: list[int] = field(default_factory=list)  # its block table, once scheduled
    saving: set[int] = field(default_factory=set)  # segments whose save is planned


@dataclass
class Held:
    """Leases one request holds, in the daemon session they were taken in."""

    session: str
    leases: dict[int, LeasedEntry] = field(default_factory=dict)  # segment index -> lease


class SchedulerSide:
    def __init__(self, vllm_config: Any, config: ConnectorConfig) -> None:
        self.config = config
        self.keys = ModelKeys.from_vllm(vllm_config, config)
        self.link = DaemonLink(config, "chunkstore-scheduler")
        self._lookups: dict[str, Lookup] = {}
        self._loads: dict[str, list[LoadItem]] = {}
        self._held: dict[str, Held] = {}
        self.stats = ConnectorStats()
        self.off = unsupported_parallelism(vllm_config)
        if self.off:
            log.warning(
                "chunkstore: %s; the connector stays off (every request computed)", self.off
            )

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> int:
        """Lease every stored segment (one batch call); keep the leases of the hit run past
        vLLM's own prefix hits, which the workers will load."""
        req_id = request.request_id
        self._release(req_id)  # asked again: the request was not scheduled last time
        if self.off:
            return 0
        tokens = list(request.prompt_token_ids or [])
        segments = [
            s for s in self.keys.plan(tokens) if len(s.segment) >= self.config.min_chunk_tokens
        ]
        if not segments:
            return 0
        held = self._acquire(segments)
        if not held.session:
            return 0  # no daemon: compute, and plan no saves it could not take either
        hit_end = 0
        for index, plan in enumerate(segments):
            if index not in held.leases or plan.segment.start != hit_end:
                break
            hit_end = plan.segment.end
        hit_end = min(hit_end, len(tokens) - 1)  # vLLM must compute at least the last token
        present = [index in held.leases for index in range(len(segments))]
        self._lookups[req_id] = Lookup(segments, present, num_computed_tokens, hit_end)
        self._held[req_id] = held
        self._keep(
            req_id,
            lambda i: (
                segments[i].segment.start < hit_end
                and segments[i].segment.end > num_computed_tokens
            ),
        )
        return max(0, hit_end - num_computed_tokens)

    def _acquire(self, segments: list[SegmentPlan]) -> Held:
        client = self.link.get()
        if client is None:
            self.stats.add("daemon_unreachable")
            return Held("")
        try:
            entries = client.acquire(
                [s.key for s in segments], num_tokens=[len(s.segment) for s in segments]
            )
        except ChunkStoreError as err:
            self.link.trouble("lookup", err)
            self.stats.add("daemon_unreachable")
            return Held("")
        self.stats.add("lookups")
        self.stats.add("lookup_tokens", sum(len(s.segment) for s in segments))
        leases = {i: entry for i, entry in enumerate(entries) if entry is not None}
        return Held(client.session, leases)

    def _keep(self, req_id: str, wanted: Callable[[int], bool]) -> None:
        """Release the request's leases on segments ``wanted`` rejects."""
        held = self._held.get(req_id)
        if held is None:
            return
        dropped = {i: lease for i, lease in held.leases.items() if not wanted(i)}
        for index in dropped:
            del held.leases[index]
        self._release_leases(held.session, list(dropped.values()))

    def _release(self, req_id: str, shm_bytes_read: int = 0) -> None:
        held = self._held.pop(req_id, None)
        if held is not None:
            self._release_leases(held.session, list(held.leases.values()), shm_bytes_read)

    def _release_leases(
        self, session: str, leases: list[LeasedEntry], shm_bytes_read: int = 0
    ) -> None:
        client = self.link.get()
        if not leases or client is None or client.session != session:
            return  # leases of a session that ended went with it
        try:
            client.release([lease.lease_id for lease in leases], shm_bytes_read)
        except ChunkStoreError as err:
            self.link.trouble("release", err)

    def update_state_after_alloc(self, request: Any, num_external_tokens: int) -> None:
        req_id = request.request_id
        lookup = self._lookups.get(req_id)
        held = self._held.get(req_id)
        if lookup is None or held is None or num_external_tokens <= 0:
            self._release(req_id)
            return
        start, end = lookup.local_computed, lookup.local_computed + num_external_tokens
        loads = []
        for index, plan in enumerate(lookup.segments):
            lo, hi = max(plan.segment.start, start), min(plan.segment.end, end)
            lease = held.leases.get(index)
            if hi > lo and lease is not None:
                loads.append(
                    LoadItem(plan.key, lo - plan.segment.start, lo, hi - lo, lease, held.session)
                )
        loaded = {item.key for item in loads}
        self._keep(req_id, lambda i: lookup.segments[i].key in loaded)
        self._loads[req_id] = loads
        self.stats.add("hit_tokens", num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> ChunkStoreMetadata:
        """Each scheduled request's loads (first step, or the step that resumes it after a
        preemption) and the saves of segments this step completes: with chunked prefill a
        segment is saved in the step that computes its last token, read whole from the
        cache."""
        meta = ChunkStoreMetadata()
        scheduled = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            computed_end = new.num_computed_tokens + scheduled.get(new.req_id, 0)
            self._plan(meta, new.req_id, list(new.block_ids[0]), True, computed_end)
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            blocks = cached.new_block_ids[i]
            computed_end = cached.num_computed_tokens[i] + scheduled.get(req_id, 0)
            resumed = req_id in cached.resumed_req_ids
            self._plan(meta, req_id, list(blocks[0]) if blocks else [], resumed, computed_end)
        return meta

    def _plan(
        self,
        meta: ChunkStoreMetadata,
        req_id: str,
        blocks: list[int],
        replace: bool,
        computed_end: int,
    ) -> None:
        lookup = self._lookups.get(req_id)
        if lookup is None:
            return
        if replace:
            lookup.block_ids = blocks
        else:
            lookup.block_ids.extend(blocks)
        loads = self._loads.pop(req_id, [])
        saves = self._saves(lookup, computed_end) if self.config.save else []
        if loads or saves:
            meta.requests.append(RequestPlan(req_id, list(lookup.block_ids), loads, saves))

    def update_connector_output(self, output: Any) -> None:
        """These requests' loads ended on the workers: their leases can go."""
        ended = output.kv_connector_worker_meta
        if isinstance(ended, LoadsEnded):
            for req_id, shm_bytes in ended.shm_bytes.items():
                self._release(req_id, shm_bytes)

    def _saves(self, lookup: Lookup, computed_end: int) -> list[SaveItem]:
        """Segments vLLM computed under exactly their isolation context, not stored yet: sys
        (it sees nothing before it), and in ``isolation: sys`` the chunk right after sys.
        A chunk that saw other chunks is never stored as position-independent."""
        saves = []
        for index, (plan, found) in enumerate(zip(lookup.segments, lookup.present, strict=True)):
            seg = plan.segment
            own_context = seg.kind is SegmentKind.SYS or (
                index == 1
                and seg.kind is SegmentKind.CHUNK
                and lookup.segments[0].segment.kind is SegmentKind.SYS
                and lookup.segments[0].segment.end == seg.start
                and self.config.isolation_mode is Isolation.SYS
            )
            if own_context and not found and index not in lookup.saving and seg.end <= computed_end:
                lookup.saving.add(index)
                saves.append(SaveItem(plan.key, seg.start, len(seg)))
        return saves

    def request_finished(self, request: Any) -> None:
        self._release(request.request_id)
        self._lookups.pop(request.request_id, None)
        self._loads.pop(request.request_id, None)

    def shutdown(self) -> None:
        for req_id in list(self._held):
            self._release(req_id)
        self.link.close()
