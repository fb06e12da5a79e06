"""Which evictable entry goes first (``serve --eviction``).

- ``lru``: the least recently released (an entry is ranked when it becomes evictable: on
  commit, and each time its last lease ends).
- ``worth``: what the entry saves per byte of pool, aged (GreedyDual-Size-Frequency, Cherkasova
  1998; the policy RAGCache's PGDSF builds on): rank = L + reads x recompute cost / bytes,
  where reads counts every request for the key, stored or not (a history that halves every
  65,536 reads), and L rises to half the rank of each entry evicted for room, so an entry
  that stops being read falls behind the newer ones. The recompute cost of a chunk of ``n`` tokens
  standing at ``s`` grows with position (attention reads every earlier token):
  n x (1 + (s + n/2) / POSITION_SCALE). A prefix block is worth at least the blocks after
  it, which nobody reaches without it, so prefix blocks count their tokens only, and among
  equals the block furthest into the prompt goes first (the tail before the head).

Both keep one order per tenant (the index compares the tenants' heads by rank), O(1) (lru)
or O(log n) (worth: a heap with stale items skipped) per operation.
"""

from __future__ import annotations

import heapq
import itertools
from collections import OrderedDict
from collections.abc import Iterator
from typing import Any, Generic, Protocol, TypeVar

from chunkstore.errors import InvalidRequest
from chunkstore.kv.entry import EntryKind, EntryLayout

POLICIES = ("lru", "worth")
# Tokens of context at which attention costs what the rest of a token's forward does: about
# params / (layers x hidden) (7,800 for SmolLM2-135M, 9,000 for Qwen2.5-0.5B).
POSITION_SCALE = 8192.0
AGING = 0.5  # L follows half the rank of what is evicted (see Worth.evicted)


class Ranked(Protocol):
    """What a policy reads of an entry (the index's ``Entry``)."""

    key: bytes
    layout: EntryLayout
    nbytes: int
    rank: float


E = TypeVar("E", bound=Ranked)


def recompute_cost(layout: EntryLayout) -> float:
    """What computing the entry's tokens again costs, in tokens at position 0."""
    n, start = layout.num_tokens, layout.virtual_start
    return n * (1.0 + (start + n / 2) / POSITION_SCALE)


class Order(Protocol[E]):
    """One tenant's evictable entries, lowest rank first."""

    def add(self, entry: E) -> None: ...
    def remove(self, entry: E) -> bool: ...
    def head(self) -> E | None: ...
    def __contains__(self, key: object) -> bool: ...
    def __len__(self) -> int: ...
    def __iter__(self) -> Iterator[bytes]: ...


class LruOrder(Generic[E]):
    """Ranks only ever grow (a sequence number): the insertion order is the rank order."""

    def __init__(self) -> None:
        self._entries: OrderedDict[bytes, E] = OrderedDict()

    def add(self, entry: E) -> None:
        self._entries[entry.key] = entry

    def remove(self, entry: E) -> bool:
        return self._entries.pop(entry.key, None) is not None

    def head(self) -> E | None:
        return next(iter(self._entries.values()), None)

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def __iter__(self) -> Iterator[bytes]:
        return iter(self._entries)


class HeapOrder(Generic[E]):
    """A heap of (rank, -start, sequence, entry); an entry removed or ranked again leaves a
    stale item behind, skipped when it surfaces and dropped when the heap is rebuilt (once it
    holds twice the live entries)."""

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, int, E]] = []
        self._live: dict[bytes, tuple[float, int, int, E]] = {}
        self._seq = itertools.count()

    def add(self, entry: E) -> None:
        item = (entry.rank, -entry.layout.virtual_start, next(self._seq), entry)
        self._live[entry.key] = item
        heapq.heappush(self._heap, item)
        if len(self._heap) > 2 * len(self._live) + 64:
            self._heap = list(self._live.values())
            heapq.heapify(self._heap)

    def remove(self, entry: E) -> bool:
        return self._live.pop(entry.key, None) is not None

    def head(self) -> E | None:
        while self._heap:
            item = self._heap[0]
            if self._live.get(item[3].key) is item:
                return item[3]
            heapq.heappop(self._heap)
        return None

    def __contains__(self, key: object) -> bool:
        return key in self._live

    def __len__(self) -> int:
        return len(self._live)

    def __iter__(self) -> Iterator[bytes]:
        return iter(self._live)


class Policy:
    """Ranks entries as they become evictable; ``evicted`` hears of each eviction for room.
    Both policies keep the read history: ``worth`` ranks by it, the disk tier's ``read-again``
    rule (``spill.py``) asks it whether a key was read twice."""

    name = "lru"
    # Reads remembered per key, hits and misses alike, so an entry evicted and stored again
    # comes back with its popularity (TinyLFU's history); every HISTORY reads each count
    # halves (and ones go), so they follow what is read now and stay about as many as
    # the keys read in the last 2 x HISTORY reads.
    HISTORY = 1 << 16

    def __init__(self) -> None:
        self._seq = itertools.count(1)
        self.reads: dict[bytes, int] = {}
        self._until_halving = self.HISTORY

    def order(self) -> Order[Any]:
        return LruOrder()

    def rank(self, entry: Ranked) -> float:
        return float(next(self._seq))

    def read(self, key: bytes) -> None:
        """A client asked for ``key`` (hit or miss)."""
        self.reads[key] = self.reads.get(key, 0) + 1
        self._until_halving -= 1
        if not self._until_halving:
            self.reads = {k: n // 2 for k, n in self.reads.items() if n > 1}
            self._until_halving = self.HISTORY

    def read_again(self, key: bytes) -> bool:
        """``key`` was asked for at least twice (within the history)."""
        return self.reads.get(key, 0) >= 2

    def evicted(self, entry: Ranked) -> None:
        pass


class Worth(Policy):
    name = "worth"

    def __init__(self) -> None:
        super().__init__()
        self.inflation = 0.0  # L: the rank of the last entry evicted for room

    def order(self) -> Order[Any]:
        return HeapOrder()

    def rank(self, entry: Ranked) -> float:
        layout = entry.layout
        cost = recompute_cost(layout) if layout.entry_kind == EntryKind.CHUNK else layout.num_tokens
        reads = max(self.reads.get(entry.key, 0), 1)
        return self.inflation + reads * cost / max(entry.nbytes, 1)

    def evicted(self, entry: Ranked) -> None:
        # Half of GDSF's clock: the read history ages on its own (it halves), and aging both
        # at full rate forgot popular entries too soon on generated Zipf traces (when the
        # rate was chosen; what is kept is worth against LRU at this rate:
        # docs/benchmarks.md, "RAG traffic").
        self.inflation = max(self.inflation, AGING * entry.rank)


def make_policy(name: str) -> Policy:
    if name == "lru":
        return Policy()
    if name == "worth":
        return Worth()
    raise InvalidRequest(f"eviction policy {name!r} is not one of {', '.join(POLICIES)}")
