"""Scheduler side: segment, key, one batch lookup per request (an Acquire: the lookup takes
the leases that keep hit entries from eviction until the workers have loaded them); say how
many tokens beyond vLLM's own prefix hits the store supplies; plan the loads and saves the
workers carry out, and, with in-band isolation, the chunk tokens each step computes (the
workers' attention hook serves them under the isolation mask); release the leases when the
workers report the loads ended or the request ends."""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from chunkstore.connector_config import ConnectorConfig
from chunkstore.kv.entry import EntryKind
from chunkstore.kv.segments import Segment, SegmentKind
from chunkstore.policy.selection import HOLD, TransferParams
from chunkstore.policy.treatment import Treatment

from .cache_groups import NULL_BLOCK, CacheGroups
from .client_holder import DaemonLink
from .common import (
    ChunkStoreMetadata,
    IsolatedStep,
    LoadItem,
    LoadsEnded,
    RequestPlan,
    SaveItem,
)
from .config import decode_context_parallel, unsupported_parallelism
from .keys import ModelKeys
from .leases import Held, Leases
from .metrics import ConnectorStats
from .prefix_cache import keep_roles_apart
from .sparse_plan import SparsePlan
from .tracked import Tracked, causal_start

if TYPE_CHECKING:  # vLLM's types at the boundary, for the type checker only
    from vllm.config import VllmConfig
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

log = logging.getLogger("chunkstore.connector")


