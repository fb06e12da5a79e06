"""vLLM's KV-cache groups, as the connector needs them (both processes).

Without vLLM's hybrid KV-cache manager every layer is in one group and keeps every token's
KV. With it (a connector that is ``SupportsHMA``: ``ChunkStoreHybridConnector``), layers of
one attention kind share a group and its block table: Gemma 3's sliding-window layers in
groups of their own, whose blocks out of the window of every token still to come go back to
the pool and read as block 0, vLLM's null block (vllm/v1/core/single_type_kv_cache_manager.py,
``SlidingWindowManager``). The groups overlay one allocation: a block ID names the same
bytes in every group's tensors and belongs to one group at a time.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

NULL_BLOCK = 0  # vLLM's null block: never handed to a request as its own


@dataclass(frozen=True)
class CacheGroups:
    """Each group's layer names, sliding window (0: every token kept) and block size;
    ``unsupported``: why the connector cannot serve these groups (None: it can)."""

    layers: tuple[tuple[str, ...], ...] = ()
    windows: tuple[int, ...] = ()
    block_sizes: tuple[int, ...] = ()
    unsupported: str | None = None

    @classmethod
    def from_kv_cache_config(cls, kv_cache_config: Any) -> CacheGroups:
        """From vLLM's ``KVCacheConfig`` (None, as older vLLMs pass: one group); one group
        that keeps every token is the plain case (``hybrid`` False)."""
        groups = list(getattr(kv_cache_config, "kv_cache_groups", None) or [])
        if not groups:
            return cls()
        from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

        windows, unsupported = [], None
        for group in groups:
            spec = group.kv_cache_spec
            if isinstance(spec, SlidingWindowSpec):
                windows.append(int(spec.sliding_window))
            elif isinstance(spec, FullAttentionSpec):
                windows.append(0)
            else:
                windows.append(0)
                unsupported = f"a KV-cache group of {type(spec).__name__} layers"
        sizes = tuple(int(group.kv_cache_spec.block_size) for group in groups)
        if len(set(sizes)) > 1:
            unsupported = f"KV-cache groups of different block sizes {sizes}"
        if len(groups) == 1 and not windows[0] and unsupported is None:
            return cls()
        return cls(
            tuple(tuple(group.layer_names) for group in groups), tuple(windows), sizes, unsupported
        )

    @property
    def hybrid(self) -> bool:
        """vLLM's hybrid KV-cache manager shapes the cache: several groups, or one that lets
        go of the blocks before its window."""
        return bool(self.layers)

    def group_of(self) -> dict[str, int]:
        """Each layer's group, by layer name (empty with one group)."""
        return {name: g for g, names in enumerate(self.layers) for name in names}

    def released(self, group: int, computed: int, block_size: int) -> int:
        """How many of a request's first blocks a group may have let go once ``computed``
        tokens are computed: a sliding-window group frees whole blocks before its window
        (``SlidingWindowManager.get_num_skipped_tokens``: positions < computed - W + 1);
        such positions are never attended again, in that group's layers."""
        window = self.windows[group] if group < len(self.windows) else 0
        if not window:
            return 0
        return max(0, computed - window + 1) // block_size
