"""Saves (worker process): the segments the scheduler marked, read back out of vLLM's paged
KV cache after the step and stored in the pool. Only where a probe at start-up showed the
cache reads back as the kernel wrote it; a chunk computed seeing other chunks is never
stored; an exact prefix block of whole cache blocks is stored as the cache's own blocks.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from dataclasses import dataclass

import torch

from chunkstore.client import ChunkStoreClient
from chunkstore.errors import ChunkStoreError
from chunkstore.kv.entry import EntryKind, EntryLayout
from chunkstore.kv.keys import digests_key, summary_key
from chunkstore.kv.paging import PAD_SLOT
from chunkstore.kv.sparse import block_digests, digest_tensors, summary_tensors

from .client_holder import DaemonLink
from .common import ChunkStoreMetadata, RequestPlan, SaveItem
from .cpu_layout import CpuKVLayout
from .hook.isolation import IsolationHook
from .hook.recompute import IsolatedCopy
from .keys import ModelKeys
from .metrics import ConnectorStats
from .registered_cache import RegisteredCache

log = logging.getLogger("chunkstore.connector")


@dataclass(frozen=True)
class Summaries:
    """Which chunks are stored with a block summary (``kv.sparse``): those of at least
    ``min_tokens`` tokens (0: none), in blocks of ``block`` tokens."""

    min_tokens: int = 0
    block: int = 64

    def wanted(self, tokens: int) -> bool:
        return 0 < self.min_tokens <= tokens


class Saves:
    """Each step's saves, and the requests whose chunks must not be saved (computed
    causally: the isolation hook missed them)."""

    def __init__(
        self,
        cache: RegisteredCache,
        keys: ModelKeys,
        link: DaemonLink,
        stats: ConnectorStats,
        summaries: Summaries = Summaries(),
    ) -> None:
        self.cache = cache
        self.keys = keys
        self.link = link
        self.stats = stats
        self.summaries = summaries
        self._causal_requests: OrderedDict[str, None] = OrderedDict()  # see isolation_missed

    def save(self, metadata: ChunkStoreMetadata, hook: IsolationHook | None) -> None:
        """Store the segments the scheduler marked. Under tensor parallelism every rank reads
        its heads and they are gathered, under context parallelism its tokens (collectives,
        so every rank takes every step here); rank 0 stores the entry, which holds every
        head and token: the entry a single process stores. Under prefill context
        parallelism only the ranks holding copy 0 of the cache save
        (``registered_cache.prefill_replica``)."""
        blended: dict[str, IsolatedCopy] = {}
        moved: dict[str, dict[int, int]] = {}
        if hook is not None:
            blended, moved = hook.end_step()
            self.stats.add("isolated_tokens", hook.take_isolated_tokens())
            self.stats.add("recomputed_tokens", sum(len(c.positions) for c in blended.values()))
        if not self.cache.readable or self.cache.replica:  # copy 0 stores the same KV
            return
        began = time.perf_counter()
        saved = False
        for plan in metadata.requests:
            for item in plan.saves:
                if item.isolated and not self._isolated(plan.req_id, hook):
                    continue  # computed seeing other chunks: never stored
                blend = blended.get(plan.req_id)
                shifts = moved.get(plan.req_id, {})
                saved = self._save(plan, item, blend, shifts) or saved
        if saved:
            self.stats.add("save_seconds", time.perf_counter() - began)

    def isolation_missed(self, req_id: str) -> None:
        """The hook could not find a planned request's rows in the batch: vLLM computed its
        chunk tokens causally, so none of its chunks may be stored."""
        self.stats.add("isolation_misses")
        if not self._causal_requests:
            log.warning(
                "chunkstore: request %s was not found in the attention batch; its chunks "
                "were computed seeing each other and are not stored",
                req_id,
            )
        self._causal_requests[req_id] = None
        while len(self._causal_requests) > 10_000:
            self._causal_requests.popitem(last=False)

    def _isolated(self, req_id: str, hook: IsolationHook | None) -> bool:
        """Whether every chunk token this request computed was served by the hook."""
        return hook is not None and req_id not in self._causal_requests

    def _save(
        self,
        plan: RequestPlan,
        item: SaveItem,
        blend: IsolatedCopy | None,
        shifts: dict[int, int],
    ) -> bool:
        """One segment out of the cache, stored by rank 0 (of the tensor- and the
        context-parallel group): whether it was stored (False:
        it failed, or another request stored, or is storing, it first). ``blend``: the
        cache holds the request's recomputed tokens, whose isolated KV this puts back;
        ``shifts``: segments moved this step (relevant_last), by start."""
        packed = self._packed(plan, item)
        segment = None if packed is not None else self._segment(plan, item, blend)
        if (packed is None and segment is None) or self.cache.heads.rank or self.cache.cp.rank:
            return False
        client = self.link.get()
        if client is None:
            return False
        try:
            if segment is not None:
                keys, values = segment
                # Moved this step: its keys stand ``shift`` further on.
                virtual_start = item.start + shifts.get(item.start, 0)
                kind = EntryKind.PREFIX if item.prefix else EntryKind.CHUNK
                checksum = client.put_checksummed(
                    item.key, keys, values, virtual_start, kind, hold=item.hold
                )
                stored = checksum is not None
                long = kind == EntryKind.CHUNK and self.summaries.wanted(item.num_tokens)
                if checksum is not None and long and values is not None:  # not MLA's latent
                    self._save_summary(client, item.key, checksum, keys, values, virtual_start)
            else:
                assert packed is not None
                stored = client.put_packed(item.key, *packed, hold=item.hold)
        except ChunkStoreError as err:
            self.stats.add("save_failures")
            self.link.trouble(f"save of {item.key.hex()[:12]}", err)
            return False
        if stored:
            self.stats.add("saved_segments")
            self.stats.add("saved_tokens", item.num_tokens)
            if item.prefix:
                self.stats.add("prefix_saved_tokens", item.num_tokens)
        return stored

    def _save_summary(
        self,
        client: ChunkStoreClient,
        key: bytes,
        checksum: int,
        keys: torch.Tensor,
        values: torch.Tensor,
        virtual_start: int,
    ) -> None:
        """A stored chunk's block summary (its keys in the frame they are stored in,
        ``virtual_start``) and its blocks' digests (what a read of some of its blocks is
        checked against), beside it. One that fails is counted; the chunk stays stored (read
        whole where either is missing)."""
        block = self.summaries.block
        lo, hi = summary_tensors(keys, block)
        key_digests, value_digests = digest_tensors(block_digests(keys, values, block))
        try:
            if client.put(summary_key(key, block), lo, hi, virtual_start, EntryKind.SUMMARY):
                self.stats.add("saved_summaries")
            client.put(
                digests_key(key, block, checksum), key_digests, value_digests, 0, EntryKind.SUMMARY
            )
        except ChunkStoreError as err:
            self.stats.add("save_failures")
            self.link.trouble(f"save of {key.hex()[:12]}'s summary", err)

    def _segment(
        self, plan: RequestPlan, item: SaveItem, blend: IsolatedCopy | None
    ) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """K and V of a segment as the store holds them (an MLA model's: the latent, values
        None); None where isolation cannot be put back, or (vLLM's hybrid KV-cache manager)
        a sliding-window layer no longer holds some of its tokens (counted as a save
        failure)."""
        try:
            keys, values = self._read_segment(plan, item)
        except ValueError as err:
            log.info("chunkstore: not saving %s: %s", item.key.hex()[:12], err)
            self.stats.add("save_failures")
            return None
        if blend is None:
            return keys, values
        assert values is not None  # the hook serves K/V caches only
        try:
            blend.restore(item.start, keys, values)
        except ValueError as err:
            log.error("chunkstore: not saving %s: %s", item.key.hex()[:12], err)
            self.stats.add("save_failures")
            return None
        return keys, values

    def _packed(self, plan: RequestPlan, item: SaveItem) -> tuple[EntryLayout, torch.Tensor] | None:
        """An exact prefix block of whole cache blocks, as the cache's own blocks (all
        heads: one rank); None where it is saved token by token."""
        size, cache = self.cache.block_size, self.cache
        if not (cache.packing and item.prefix) or item.start % size or item.num_tokens % size:
            return None
        first = item.start // size
        ids = torch.tensor(plan.block_ids[first : first + item.num_tokens // size])
        assert isinstance(cache.access, CpuKVLayout)  # only its caches are packed
        blocks = torch.stack([cache.access.read_blocks(layer, ids) for _, layer in cache.layers])
        model = self.keys.layout
        layout = EntryLayout(
            model.num_layers,
            model.num_kv_heads,
            model.head_dim,
            self.keys.kv_dtype,
            "kv",
            item.num_tokens,
            item.start,
            EntryKind.PREFIX,
            cache.packing,
        )
        return layout, blocks

    def _read_segment(
        self, plan: RequestPlan, item: SaveItem
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """K and V of a segment, [layers, tokens, every head, head_dim], from vLLM's cache
        (an MLA cache: the latent, [layers, tokens, 1, latent], values None)."""
        slots = self.cache.slots(plan.block_ids, item.start, item.num_tokens)
        slots = slots[slots != PAD_SLOT]  # context parallelism: this rank's tokens, gathered
        of_layer = [slots] * len(self.cache.layers)
        if self.cache.groups.hybrid:  # each layer from its KV-cache group's blocks
            groups = self.cache.group_slots(plan.tables(), item.start, item.num_tokens)
            if any(held is not None for _, held in groups):
                raise ValueError("a sliding-window layer's blocks of it are gone")
            of_layer = [groups[group][0] for group in self.cache.layer_groups]
        pairs = [
            self.cache.access.read(layer, at)
            for (_, layer), at in zip(self.cache.layers, of_layer, strict=True)
        ]
        gathered = self.cache.cp_gathered
        keys = gathered(torch.stack([k for k, _ in pairs]), item.start, item.num_tokens)
        latent = any(v is None for _, v in pairs)
        values = None
        if not latent:
            local = torch.stack([v for _, v in pairs if v is not None])
            values = gathered(local, item.start, item.num_tokens)
        if self.cache.heads.size == 1 or self.cache.heads.whole:
            return keys, values
        from vllm.distributed import get_tp_group

        group = get_tp_group()
        keys = self.cache.heads.gather(keys, 2, group)
        return keys, None if values is None else self.cache.heads.gather(values, 2, group)
