"""vLLM's paged KV cache as one worker registered it (worker process): what loads write into
and saves read from. ``WorkerSide.register_kv_caches`` fills it once; ``Loads`` and
``Saves`` only read it."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from chunkstore.kv.paging import cp_owner, cp_slot_mapping

from .cache_groups import NULL_BLOCK, CacheGroups
from .config import decode_context_parallel, prefill_context_parallel
from .cpu_layout import CpuKVLayout
from .device_layout import DeviceKVLayout
from .heads import RankHeads


def layer_number(name: str) -> int:
    """The layer a cache's name is for ("model.layers.3.self_attn.attn": 3)."""
    numbers = re.findall(r"\.(\d+)\.", name)
    return int(numbers[0]) if numbers else 0


@dataclass(frozen=True)
class CpRank:
    """Where this worker stands in vLLM's context-parallel group (docs/loads-and-saves.md): the
    sequence is interleaved over ``size`` ranks in runs of ``interleave`` tokens inside virtual
    blocks of ``size`` x block_size tokens, and this rank's cache holds only its own runs
    (``kv.paging.cp_slot_mapping``). 1: no context parallelism."""

    size: int = 1
    rank: int = 0
    interleave: int = 1

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.size or self.interleave < 1:
            raise ValueError(
                f"context-parallel rank {self.rank} of {self.size}, interleave {self.interleave}"
            )


def context_parallel(vllm_config: Any) -> tuple[CpRank, Any]:
    """This worker's place in vLLM's decode context-parallel group, and the group (None
    without one). vLLM shards the cache by that group in runs of
    ``cp_kv_cache_interleave_size`` tokens (vllm/v1/worker/block_table.py:97-110)."""
    size = decode_context_parallel(vllm_config)
    if size == 1:
        return CpRank(), None
    from vllm.distributed import get_dcp_group

    group = get_dcp_group()
    interleave = int(getattr(vllm_config.parallel_config, "cp_kv_cache_interleave_size", 1))
    return CpRank(size, group.rank_in_group, interleave), group


def prefill_replica(vllm_config: Any) -> int:
    """Which copy of the cache this worker holds under prefill context parallelism (0: the
    first, or none): every prefill rank writes every token (``config.
    prefill_context_parallel``), so prefill ranks whose decode rank and heads are the same
    hold the same cache. vLLM lays ranks out as [.., pp, pcp, tp] and builds each decode
    group over prefill ranks first, then tensor ranks (vllm/distributed/parallel_state.py:
    2135-2141 and 2216-2224, vLLM 0.32): a decode group of ``dcp`` ranks covers ``dcp``
    prefill ranks in a row (all of them where dcp >= pcp), so copy ``pcp_rank // dcp`` is
    the same on every rank of a decode group and of a tensor group: its saves' collectives
    are taken, or skipped, together."""
    if prefill_context_parallel(vllm_config) == 1:
        return 0
    from vllm.distributed import get_pcp_group

    return int(get_pcp_group().rank_in_group) // decode_context_parallel(vllm_config)


