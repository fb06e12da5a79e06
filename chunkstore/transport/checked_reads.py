"""The client's reads of leased entries, each checked before a byte is used.

``CheckedReads`` is the half of ``ChunkStoreClient`` (``chunkstore.client``) that copies a
leased entry's bytes out of the daemon, over whatever transport the session has, and judges
them: against the checksum stored at commit (``read_into``, ``read_many``, ``read_each``),
against per-block digests (``read_spans``), or by keyed sums its parts add up to
(``read_runs``, ``check_sums``). A mismatch is never returned as bytes: it is a
``ChecksumMismatch`` (the daemon is told, and evicts a corrupt entry) or, where the lease had
ended before the bytes were read, a ``LeaseLapsed``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from concurrent.futures import Executor

import torch

from chunkstore.errors import ChecksumMismatch, InvalidRequest, LeaseLapsed, StoreError
from chunkstore.protocol import chunkstore_pb2 as pb
from chunkstore.protocol.keyed_digest import packed
from chunkstore.protocol.shm import Pieces
from chunkstore.transport.base import Digest, LeasedEntry, Reads
from chunkstore.transport.calls import DaemonCalls
from chunkstore.transport.session import Session

log = logging.getLogger("chunkstore.client")


class CheckedReads:
    """Reads over the client's session; ``ChunkStoreClient`` sets these up."""

    _session: Session
    _calls: DaemonCalls
    _shm_reads: dict[int, int]  # lease id -> bytes copied out of the pool
    copy_threads: int

    def read_into(self, entry: LeasedEntry, out: torch.Tensor, session: str | None = None) -> None:
        """Copy a leased entry's bytes into ``out`` (uint8, nbytes long; on the CPU, or on the
        pool's device with a device pool) and check them.

        ``session``: the session holding the lease when another client took it (the vLLM
        scheduler leases, its workers read); that client reports the shared-memory bytes
        when it releases.

        Raises:
            ChecksumMismatch: the bytes are not those committed (do not use ``out``);
                ``LeaseLapsed`` where the lease ended before they were read.
            InvalidRequest, NotFound, StoreError: as ``read_each``.
        """
        self.read_many([entry], [out], session)

    def read_many(
        self,
        entries: Sequence[LeasedEntry],
        outs: Sequence[torch.Tensor],
        session: str | None = None,
    ) -> None:
        """``read_into`` of several leased entries at once: through the pool their stripes
        are shared out over ``copy_threads``, so 64 small entries copy side by side as one
        large one does. Every entry is checked; the first that fails raises
        ``ChecksumMismatch`` (the others were copied and checked).

        Raises:
            ChecksumMismatch: the first entry whose bytes are not those committed
                (``LeaseLapsed``: its lease had ended).
            InvalidRequest, NotFound, StoreError: as ``read_each``.
        """
        for failure in self.read_each(entries, outs, session):
            if failure is not None:
                raise failure

    def read_each(
        self,
        entries: Sequence[LeasedEntry],
        outs: Sequence[torch.Tensor | Pieces],
        session: str | None = None,
        threads: int | None = None,
        helper: Executor | None = None,
        progress: Callable[[int], None] | None = None,
    ) -> list[StoreError | None]:
        """``read_many``, with a verdict per entry instead of raising the first: None where
        the entry was read and checked, the ``ChecksumMismatch`` where it was not (use none
        of its bytes), ``LeaseLapsed`` where its lease had ended by then (the blocks may
        hold another entry now). An out may be ``Pieces`` (uint8 arrays whose lengths add up to the
        entry's, in the order of its bytes: a cache's blocks), filled straight from a
        shared-memory pool (through a buffer otherwise). ``threads``: this read's copy
        threads (``copy_threads`` when None); ``helper``: where the second one runs
        (``shm.gather_many``). ``progress(n)``: every entry's first n bytes are in its out,
        not yet checked (stripe by stripe from a mapped pool, all at the end otherwise); the
        verdicts come after the last call.

        Raises:
            InvalidRequest: an out that is not a contiguous uint8 tensor (or pieces) of its
                entry's length, or not one out an entry.
            NotFound: over the stream, a lease that ended (``SessionLost``: its session).
            ChecksumMismatch: over the stream, fewer bytes than the entry's.
            StoreError: the daemon cannot be reached (``Unavailable``).
        """
        reads = Reads(
            entries,
            outs,
            session or self._session.id,
            threads or self.copy_threads,
            helper,
            progress,
        )
        transport = self._session.transport
        digests = transport.read(reads)
        if transport.reports_reads and session is None:  # the daemon's shm byte counter
            for entry in entries:
                read = self._shm_reads.get(entry.lease_id, 0)
                self._shm_reads[entry.lease_id] = read + entry.nbytes
        if progress is not None and entries:
            progress(max(e.nbytes for e in entries))
        return [
            self._verdict(e, digest, reads.session)
            for e, digest in zip(entries, digests, strict=True)
        ]

    def read_spans(
        self,
        entry: LeasedEntry,
        spans: Sequence[tuple[int, int]],
        digests: Sequence[int],
        out: torch.Tensor,
        session: str | None = None,
    ) -> StoreError | None:
        """Part of a leased entry: its byte ``spans`` ([lo, hi) each, in the entry) copied
        into ``out`` one after another, each checked against its digest in ``digests``
        (xxh3-64: the entry's block digests, ``kv.sparse.EntryBlocks``) instead of the
        entry's checksum, which needs every byte. None where every span was read and
        checked; else the ``ChecksumMismatch`` (use none of ``out``: the pool's bytes, or the
        digests, are not the entry's) or the ``LeaseLapsed``. From the mapped pool only.
        ``session``: as ``read_into``'s.

        Raises:
            InvalidRequest: ``out`` is not a contiguous uint8 tensor of the spans' length, a
                span lies outside the entry, or the transport is not the mapped pool.
        """
        if len(spans) != len(digests):
            raise InvalidRequest(f"{len(spans)} spans to check against {len(digests)} digests")
        if any(not 0 <= lo <= hi <= entry.nbytes for lo, hi in spans):
            raise InvalidRequest(f"a span outside entry {entry.key.hex()} ({entry.nbytes} bytes)")
        total = sum(hi - lo for lo, hi in spans)
        if out.dtype != torch.uint8 or out.numel() != total or not out.is_contiguous():
            raise InvalidRequest(f"read {total} bytes into a contiguous uint8 tensor of as many")
        transport = self._session.transport
        actual = transport.read_spans(entry, spans, out.numpy())
        if transport.reports_reads and session is None:
            self._shm_reads[entry.lease_id] = self._shm_reads.get(entry.lease_id, 0) + total
        bad = [i for i, (a, b) in enumerate(zip(actual, digests, strict=True)) if a != b]
        if not bad:
            return None
        if self._report_corrupt(entry, session or self._session.id):
            return LeaseLapsed(
                f"the lease on entry {entry.key.hex()} ended before its bytes were read: not used"
            )
        lo, hi = spans[bad[0]]
        return ChecksumMismatch(
            f"entry {entry.key.hex()}: {len(bad)} of {len(spans)} spans (the first bytes "
            f"[{lo}, {hi})) are not what its block digests say: not used"
        )

    def read_runs(
        self,
        entry: LeasedEntry,
        starts: torch.Tensor,
        length: int,
        out: torch.Tensor,
        session: str | None = None,
    ) -> torch.Tensor:
        """Part of a leased entry: its runs of ``length`` bytes at ``starts`` (int64)
        gathered into ``out`` (uint8, one after another; on the device pool's device, else
        the CPU), straight from a pool, or gathered by the daemon over the stream. Returns
        their two keyed sums under the lease's key (``device_ipc.keyed_run_sums``, on
        ``out``'s device):
        nothing is checked here; the sums of parts that together hold every byte of the
        entry once (read by several processes: context-parallel ranks) are checked by
        ``check_sums``. Do not use ``out`` before. ``session``: as ``read_into``'s.

        Raises:
            InvalidRequest: the lease was not taken ``summed`` (nothing to check the parts
                against), a run lies outside the entry, or ``out`` is not a contiguous uint8
                tensor of the runs' length on the device named.
            NotFound, StoreError: over the stream, as ``read_each``'s.
            ChecksumMismatch: over the stream, not as many bytes as the runs'.
        """
        transport = self._session.transport
        if entry.summed is None:
            entry.sum_tables()  # raises: nothing to check the parts against
        inside = not starts.numel() or (
            int(starts.min()) >= 0 and int(starts.max()) + length <= entry.nbytes
        )
        if length < 1 or not inside:
            raise InvalidRequest(f"a run outside entry {entry.key.hex()} ({entry.nbytes} bytes)")
        if out.dtype != torch.uint8 or out.numel() != starts.numel() * length:
            raise InvalidRequest("read into a uint8 tensor of the runs' length")
        pool = self._session.transport.device_pool
        where = pool.device if pool is not None else torch.device("cpu")
        if out.device != where or not out.is_contiguous():
            raise InvalidRequest(f"read into a contiguous tensor on {where}, where the pool is")
        sums = transport.read_runs(
            entry, starts.to(where), length, out, session or self._session.id
        )
        if transport.reports_reads and session is None:
            self._shm_reads[entry.lease_id] = self._shm_reads.get(entry.lease_id, 0) + out.numel()
        return sums

    def check_sums(
        self, entry: LeasedEntry, sums: Sequence[int], session: str | None = None
    ) -> StoreError | None:
        """Whether the keyed sums of every byte of a leased entry, added up from its parts
        (``read_runs``; in any range, reduced here), are those its summed lease vouches for:
        None if so, else as ``read_each``'s verdicts (the daemon is told)."""
        if entry.summed is None:
            entry.sum_tables()  # raises: nothing to check the parts against
        assert entry.summed is not None
        return self._verdict(entry, packed(sums), session, packed(entry.summed.sums))

    def _verdict(
        self,
        entry: LeasedEntry,
        digest: Digest | int,
        session: str | None = None,
        expected: int | None = None,
    ) -> StoreError | None:
        """None if the bytes read are those committed (their digest is ``expected``, the
        entry's checksum by default); else the daemon is told, and why."""
        actual = digest if isinstance(digest, int) else digest.intdigest()
        session = session or self._session.id
        expected = entry.checksum if expected is None else expected
        if actual == expected:
            return None
        if self._report_corrupt(entry, session):
            return LeaseLapsed(
                f"the lease on entry {entry.key.hex()} ended before its bytes were read (its "
                "holder paused or stalled past the lease TTL): not used"
            )
        return ChecksumMismatch(
            f"entry {entry.key.hex()} hashes to {actual:#x}, committed as {expected:#x}: not used"
        )

    def _report_corrupt(self, entry: LeasedEntry, session: str) -> bool:
        """Have the daemon check the entry itself: if its pool bytes are bad it evicts it,
        so the next put replaces it (best effort: the read fails either way). Whether the
        lease read under had lapsed by then: the blocks may have gone to another entry."""
        key = entry.key
        request = pb.VerifyRequest(keys=[key], session_id=session, lease_ids=[entry.lease_id])
        try:
            reply = self._calls.call(self._calls.stub.Verify, request)
        except StoreError as err:
            log.warning("could not report entry %s as corrupt: %s", key.hex(), err)
            return False
        if reply.corrupt:
            log.error("entry %s was corrupt in the pool; the daemon evicted it", key.hex())
        return bool(reply.lapsed)
