"""Scheduler side: segment, key, one batch lookup per request; say how many tokens beyond
vLLM's own prefix hits the store supplies; plan the loads and saves the workers carry out."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from chunkstore.errors import ChunkStoreError
from chunkstore.keys import Isolation
from chunkstore.segments import SegmentKind

from .client_holder import DaemonLink
from .common import ChunkStoreMetadata, LoadItem, RequestPlan, SaveItem
from .config import ConnectorConfig
from .keys import ModelKeys, SegmentPlan

log = logging.getLogger("chunkstore.connector")


@dataclass
class Lookup:
    segments: list[SegmentPlan]
    present: list[bool]
    local_computed: int  # tokens vLLM's own prefix cache had
    hit_end: int  # end of the run of stored segments from the start


class SchedulerSide:
    def __init__(self, vllm_config: Any, config: ConnectorConfig) -> None:
        self.config = config
        self.keys = ModelKeys.from_vllm(vllm_config, config)
        self.link = DaemonLink(config, "chunkstore-scheduler")
        self._lookups: dict[str, Lookup] = {}
        self._loads: dict[str, list[LoadItem]] = {}
        self.stats = {"lookups": 0, "loaded_tokens": 0, "fallbacks": 0}

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> int:
        tokens = list(request.prompt_token_ids or [])
        segments = [
            s for s in self.keys.plan(tokens) if len(s.segment) >= self.config.min_chunk_tokens
        ]
        if not segments:
            return 0
        present = self._lookup(segments)
        hit_end = 0
        for plan, found in zip(segments, present, strict=True):
            if not found or plan.segment.start != hit_end:
                break
            hit_end = plan.segment.end
        hit_end = min(hit_end, len(tokens) - 1)  # vLLM must compute at least the last token
        self._lookups[request.request_id] = Lookup(segments, present, num_computed_tokens, hit_end)
        return max(0, hit_end - num_computed_tokens)

    def _lookup(self, segments: list[SegmentPlan]) -> list[bool]:
        client = self.link.get()
        if client is None:
            self.stats["fallbacks"] += 1
            return [False] * len(segments)
        try:
            found = client.lookup(
                [s.key for s in segments], num_tokens=[len(s.segment) for s in segments]
            )
        except ChunkStoreError as err:
            self.link.failed(f"lookup failed: {err}")
            self.stats["fallbacks"] += 1
            return [False] * len(segments)
        self.stats["lookups"] += 1
        return [n is not None for n in found]

    def update_state_after_alloc(self, request: Any, num_external_tokens: int) -> None:
        lookup = self._lookups.get(request.request_id)
        if lookup is None or num_external_tokens <= 0:
            return
        start, end = lookup.local_computed, lookup.local_computed + num_external_tokens
        loads = []
        for plan in lookup.segments:
            lo, hi = max(plan.segment.start, start), min(plan.segment.end, end)
            if hi > lo:
                loads.append(LoadItem(plan.key, lo - plan.segment.start, lo, hi - lo))
        self._loads[request.request_id] = loads
        self.stats["loaded_tokens"] += num_external_tokens

    def build_connector_meta(self, scheduler_output: Any) -> ChunkStoreMetadata:
        meta = ChunkStoreMetadata()
        for new in scheduler_output.scheduled_new_reqs:
            plan = RequestPlan(new.req_id, list(new.block_ids[0]))
            plan.loads = self._loads.pop(new.req_id, [])
            lookup = self._lookups.get(new.req_id)
            if self.config.save and lookup is not None:
                scheduled = scheduler_output.num_scheduled_tokens.get(new.req_id, 0)
                plan.saves = self._saves(lookup, new.num_computed_tokens + scheduled)
            if plan.loads or plan.saves:
                meta.requests.append(plan)
        return meta

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
            if own_context and not found and seg.end <= computed_end:
                saves.append(SaveItem(plan.key, seg.start, len(seg)))
        return saves

    def request_finished(self, request: Any) -> None:
        self._lookups.pop(request.request_id, None)
        self._loads.pop(request.request_id, None)

    def shutdown(self) -> None:
        self.link.close()
