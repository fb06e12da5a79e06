"""The tenants' shares of the pool: the blocks each holds (its entries' and reservations'),
its evictable entries in eviction order, its budget (``records.Budget``), and from those what
may be evicted for whom.

Every entry, reservation and block is some tenant's ("" the shared namespace; tenants.py maps
keys into namespaces before they get here). A tenant past its quota evicts its own lowest
ranked entries; the pool's eviction takes the lowest ranked entry among the tenants' that
leaves each other tenant its reserved share (``victim``). Counted in blocks (``block_size``
turns them into the bytes budgets are written in); the pool is the index's, so this is
testable without one. Every operation costs O(1) or O(tenants): the orders hold only
evictable entries (pinned, leased and spilling ones leave them and return when evictable
again). Called with the index's lock held.
"""

from __future__ import annotations

from collections import Counter

from chunkstore.daemon.eviction import Order, Policy
from chunkstore.daemon.records import NO_BUDGET, Budget, Entry, Spill
from chunkstore.errors import PoolFull


class Budgets:
    def __init__(self, policy: Policy, block_size: int) -> None:
        self.policy = policy
        self.block_size = block_size
        self.budgets: dict[str, Budget] = {}
        # The evictable entries (neither pinned nor leased), by tenant, lowest rank first
        # (eviction.py: least recently used, or least worth); ranks compare across tenants.
        self.orders: dict[str, Order[Entry]] = {}
        self.evictable: Counter[str] = Counter()  # blocks of the entries in orders, by tenant
        self.held: Counter[str] = Counter()  # blocks held, entries and reservations

    def of(self, tenant: str) -> Budget:
        return self.budgets.get(tenant, NO_BUDGET)

    def place(self, entry: Entry) -> None:
        """Keep the eviction order to the evictable entries: after any change to an entry's
        pins, leases, hold or spill, in it (ranked as of now) exactly when it is committed,
        unpinned, unleased, not held and not being written to disk."""
        writing = entry.spill is Spill.WRITING
        held = entry.leases or entry.pinned or entry.held_until
        evictable = not (held or entry.evicted or writing)
        order = self.orders.get(entry.tenant)
        if evictable and (order is None or entry.key not in order):
            if order is None:
                order = self.orders[entry.tenant] = self.policy.order()
            entry.rank = self.policy.rank(entry)
            order.add(entry)
            self.evictable[entry.tenant] += len(entry.blocks)
        elif not evictable and order is not None and order.remove(entry):
            self.evictable[entry.tenant] -= len(entry.blocks)

    def over_quota(self, tenant: str, count: int) -> bool:
        """Whether ``count`` more blocks would take ``tenant`` past its quota; PoolFull where
        evicting all its evictable entries would not make room for them."""
        bs, held = self.block_size, self.held[tenant]
        quota = self.of(tenant).quota
        if not quota or (held + count) * bs <= quota:
            return False
        if (held - self.evictable[tenant] + count) * bs > quota:
            raise PoolFull(
                f"tenant {tenant} is at its quota of {quota} bytes: it holds {held * bs}, "
                f"{self.evictable[tenant] * bs} of them evictable, and needs {count * bs} "
                "more; the rest are leased, pinned or reserved",
                needed=count * bs,
                free=max(0, quota - held * bs),
                evictable=self.evictable[tenant] * bs,
            )
        return True

    def evictable_for(self, tenant: str, evicting_for: str | None) -> int:
        """Blocks of ``tenant``'s that may be evicted for ``evicting_for``'s room (None: the
        watermark's): all its evictable ones for itself, above its reserved share for
        anyone else."""
        evictable = self.evictable[tenant]
        reserved = self.of(tenant).reserved
        if tenant == evicting_for or not reserved:
            return evictable
        kept = (reserved + self.block_size - 1) // self.block_size
        return max(0, min(evictable, self.held[tenant] - kept))

    def evictable_total(self, evicting_for: str | None) -> int:
        return sum(self.evictable_for(t, evicting_for) for t in self.orders)

    def keeps(self, tenant: str, blocks: int) -> bool:
        """Whether ``tenant`` holding ``blocks`` fewer would dip into its reserved share."""
        return (self.held[tenant] - blocks) * self.block_size < self.of(tenant).reserved

    def victim(self, evicting_for: str | None) -> Entry | None:
        """The lowest ranked evictable entry whose eviction leaves every other tenant's
        reserved share whole: the heads of the tenants' orders compared (O(tenants))."""
        best: Entry | None = None
        for tenant, order in self.orders.items():
            head = order.head()
            if head is None or (tenant != evicting_for and self.keeps(tenant, len(head.blocks))):
                continue
            if best is None or head.rank < best.rank:
                best = head
        return best