class SchedulerSide:
    def __init__(
        self, vllm_config: VllmConfig, config: ConnectorConfig, groups: CacheGroups | None = None
    ) -> None:
        self.config = config
        # vLLM's KV-cache groups: several under its hybrid manager, whose loads are asked for
        # asynchronously (``loads_async``)
        self.groups = groups or CacheGroups()
        self._receiving: dict[str, tuple[list[int], ...]] = {}  # async loads: their tables
        self._received: set[str] = set()  # requests back from them (vLLM allocates again)
        self._failed_loads: set[str] = set()  # requests whose async loads failed: computed
        self.keys = ModelKeys.from_vllm(vllm_config, config)
        log.info(
            "chunkstore: prompts split at the separator %r (token IDs %s)",
            config.separator,
            self.keys.separator,
        )
        # vLLM's scheduler blocks: under decode context parallelism virtual blocks of a
        # rank's block size times the group's (vllm/v1/core/single_type_kv_cache_manager.py:108)
        self.block_size = vllm_config.cache_config.block_size * decode_context_parallel(vllm_config)
        transfer = vllm_config.kv_transfer_config
        role = getattr(transfer, "kv_role", None)
        self.producer, self.consumer = role == "kv_producer", role == "kv_consumer"
        self.prefix_tokens = -(-config.prefix_block_tokens // self.block_size) * self.block_size
        if self.prefix_tokens != config.prefix_block_tokens:
            log.info(
                "chunkstore: prefix blocks of %d tokens (prefix_block_tokens %d rounded up to "
                "a multiple of vLLM's block size, %d)",
                self.prefix_tokens,
                config.prefix_block_tokens,
                self.block_size,
            )
        self._tracked: dict[str, Tracked | None] = {}  # None: nothing to look up
        self._loads: dict[str, list[LoadItem]] = {}
        self.stats = ConnectorStats()
        self.link = DaemonLink(config, "chunkstore-scheduler", self.stats)
        self.leases = Leases(self.link, self.stats, decode_context_parallel(vllm_config) > 1)
        self._warned_prefix_cache = False
        self.off = unsupported_parallelism(vllm_config) or self.groups.unsupported
        self.keys.say_if_refused(vllm_config.model_config.model)  # once: one scheduler
        # What the back end serves, decided once (``config.for_deployment``), decides the
        # treatment (``chunkstore.policy.treatment``) and what is planned for the workers' hook.
        self.back_end = config.back_end
        self.policy = config.policy
        self.first_is_causal = self.policy.first_is_causal
        self.fills_gaps = config.fill_gaps and self.back_end.inband and self.back_end.recompute
        self.sparse = SparsePlan(config, self.back_end, self.stats, self.leases)
        if self.off:
            log.warning(
                "chunkstore: %s; the connector stays off (every request computed)", self.off
            )

    def _track(self, request: Request) -> Tracked | None:
        """The request's segments, split once; for a plain prompt (no separator) its prefix
        blocks (None with ``prefix_block_tokens`` 0)."""
        req_id = request.request_id
        if req_id not in self._tracked:
            prompt = list(request.prompt_token_ids or [])
            segments, refused = self.keys.served_segments(prompt)
            self.stats.add("rotary_refused_prompts", refused)
            salt = getattr(request, "cache_salt", None) or ""
            if segments and segments[0].kind is SegmentKind.SYS:  # a separator: chunked
                self.stats.add("chunked_prompts")
                self._tracked[req_id] = self._track_chunked(request, segments, salt)
            else:
                self.stats.add("unchunked_prompts")
                self._tracked[req_id] = self._track_plain(request, segments, prompt, salt)
        return self._tracked[req_id]

    def _track_chunked(self, request: Request, segments: list[Segment], salt: str) -> Tracked:
        """A chunked prompt: its treatment, the chunks stored (those before the causal part,
        long enough) and the moves, recomputes and sparse shares it asks for."""
        # The request's own choices, parsed once.
        params = TransferParams.parse(getattr(request, "kv_transfer_params", None))
        treated = self._treat(request, segments, params)
        causal = causal_start(segments)
        recomputed = dict(treated.recomputed)
        if not self.back_end.inband:  # relevant chunks standing last: vLLM's to compute
            causal = min(causal, treated.computed_from(segments) or causal)
            recomputed = {}
        plans = self.keys.plan(segments, salt)
        # (without the hook, a chunk vLLM computes from its span on loads up to it)
        cacheable = [
            plan
            for plan in plans
            if len(plan.segment) >= self.config.min_chunk_tokens and plan.segment.start < causal
        ]
        self.stats.add(
            "short_segments", sum(len(p.segment) < self.config.min_chunk_tokens for p in plans)
        )
        moves = tuple(
            (segments[i].start, segments[i].end, d) for i, d in sorted(treated.shifts.items())
        )
        return Tracked(
            segments,
            cacheable,
            causal,
            recomputed=recomputed,
            shifts=moves,
            first_tokens=treated.first_tokens,
            sparse_threshold=self.sparse.share(request.request_id, params, "sparse_threshold"),
            sparse_candidates=self.sparse.share(request.request_id, params, "sparse_candidates"),
            hold=self._hold(request, params),
        )

    def _track_plain(
        self, request: Request, segments: list[Segment], prompt: list[int], salt: str
    ) -> Tracked | None:
        """A plain prompt: its prefix blocks, and the part block a consumer looks up and a
        producer stores (None: no segments, or ``prefix_block_tokens`` 0)."""
        if not (segments and self.prefix_tokens):
            return None
        size = self.prefix_tokens
        return Tracked(
            segments,
            self.keys.prefix_plan(prompt, salt, size),
            0,
            request=request,
            salt=salt,
            tail=self.keys.prefix_tail(prompt[:-1], salt, size) if self.consumer else None,
            save_tail=self.keys.prefix_tail(prompt, salt, size) if self.producer else None,
        )

    def _hold(self, request: Request, params: TransferParams) -> float:
        """The request's ``hold_s``; a malformed one is ignored, said and counted."""
        why = params.why_ignored(HOLD)
        if why is not None:
            log.warning(
                "chunkstore: request %s: kv_transfer_params ignored: %s", request.request_id, why
            )
            self.stats.add("bad_transfer_params")
        return params.hold_s

    def _treat(
        self, request: Request, segments: list[Segment], params: TransferParams
    ) -> Treatment:
        """What the request's chunks get (``chunkstore.policy.treatment``), its own choice
        (``kv_transfer_params``) first; malformed ones are ignored, said and counted."""
        treated = self.policy.treat(segments, params)
        if treated.ignored_params is not None:
            log.warning(
                "chunkstore: request %s: kv_transfer_params ignored: %s",
                request.request_id,
                treated.ignored_params,
            )
            self.stats.add("bad_transfer_params")
        self.stats.add("recomputed_chunks", len(treated.recomputed))
        self.stats.add("moved_chunks", treated.moved)
        return treated

    def on_new_request(self, request: Request) -> None:
        """With in-band isolation, keep vLLM's prefix cache from sharing blocks between
        tokens of different roles (``prefix_cache``), before vLLM looks the request up."""
        if self.off or not self.back_end.inband:
            return
        tracked = self._track(request)
        if tracked is None or not tracked.chunked:
            return
        private = tracked.first_changed(tracked.first_tokens, self.first_is_causal)
        sparse = self.sparse.eligible(tracked)
        if sparse:  # loaded sparse, their blocks hold what was not read: never shared
            private = min(sparse[0][0], private if private is not None else sparse[0][0])
        if keep_roles_apart(request, tracked.causal_start, self.block_size, private):
            return
        if not self._warned_prefix_cache:
            log.warning(
                "chunkstore: cannot give question tokens their own prefix-cache hashes in "
                "this vLLM; chunked prompts do not read vLLM's prefix cache"
            )
            self._warned_prefix_cache = True
        request.skip_reading_prefix_cache = True

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> int:
        """Lease every stored segment (one batch call); keep the leases of the hit run past
        vLLM's own prefix hits, which the workers will load."""
        began = time.perf_counter()
        req_id = request.request_id
        self.leases.release(req_id)  # asked again: the request was not scheduled last time
        if self.off or req_id in self._failed_loads:
            return 0  # (an async load that failed: vLLM computes the request whole)
        tracked = self._track(request)
        if tracked is None:
            return 0
        tracked.local_computed = num_computed_tokens
        tracked.present = None
        segments = tracked.looked_up
        if not segments:
            if not tracked.chunked:
                tracked.present = []  # nothing to look up: what it generates may fill a block
            return 0
        held = self.leases.acquire(
            segments, EntryKind.CHUNK if tracked.chunked else EntryKind.PREFIX
        )
        self.stats.add("lookup_seconds", time.perf_counter() - began)
        if not held.session:
            return 0  # no daemon: compute, and plan no saves it could not take either
        hit_end, gaps = self._hit_run(tracked, held, num_computed_tokens)
        tracked.gaps = gaps
        tail = len(tracked.cacheable)  # the part block's index, if it has one
        if tail in held.leases and segments[tail].segment.start == hit_end:
            hit_end = segments[tail].segment.end
        if tracked.chunked:  # loaded up to where vLLM computes (a chunk's span, hook off)
            hit_end = min(hit_end, tracked.causal_start)
        # vLLM must compute at least the last token.
        hit_end = min(hit_end, request.num_prompt_tokens - 1)
        tracked.present = [index in held.leases for index in range(len(tracked.cacheable))]
        self.leases.hold(req_id, held)
        self.leases.keep(
            req_id,
            lambda i: (
                segments[i].segment.start < hit_end
                and segments[i].segment.end > num_computed_tokens
            ),
        )
        return max(0, hit_end - num_computed_tokens)

    def _hit_run(self, tracked: Tracked, held: Held, computed: int) -> tuple[int, list[int]]:
        """Where the run of stored segments from the prompt's start ends, and the chunks
        inside it that missed (segment indices), which the workers' hook computes
        (``fill_gaps``: a chunk, after sys, before the question, not in vLLM's own prefix
        hit; else the run ends at the first miss)."""
        hit_end, reach = 0, 0
        gaps: list[int] = []
        pending: list[int] = []
        for index, plan in enumerate(tracked.cacheable):
            seg = plan.segment
            if seg.start != reach:
                break
            reach = seg.end
            if index in held.leases:
                hit_end = seg.end
                gaps += pending
                pending = []
            elif (
                self.fills_gaps
                and index > 0
                and seg.kind is SegmentKind.CHUNK
                and seg.end <= tracked.causal_start
                and seg.start >= computed
            ):
                pending.append(tracked.segments.index(seg))
            else:
                break
        return hit_end, gaps

    @property
    def loads_async(self) -> bool:
        """Whether loads are asked for asynchronously: under vLLM's hybrid KV-cache manager,
        whose scheduler takes a failed load only by request (``failed_recving``), for a
        request waiting for its loads, and stops the engine on failed blocks
        (vllm/v1/core/sched/scheduler.py ``_handle_invalid_blocks``)."""
        return self.groups.hybrid

    def update_state_after_alloc(
        self,
        request: Request,
        num_external_tokens: int,
        tables: tuple[list[int], ...] = (),
    ) -> None:
        """``tables``: the request's blocks in each KV-cache group, as allocated (its loads'
        destination when they are asynchronous)."""
        req_id = request.request_id
        if req_id in self._received:  # back from its asynchronous loads: planned then
            self._received.discard(req_id)
            return
        tracked = self._tracked.get(req_id)
        held = self.leases.get(req_id)
        if tracked is not None:
            supplied = tracked.local_computed + max(num_external_tokens, 0)
            prompt = len(request.prompt_token_ids or [])
            self.stats.add("computed_prompt_tokens", max(0, prompt - supplied))
        if tracked is not None:  # vLLM computes from where the loads end: the gaps first
            tracked.sparse = ()  # until these loads say which are sparse
            tracked.gap_step = tracked.local_computed + num_external_tokens
            if num_external_tokens <= 0:
                tracked.gaps = []
        if tracked is None or held is None or num_external_tokens <= 0:
            self.leases.release(req_id)
            if self.loads_async and num_external_tokens > 0:  # vLLM waits: it fails them
                self._loads[req_id] = []
                self._receiving[req_id] = tables
                self._received.add(req_id)
            return
        start, end = tracked.local_computed, tracked.local_computed + num_external_tokens
        prefix = not tracked.chunked
        loads = []
        for index, plan in enumerate(tracked.looked_up):
            lo, hi = max(plan.segment.start, start), min(plan.segment.end, end)
            lease = held.leases.get(index)
            if hi > lo and lease is not None:
                offset = lo - plan.segment.start
                loads.append(LoadItem(plan.key, offset, lo, hi - lo, lease, held.session, prefix))
        loaded = {item.key for item in loads}
        self.leases.keep(req_id, lambda i: tracked.looked_up[i].key in loaded)
        if not prefix:
            loads = self.sparse.loads(tracked, held, loads)
        self._loads[req_id] = loads
        if self.loads_async:  # planned in the next metadata, the request not scheduled
            computed = tracked.local_computed + num_external_tokens
            self._receiving[req_id] = self._present(tables, computed)
            self._received.add(req_id)
        self.stats.add("hit_tokens", num_external_tokens)
        if prefix:
            self.stats.add("prefix_hit_tokens", num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> ChunkStoreMetadata:
        """Each scheduled request's loads (first step, or the step that resumes it after a
        preemption) and the saves of segments this step completes: with chunked prefill a
        segment is saved in the step that computes its last token, read whole from the
        cache."""
        meta = ChunkStoreMetadata()
        for req_id, tables in self._receiving.items():  # waiting for their loads
            loads = self._loads.pop(req_id, [])
            meta.requests.append(
                RequestPlan(req_id, tables[0], loads, group_block_ids=tables, receiving=True)
            )
        self._receiving = {}
        scheduled = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            computed, count = new.num_computed_tokens, scheduled.get(new.req_id, 0)
            self._plan(meta, new.req_id, new.block_ids, True, computed, count)
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            resumed = req_id in cached.resumed_req_ids
            computed, count = cached.num_computed_tokens[i], scheduled.get(req_id, 0)
            self._plan(meta, req_id, cached.new_block_ids[i], resumed, computed, count)
        return meta

    def _present(self, tables: tuple[list[int], ...], computed: int) -> tuple[list[int], ...]:
        """Each group's table with the blocks a sliding-window group may have let go once
        ``computed`` tokens are computed as the null block: vLLM tells the workers only of
        new blocks, so a freed (and maybe reused) block still stands in the tables they
        build; nothing of a request is read or written there."""
        size = self.block_size
        present = tuple(list(table) for table in tables)
        for group, table in enumerate(present):
            released = min(self.groups.released(group, computed, size), len(table))
            table[:released] = [NULL_BLOCK] * released
        return present

    def _plan(
        self,
        meta: ChunkStoreMetadata,
        req_id: str,
        blocks: tuple[list[int], ...] | None,
        replace_table: bool,
        computed: int,
        scheduled: int,
    ) -> None:
        """``blocks``: the request's whole table in each KV-cache group (``replace_table``:
        a new or resumed request) or its new blocks (None: none)."""
        tracked = self._tracked.get(req_id)
        if tracked is None:
            return
        if replace_table or not tracked.tables:
            tracked.tables = [list(table) for table in blocks or ()]
        else:
            for table, more in zip(tracked.tables, blocks or (), strict=False):
                table.extend(more)
        if self.groups.hybrid:
            tracked.tables = list(self._present(tuple(tracked.tables), computed))
        end = computed + scheduled
        if not tracked.chunked and self.config.save_generated:
            self._grow(tracked, end)
        loads = self._loads.pop(req_id, [])
        if self.config.recompute_in_one_pass and self.back_end.inband:
            once = tracked.plan_in_place(computed, end) + tracked.plan_gap_picks(computed, end)
            self.stats.add("one_pass_chunks", once)
        saves = self._saves(tracked, end) if self.config.save else []
        isolation = self._isolated_step(tracked, computed, end)
        if loads or saves or isolation:
            tables = tuple(list(table) for table in tracked.tables) or ([],)
            hybrid = tables if self.groups.hybrid else ()
            meta.requests.append(
                RequestPlan(req_id, tables[0], loads, saves, isolation, group_block_ids=hybrid)
            )

    def _grow(self, tracked: Tracked, computed_end: int) -> None:
        """Past its prompt, a plain request's blocks of generated tokens whose KV is in the
        cache by the end of this step join its prefix blocks, to be stored as they fill."""
        have = len(tracked.cacheable)
        if tracked.present is None or computed_end < (have + 1) * self.prefix_tokens:
            return
        if tracked.request is None:  # a chunked prompt's: nothing grows
            return
        tokens = list(tracked.request.all_token_ids[:computed_end])
        grown = self.keys.prefix_plan(tokens, tracked.salt, self.prefix_tokens)[have:]
        tracked.cacheable.extend(grown)
        tracked.present.extend([False] * len(grown))

    def _isolated_step(self, tracked: Tracked, start: int, end: int) -> IsolatedStep | None:
        """What the workers' hook needs for this step: the request's isolated chunks, when
        the step computes some of their tokens, or (question re-weighting) causal tokens
        that attend to them."""
        chunks = tracked.isolated_chunks
        if not self.back_end.inband or start >= end or not chunks:
            return None
        computes_chunks = any(lo < end and hi > start for lo, hi in chunks)
        reweights = (
            self.policy.quality.reweights_questions or bool(tracked.sparse)
        ) and end > tracked.causal_start
        recomputes = tracked.first_tokens or tracked.recomputed
        blends = bool(recomputes) and start <= tracked.causal_start < end
        moves = tracked.shifts if start <= tracked.causal_start < end else ()
        gaps: tuple[tuple[int, int], ...] = ()
        gap_picks: tuple[tuple[int, int], ...] = ()
        if tracked.gaps and start == tracked.gap_step:
            gaps, gap_picks = tracked.gap_tokens(), tracked.gap_picks
            tracked.gap_step = None
            self.stats.add("gap_tokens", len(gaps))
        if not (computes_chunks or reweights or blends or moves or gaps):
            return None
        first_tokens = tracked.first_tokens
        recompute = tracked.blended_tokens(first_tokens, self.first_is_causal) if blends else ()
        in_place = tracked.in_place if blends else ()
        return IsolatedStep(
            start,
            end,
            tracked.sys_end,
            chunks,
            recompute,
            moves,
            in_place,
            gaps,
            gap_picks,
            tracked.sparse,
        )

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        """These requests' loads ended on the workers: their leases can go."""
        self._failed_loads |= set(output.failed_recving or ())  # looked up no more
        ended = output.kv_connector_worker_meta
        if isinstance(ended, LoadsEnded):
            for req_id, shm_bytes in ended.shm_bytes.items():
                tracked = self._tracked.get(req_id)
                if tracked is not None and tracked.sparse:  # read at its question: kept
                    self.leases.count_read(req_id, shm_bytes)
                    continue
                self.leases.release(req_id, shm_bytes)

    def _saves(self, tracked: Tracked, computed_end: int) -> list[SaveItem]:
        """Segments not stored yet that vLLM has computed by the end of this step under
        exactly their isolation context. With in-band isolation that is every sys and chunk
        segment (the workers save a chunk only if their hook served it: ``isolated``).
        Without it, causal attention gives that context only to sys and, in ``isolation:
        sys``, the chunk right after sys; a chunk that saw other chunks is never stored."""
        if tracked.present is None:
            return []  # not looked up (the daemon was unreachable): nothing to store it in
        saves = []
        # their KV is not isolated
        in_place = {start for start, _ in (*tracked.in_place, *tracked.gap_picks)}
        for index, (plan, found) in enumerate(zip(tracked.cacheable, tracked.present, strict=True)):
            seg = plan.segment
            if found or index in tracked.saving or seg.end > computed_end or seg.start in in_place:
                continue
            causal_is_isolated = seg.kind in (SegmentKind.SYS, SegmentKind.PREFIX) or (
                seg.kind is SegmentKind.CHUNK
                and seg.start == tracked.sys_end
                and self.first_is_causal
            )
            if causal_is_isolated or self.back_end.inband:
                tracked.saving.add(index)
                saves.append(
                    SaveItem(
                        plan.key,
                        seg.start,
                        len(seg),
                        not causal_is_isolated,
                        seg.kind is SegmentKind.PREFIX,
                        tracked.hold,
                    )
                )
        tail = tracked.save_tail
        if tail is not None and tail.segment.end <= computed_end:
            tracked.save_tail = None  # planned once; a put of a stored key is a no-op
            seg = tail.segment
            saves.append(SaveItem(tail.key, seg.start, len(seg), prefix=True))
        return saves

    def request_finished(self, request: Request) -> None:
        self._failed_loads.discard(request.request_id)
        self._received.discard(request.request_id)
        self._receiving.pop(request.request_id, None)
        self.leases.release(request.request_id)
        self._tracked.pop(request.request_id, None)
        self._loads.pop(request.request_id, None)

    def shutdown(self) -> None:
        self.leases.release_all()
        self.link.close()
