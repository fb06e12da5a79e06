"""``bench workload``'s exact replays, no vLLM: the trace through the daemon's own index
at a pool share, evicting by a policy, over a disk tier or not (``replay``), and Belady's
offline rule on the same room (``furthest_next_use_hit_rate``): the hit-rate curve to size a
pool by."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

from chunkstore.bench.workload_trace import Trace

if TYPE_CHECKING:
    from chunkstore.daemon.index import Index


def replay_hit_rate(trace: Trace, doc_tokens: list[int], share: float, policy: str) -> float:
    """The token hit rate the daemon's own index, evicting by ``policy``, gets on the trace
    with a pool of ``share`` of its working set (``replay``)."""
    return replay(trace, doc_tokens, share, policy)["store_hit_rate"]


def replay(
    trace: Trace,
    doc_tokens: list[int],
    share: float,
    policy: str,
    disk_share: float = 0.0,
    spill: str = "commit",
) -> dict[str, Any]:
    """The trace replayed through the daemon's own index, as the connector drives it (each
    request acquires its documents, stores the ones missed), with a pool of ``share`` of its
    working set, evicting by ``policy``, and with ``disk_share`` a disk tier of that share
    under it, spilling by ``spill`` (``serve --spill``; the spill thread run to the end after
    each request): no vLLM, no timing, exact. Its token hit rate (both tiers), and the disk
    tier's: hit tokens, tokens written a request (bytes: times the model's KV a token)."""
    from chunkstore.daemon.disk import HEADER, DiskTier
    from chunkstore.daemon.index import Index
    from chunkstore.daemon.pool import SharedMemoryPool
    from chunkstore.daemon.spill import SpillWhen

    block = 64  # 16 bytes a token below: 4 tokens a block
    used = {d for r in trace.requests for d in r.docs}
    blocks = max(1, int(share * sum(-(-doc_tokens[d] * 16 // block) for d in used)))
    with tempfile.TemporaryDirectory(prefix="chunkstore-replay-") as tmp:
        pool = SharedMemoryPool(block, blocks, directory=tmp)
        disk = None
        if disk_share:
            files = sum(HEADER + doc_tokens[d] * 16 for d in used)
            disk = DiskTier(Path(tmp) / "disk", max(HEADER + 4096, int(disk_share * files)))
        index = Index(
            pool,
            high_watermark=1.0,
            low_watermark=1.0,
            eviction=policy,
            disk=disk,
            spill_when=SpillWhen(spill),
        )
        looked, hit = _replay_requests(index, trace, doc_tokens)
        stats = index.disk_stats()
        pool.close()
    counts = stats.counts if stats is not None else {}
    return {
        "store_hit_rate": hit / looked,
        "disk_hit_tokens": counts.get("promoted_bytes", 0) // 16,
        "disk_tokens_written_per_request": counts.get("spill_bytes", 0) / 16 / len(trace.requests),
    }


def _replay_requests(index: Index, trace: Trace, doc_tokens: list[int]) -> tuple[int, int]:
    """Each request of the trace as the connector makes it: acquire its documents, release
    the leases, store the ones missed (an entry that can never fit is skipped: computed
    every time); with a disk tier, the spill thread's queue written out after each. Tokens
    looked up, and found."""
    from chunkstore.kv.entry import EntryLayout

    pool, session = index.pool, index.open_session("replay")
    looked = hit = 0
    for request in trace.requests:
        keys = [d.to_bytes(16, "little") for d in request.docs]
        got = index.acquire(session, keys)
        index.release(session, [g[0].id for g in got if g is not None])
        for doc, key, found in zip(request.docs, keys, got, strict=True):
            looked += doc_tokens[doc]
            if found is not None:
                hit += doc_tokens[doc]
                continue
            layout = EntryLayout(1, 1, 4, "float32", "mla", doc_tokens[doc], 0)
            if layout.nbytes > pool.capacity:
                continue  # never fits: computed every time
            reservation = index.reserve(session, key, layout, layout.nbytes)
            checksum = pool.checksum(reservation.blocks, layout.nbytes)  # a disk read checks
            index.commit(session, reservation.id, checksum)
        while index.disk is not None and index.spill_one(0):
            pass
    return looked, hit


def furthest_next_use_hit_rate(trace: Trace, doc_tokens: list[int], share: float) -> float:
    """Belady's offline rule (evict what is next needed furthest ahead) on the same trace and
    room: what a policy that knew the future would get, near enough with entries of
    different sizes to show the headroom left above LRU."""
    accesses = [d for r in trace.requests for d in r.docs]
    used = set(accesses)
    room = share * sum(doc_tokens[d] for d in used)
    upcoming: dict[int, list[int]] = {}
    for i in reversed(range(len(accesses))):
        upcoming.setdefault(accesses[i], []).append(i)
    held: set[int] = set()
    filled = looked = hit = 0
    for doc in accesses:
        upcoming[doc].pop()
        looked += doc_tokens[doc]
        if doc in held:
            hit += doc_tokens[doc]
            continue
        if doc_tokens[doc] > room:
            continue
        held.add(doc)
        filled += doc_tokens[doc]
        while filled > room:
            victim = max(held, key=lambda d: upcoming[d][-1] if upcoming[d] else len(accesses))
            held.discard(victim)
            filled -= doc_tokens[victim]
    return hit / looked