@dataclass
class RegisteredCache:
    """The caches in layer order, the access that reads and writes them (CPU or a device
    back end), this rank's KV heads, its place in a context-parallel group and whether
    reads of the cache can be trusted."""

    access: CpuKVLayout | DeviceKVLayout
    heads: RankHeads
    block_size: int
    layers: list[tuple[str, Any]] = field(default_factory=list)  # a tensor, or ascend's (K, V)
    layer_index: dict[str, int] = field(default_factory=dict)
    readable: bool = False  # a probe showed the cache reads back as the kernel wrote it
    # Exact prefix blocks are stored as this cache's own blocks where it has a packing
    # (``CpuKVLayout.packing``; "": token by token, as chunks are).
    packing: str = ""
    block_bytes: list[np.ndarray] = field(default_factory=list)  # each layer's, as bytes
    scratch: np.ndarray = field(default_factory=lambda: np.empty(0, dtype=np.uint8))
    cp: CpRank = field(default_factory=CpRank)
    # vLLM's context-parallel group where cp.size > 1 (a GroupCoordinator: ``all_gather``,
    # ``cpu_group``)
    cp_group: Any = None
    # Which copy of the cache it holds under prefill context parallelism: copy 0 stores
    # what was computed, the others only load (``prefill_replica``).
    replica: int = 0
    # vLLM's KV-cache groups (under its hybrid manager; else one) and each layer's, in
    # layer order: a layer's tokens go to the slots of its group's block table
    groups: CacheGroups = field(default_factory=CacheGroups)
    layer_groups: list[int] = field(default_factory=list)

    def set_layers(self, kv_caches: dict[str, Any], groups: CacheGroups | None = None) -> None:
        """vLLM's caches, by layer name, put in layer order."""
        self.layers = sorted(kv_caches.items(), key=lambda item: layer_number(item[0]))
        self.layer_index = {name: i for i, (name, _) in enumerate(self.layers)}
        self.groups = groups or CacheGroups()
        group_of = self.groups.group_of()
        self.layer_groups = [group_of.get(name, 0) for name, _ in self.layers]

    def group_slots(
        self, tables: tuple[list[int], ...], start: int, count: int
    ) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
        """Under the hybrid manager: for each KV-cache group, the slots of positions
        [start, start + count) its table holds, and which positions those are (None: all).
        A sliding-window group holds none where its table has the null block (positions out
        of the window of every token still to come: never attended there again); a group
        that keeps every token must hold them all (``ValueError`` otherwise: no exact place)."""
        placed: list[tuple[torch.Tensor, torch.Tensor | None]] = []
        for group, block_ids in enumerate(tables):
            if count and (start + count - 1) // self.block_size >= len(block_ids):
                raise ValueError(f"KV-cache group {group}'s table ends before the tokens")
            table = torch.tensor(block_ids, dtype=torch.int64)
            slots = self.access.slots(table, start, count)
            held = table[torch.arange(start, start + count) // self.block_size] != NULL_BLOCK
            if bool(held.all()):
                placed.append((slots, None))
            elif group < len(self.groups.windows) and self.groups.windows[group]:
                placed.append((slots[held], held))
            else:
                raise ValueError(f"KV-cache group {group} has no block for some of the tokens")
        return placed

    def pack(self, packing: str) -> None:
        """Packed entries are read straight into each layer's blocks, viewed as bytes; a
        block a load skips is read into ``scratch``."""
        self.packing = packing
        if packing:
            self.block_bytes = [
                cache.view(torch.uint8).view(cache.shape[0], -1).numpy() for _, cache in self.layers
            ]
            self.scratch = np.empty(self.block_bytes[0].shape[1], dtype=np.uint8)

    def slots(self, block_ids: list[int], start: int, count: int) -> torch.Tensor:
        """Slots of positions [start, start + count) of a request with this block table;
        under context parallelism ``kv.paging.PAD_SLOT`` where another rank holds the
        position (the block table's entries are then virtual blocks)."""
        table = torch.tensor(block_ids, dtype=torch.int64)
        if self.cp.size == 1:
            return self.access.slots(table, start, count)
        positions = torch.arange(start, start + count)
        return cp_slot_mapping(
            torch.zeros_like(positions),
            positions,
            table[None, :],
            self.block_size,
            self.cp.size,
            self.cp.rank,
            self.cp.interleave,
        )

    def cp_gathered(self, local: torch.Tensor, start: int, count: int) -> torch.Tensor:
        """Positions [start, start + count) of every context-parallel rank, [layers, count,
        ...], from this rank's ``local`` ones [layers, its tokens among them, ...] in
        position order (a collective: every rank of the group calls it)."""
        if self.cp.size == 1:
            return local
        positions = torch.arange(start, start + count)
        owners = cp_owner(positions, self.cp.size, self.cp.interleave, self.block_size)
        counts = torch.bincount(owners, minlength=self.cp.size).tolist()
        width = max(counts)  # all_gather takes equal parts: each rank's padded to the most
        padded = local.new_zeros(local.shape[0], width, *local.shape[2:])
        padded[:, : local.shape[1]] = local
        gathered = self.cp_group.all_gather(padded, dim=1)
        whole = local.new_empty(local.shape[0], count, *local.shape[2:])
        for rank, held in enumerate(counts):
            whole[:, owners == rank] = gathered[:, rank * width : rank * width + held]
        return whole
