"""A request the scheduler serves, from its arrival to its end (scheduler process): its
segments and their roles, what is looked up and stored for it, and what its steps
recompute or move (``Tracked``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from chunkstore.kv.segments import Segment, SegmentKind

from .keys import SegmentPlan

if TYPE_CHECKING:  # vLLM's types at the boundary, for the type checker only
    from vllm.v1.request import Request


@dataclass
class Tracked:
    """A request the store serves, from its arrival to its end: a chunked one (its prompt
    has a separator), or a plain one whose exact prefix blocks are looked up and stored
    (``cacheable`` holds them; ``request`` is vLLM's, whose tokens grow as it generates).

    Its tokens' roles: sys (before the first separator), chunk tokens under the isolation
    mask, and from ``causal_start`` on tokens that attend causally to everything before
    them: the question, what is generated. ``recomputed``: the chunks (segment index ->
    offsets in it) whose KV the workers recompute, seeing everything before them, in the
    step that computes the question (``chunkstore.policy.treatment``); they are looked up,
    loaded and stored as isolated chunks all the same. ``shifts``: (start, end, shift) of
    each chunk the workers attend ``shift`` positions from where it stands, from the step
    that computes the question on (``relevant_last``: its keys re-rotated in the cache)."""

    segments: list[Segment]  # every segment, the question's included
    cacheable: list[SegmentPlan]  # sys and isolated chunks of at least min_chunk_tokens, keyed
    causal_start: int
    present: list[bool] | None = None  # stored when last looked up (None: not looked up)
    local_computed: int = 0  # tokens vLLM's own prefix cache had
    # its block table in each KV-cache group, once scheduled (one group without vLLM's
    # hybrid manager)
    tables: list[list[int]] = field(default_factory=list)
    saving: set[int] = field(default_factory=set)  # cacheable segments whose save is planned
    recomputed: dict[int, range] = field(default_factory=dict)  # segment -> its offsets
    shifts: tuple[tuple[int, int, int], ...] = ()  # chunks attended elsewhere: start, end, by
    first_tokens: int = 0  # the first N tokens of every other chunk blended (recomputed) too
    # Recomputed chunks computed once, in place, in the question's step: never stored by it.
    in_place: tuple[tuple[int, int], ...] = ()
    # Chunks that missed inside the loaded run (segment indices), computed by the hook in
    # the request's first step, isolated (``fill_gaps``), and stored.
    gaps: list[int] = field(default_factory=list)
    gap_step: int | None = None  # where the step that computes them starts, until planned
    # Gaps recomputed whole in that step, when it computes the question: computed once, by
    # the recompute (never isolated), so never stored by this request ((start, end) each).
    gap_picks: tuple[tuple[int, int], ...] = ()
    # vLLM's request (plain prompts: its generated blocks are stored)
    request: Request | None = None
    salt: str = ""  # vLLM's cache_salt (plain prompts: part of every prefix key)
    # kv_consumer: the part block after the whole ones up to the token before the last,
    # looked up (never stored: a prefill instance stores its prompt's, ``save_tail``, and a
    # decode instance's prompt is that prompt and the token the prefill answered).
    tail: SegmentPlan | None = None
    save_tail: SegmentPlan | None = None  # kv_producer: its whole prompt's part block
    # Chunks loaded sparse ((start, end) each, ``sparse_threshold``): the rows after the
    # chunks attend only what the workers read of them.
    sparse: tuple[tuple[int, int], ...] = ()
    sparse_threshold: float = 0.0  # its own (kv_transfer_params) or the connector's; 0: off
    sparse_candidates: float = 0.0  # the same; 0: the summaries' bound chooses alone
    hold: float = 0.0  # kv_transfer_params' hold_s: what it stores is held until read

    @property
    def looked_up(self) -> list[SegmentPlan]:
        return self.cacheable + ([self.tail] if self.tail is not None else [])

    @property
    def chunked(self) -> bool:
        return self.segments[0].kind is SegmentKind.SYS

    @property
    def sys_end(self) -> int:
        return self.segments[0].end

    def _isolated_segments(self) -> list[Segment]:
        return [
            s for s in self.segments if s.kind is SegmentKind.CHUNK and s.end <= self.causal_start
        ]

    @property
    def isolated_chunks(self) -> tuple[tuple[int, int], ...]:
        return tuple((s.start, s.end) for s in self._isolated_segments())

    def blended_tokens(
        self, per_chunk: int, first_is_causal: bool = False
    ) -> tuple[tuple[int, int], ...]:
        """(position, token id) of the tokens the workers recompute: the ``recomputed``
        offsets of their chunks and the first ``per_chunk`` of every chunk, but those of
        the chunks computed in place. ``first_is_causal``: the chunk attended right after
        sys is computed isolated exactly as causally (it sees sys either way, at the same
        positions: isolation ``sys``, no virtual gap), so its first tokens are not."""
        offsets = {self.segments[i].start: r for i, r in self.recomputed.items()}
        in_place = {start for start, _ in self.in_place}
        shifts = {start: by for start, _, by in self.shifts}
        first = -1
        if first_is_causal:
            attended = {
                s.start + shifts.get(s.start, 0): s.start for s in self._isolated_segments()
            }
            first = attended.get(self.sys_end, -1)
        empty = range(0)
        return tuple(
            (seg.start + i, token)
            for seg in self._isolated_segments()
            if seg.start not in in_place
            for i, token in enumerate(seg.token_ids)
            if (i < per_chunk and seg.start != first) or i in offsets.get(seg.start, empty)
        )

    def plan_in_place(self, start: int, end: int) -> int:
        """In the step [start, end) that computes the question: the chunks recomputed
        whole whose every row this step computes (``IsolatedStep.in_place``); how many."""
        if not start <= self.causal_start < end:
            return 0
        chosen = [(self.segments[i], r) for i, r in self.recomputed.items()]
        whole = [seg for seg, r in chosen if len(r) == len(seg) and seg.start >= start]
        self.in_place = tuple(sorted((seg.start, seg.end) for seg in whole))
        return len(self.in_place)

    def plan_gap_picks(self, start: int, end: int) -> int:
        """In the gaps' step [start, end), if it computes the question: the gaps recomputed
        whole there (``gap_picks``), which the recompute computes once; how many."""
        if not self.gaps or start != self.gap_step or not start <= self.causal_start < end:
            return 0
        whole = [i for i in self.gaps if len(self.recomputed.get(i, ())) == len(self.segments[i])]
        self.gap_picks = tuple((self.segments[i].start, self.segments[i].end) for i in whole)
        return len(self.gap_picks)

    def gap_tokens(self) -> tuple[tuple[int, int], ...]:
        """(position, token id) of the gaps' tokens the hook computes isolated: all but the
        ``gap_picks`` (another relevant one is isolated, then recomputed as a loaded one is;
        the hook reports gaps it did not compute as failed loads)."""
        picks = {start for start, _ in self.gap_picks}
        gaps = (self.segments[g] for g in self.gaps)
        return tuple(
            (seg.start + i, token)
            for seg in gaps
            if seg.start not in picks
            for i, token in enumerate(seg.token_ids)
        )

    def first_changed(self, per_chunk: int, first_is_causal: bool) -> int | None:
        """The first position whose KV in the cache may be recomputed or moved (not the
        isolated KV at its own position), the blended first tokens (``blended_tokens``)
        included: so the chunk attended right after sys, which keeps its isolated KV where
        it stands, is not."""
        blended = [position for position, _ in self.blended_tokens(per_chunk, first_is_causal)]
        return min([*blended, *(start for start, _, _ in self.shifts)], default=None)

    def sparse_eligible(self, min_tokens: int) -> list[tuple[int, int]]:
        """The isolated chunks of at least ``min_tokens`` tokens that may be loaded sparse:
        none where the request recomputes or moves chunks (those read the chunks' KV in
        the cache whole)."""
        if self.recomputed or self.shifts or self.first_tokens or not min_tokens:
            return []
        return [(lo, hi) for lo, hi in self.isolated_chunks if hi - lo >= min_tokens]


def causal_start(segments: list[Segment]) -> int:
    """Where a chunked prompt's causal tokens begin: after its last separator, the question
    (a prompt without one, as ingest sends, has nothing to answer: every chunk isolated)."""
    last = segments[-1]
    return last.start if last.kind is SegmentKind.QUESTION else last.end
