"""What the index reports (``Index.stats``, the Stats call, Prometheus): lookups and hits, in
keys and in tokens, the entries and bytes held and the evictions, in all, by entry kind and
by tenant. Counted as they change, never by walking the entries, so a scrape does not hold
lookups up at 100k entries. Called with the index's lock held.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

from chunkstore.daemon.budgets import Budgets
from chunkstore.daemon.records import Entry
from chunkstore.daemon.spill import DiskStats
from chunkstore.kv.entry import ENTRY_KINDS, check_entry_kind

FIGURES = ("lookups", "hits", "lookup_tokens", "hit_tokens", "entries", "bytes")


@dataclass
class IndexStats:
    entries: int
    pinned_entries: int
    bytes_used: int
    bytes_capacity: int
    blocks_free: int
    blocks_total: int
    active_leases: int
    active_reservations: int
    sessions: int
    pool_importers: int  # sessions whose process opened a device pool by IPC
    lookups: int
    hits: int
    lookup_tokens: int
    hit_tokens: int
    evictions: dict[str, int]
    draining: bool
    blocks_quarantined: int
    # By entry kind (chunk, prefix): lookups, hits, lookup_tokens, hit_tokens, entries, bytes.
    kinds: dict[str, dict[str, int]] = field(default_factory=dict)
    disk: DiskStats | None = None  # None: no disk tier
    # By tenant ("" the shared namespace): entries, bytes, held_bytes, quota_bytes,
    # reserved_bytes, lookups, hits, lookup_tokens, hit_tokens, evictions.
    tenants: dict[str, dict[str, int]] = field(default_factory=dict)
    held_entries: int = 0  # committed with a hold (Commit's hold_ms), not yet read
    holds: dict[str, int] = field(default_factory=dict)  # ended by outcome; refused


class Counts:
    def __init__(self) -> None:
        self.total: Counter[str] = Counter()
        self.kinds: dict[str, Counter[str]] = {kind: Counter() for kind in ENTRY_KINDS}
        self.tenants: dict[str, Counter[str]] = {"": Counter()}
        self.evictions: Counter[str] = Counter()  # by reason
        self.holds: Counter[str] = Counter()  # ended, by outcome; refused (Commit's hold_ms)

    def looked_up(
        self, found: Sequence[bool], num_tokens: Sequence[int], entry_kind: str, tenant: str
    ) -> None:
        """A client's lookup of ``entry_kind`` entries: keys looked up and found, and, when
        the client sent each key's token count, tokens looked up and found."""
        check_entry_kind(entry_kind)
        by_tenant = self.tenants.setdefault(tenant, Counter())
        for counts in (self.total, self.kinds[entry_kind], by_tenant):
            counts["lookups"] += len(found)
            counts["hits"] += sum(found)
            if num_tokens:
                counts["lookup_tokens"] += sum(num_tokens)
                counts["hit_tokens"] += sum(
                    n for n, hit in zip(num_tokens, found, strict=True) if hit
                )

    def held(self, entry: Entry, sign: int) -> None:
        """An entry came (``sign`` 1) or went (-1): entries and bytes by kind and tenant."""
        by_tenant = self.tenants.setdefault(entry.tenant, Counter())
        for counts in (self.kinds[entry.layout.entry_kind], by_tenant):
            counts["entries"] += sign
            counts["bytes"] += sign * entry.nbytes

    def evicted(self, entry: Entry, reason: str) -> None:
        self.tenants[entry.tenant]["evictions"] += 1
        self.evictions[reason] += 1

    def tenants_now(self, named: Sequence[str], held: Counter[str]) -> None:
        """The tenants a budgets file names from now on: each counted from now, and a
        removed one's figures dropped once it holds nothing."""
        for tenant in named:
            self.tenants.setdefault(tenant, Counter())
        gone = [t for t, c in self.tenants.items() if t and t not in named]
        for tenant in gone:
            if not self.tenants[tenant]["entries"] and not held[tenant]:
                del self.tenants[tenant]

    def by_kind(self) -> dict[str, dict[str, int]]:
        return {kind: {n: counts[n] for n in FIGURES} for kind, counts in self.kinds.items()}

    def by_tenant(self, budgets: Budgets) -> dict[str, dict[str, int]]:
        return {
            tenant: {
                **{n: counts[n] for n in (*FIGURES, "evictions")},
                "held_bytes": budgets.held[tenant] * budgets.block_size,
                "quota_bytes": budgets.of(tenant).quota,
                "reserved_bytes": budgets.of(tenant).reserved,
            }
            for tenant, counts in self.tenants.items()
        }
