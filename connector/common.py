"""What travels from the scheduler to the workers each step: small, typed, serializable."""

from __future__ import annotations

from dataclasses import dataclass, field

from chunkstore.client import LeasedEntry

from .vllm_bases import KVConnectorMetadata, KVConnectorWorkerMetadata


@dataclass(frozen=True)
class SparseSource:
    """What a sparse load of an entry reads besides it (``sparse_threshold``): leases on its
    block summary and on its blocks' digests (``kv.keys.summary_key``, ``digests_key``)."""

    summary: LeasedEntry
    digests: LeasedEntry
    block: int
    threshold: float
    candidates: float = 0.0  # > 0: the bound's candidates, then their keys choose


@dataclass(frozen=True)
class LoadItem:
    """Copy tokens [entry_offset, entry_offset + num_tokens) of entry ``key`` into the
    request's positions from ``actual_start``. The entry records the virtual start its keys
    were computed at; the worker rotates them by the difference.

    The scheduler holds ``lease`` in daemon session ``session`` from its lookup until the
    workers report the load done, so the entry cannot be evicted in between."""

    key: bytes
    entry_offset: int
    actual_start: int
    num_tokens: int
    lease: LeasedEntry
    session: str
    prefix: bool = False  # an exact prefix block (counted apart from chunks)
    # Loaded sparse: not here, but layer by layer in the hook, once the question's queries
    # choose the blocks.
    sparse: SparseSource | None = None


@dataclass(frozen=True)
class SaveItem:
    """Store positions [start, start + num_tokens) of the request as entry ``key``; vLLM
    computed them under exactly the entry's isolation context, at ``start``. ``isolated``:
    that context holds only if the worker's isolation hook served the segment (a chunk that
    causal attention would let see other chunks); the worker saves it only then."""

    key: bytes
    start: int
    num_tokens: int
    isolated: bool = False
    prefix: bool = False  # an exact prefix block (counted apart from chunks)
    hold: float = 0.0  # seconds the daemon holds it from eviction until read (hold_s)


@dataclass(frozen=True)
class IsolatedStep:
    """This step computes positions [start, end) of a chunked request whose tokens the
    workers' isolation hook serves: the rows of its isolated ``chunks`` ((start, end) of
    each, the prompt's whole list, in order and contiguous from ``sys_end``) under the
    isolation mask, and, with question re-weighting, the rows after them. Sys is
    [0, sys_end); every other row attends causally (vLLM's kernel).

    ``recompute`` ((position, token id) of each token, ``recompute_tokens``): chunk tokens
    whose KV the hook recomputes this step, seeing everything before them, once the
    chunks' isolated KV is in the cache and before the causal rows after the chunks read
    it; set in the step that computes the first of those rows.

    ``moves`` ((start, end, shift) of each chunk, ``relevant_last``): chunks whose keys the
    hook rotates by ``shift`` positions in the cache in that same step, once their isolated
    KV is there and before the causal rows read it.

    ``in_place`` ((start, end) of each chunk, ``recompute_in_one_pass``): chunks of
    ``recompute`` whose rows this step computes, computed once, where they are attended
    (seeing what ``recompute``'s tokens see), not under the isolation mask; ``recompute``
    then leaves their tokens out.

    ``gaps`` ((position, token id) of each token, ``fill_gaps``): whole chunks inside the
    loaded run that missed, which vLLM counts as loaded: the hook computes them this step
    (the request's first), isolated, through vLLM's modules, before anything reads them.
    ``gap_picks`` ((start, end) of each, ``recompute_in_one_pass``): gaps left out of
    ``gaps`` because ``recompute`` computes them whole this step; the hook reports them as
    failed loads if that recompute did not run.

    ``sparse`` ((start, end) of each chunk, ``sparse_threshold``): chunks loaded sparse, of
    which the rows after the chunks (the hook's, from the question on, decode included)
    attend only the blocks the worker read."""

    start: int
    end: int
    sys_end: int
    chunks: tuple[tuple[int, int], ...]
    recompute: tuple[tuple[int, int], ...] = ()
    moves: tuple[tuple[int, int, int], ...] = ()
    in_place: tuple[tuple[int, int], ...] = ()
    gaps: tuple[tuple[int, int], ...] = ()
    gap_picks: tuple[tuple[int, int], ...] = ()
    sparse: tuple[tuple[int, int], ...] = ()

    @property
    def count(self) -> int:
        return self.end - self.start


@dataclass
class RequestPlan:
    """A request's step: its block table, what the workers load and save, what the hook
    serves. Under vLLM's hybrid KV-cache manager each KV-cache group has a table of its own
    (``group_block_ids``, in vLLM's group order; ``block_ids`` is the first): a layer's
    loads and saves use its group's, where block 0 (vLLM's null block) stands for a block a
    sliding-window group let go, out of the window of every token still to come.
    ``receiving``: its loads were asked for asynchronously (the hybrid manager takes no
    failed blocks); the worker reports them done, or failed, by request."""

    req_id: str
    block_ids: list[int]
    loads: list[LoadItem] = field(default_factory=list)
    saves: list[SaveItem] = field(default_factory=list)
    isolation: IsolatedStep | None = None
    group_block_ids: tuple[list[int], ...] = ()
    receiving: bool = False

    def tables(self) -> tuple[list[int], ...]:
        """Each KV-cache group's block table (one group without the hybrid manager)."""
        return self.group_block_ids or (self.block_ids,)

    def placed(self) -> dict[int, int]:
        """The chunks this step both moves (``isolation.moves``) and loads whole: start ->
        shift. Their loads write their keys where they are attended, so the hook has
        nothing to move (``Loads.placed``)."""
        if self.isolation is None or not self.isolation.moves:
            return {}
        whole = {
            (item.actual_start, item.num_tokens)
            for item in self.loads
            if item.entry_offset == 0 and not item.prefix
        }
        return {
            start: shift
            for start, end, shift in self.isolation.moves
            if (start, end - start) in whole
        }


@dataclass
class ChunkStoreMetadata(KVConnectorMetadata):
    requests: list[RequestPlan] = field(default_factory=list)


@dataclass
class LoadsEnded(KVConnectorWorkerMetadata):
    """Worker -> scheduler after a step: the requests whose loads ended this step, loaded or
    failed (either way their leases can go), with the bytes each copied out of the
    shared-memory pool (for the daemon's metrics)."""

    shm_bytes: dict[str, int] = field(default_factory=dict)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> LoadsEnded:
        assert isinstance(other, LoadsEnded)
        merged = dict(self.shm_bytes)
        for req_id, nbytes in other.shm_bytes.items():
            merged[req_id] = merged.get(req_id, 0) + nbytes
        return LoadsEnded(merged)
