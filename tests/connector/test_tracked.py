"""A request the scheduler tracks (``connector/tracked.py``): which of its tokens its steps
recompute, and from where vLLM's prefix cache may not share its blocks."""

from __future__ import annotations

from chunkstore.kv.segments import Segment, SegmentKind
from chunkstore_vllm.tracked import Tracked


def test_the_chunk_attended_right_after_sys_keeps_its_isolated_first_tokens() -> None:
    """Its isolated KV is its causal KV (it sees sys either way, at the same positions), so
    only the chunks attended after another chunk recompute their first tokens; where the
    chunks are attended elsewhere, the first in attended order is the one left alone."""

    def segment(kind: SegmentKind, start: int, tokens: int) -> Segment:
        return Segment(kind, start, tuple(range(100 + start, 100 + start + tokens)))

    chunks = [segment(SegmentKind.CHUNK, start, 5) for start in (4, 9, 14)]
    question = segment(SegmentKind.QUESTION, 19, 3)
    tracked = Tracked([segment(SegmentKind.SYS, 0, 4), *chunks, question], [], 19)

    def positions(first_is_causal: bool) -> list[int]:
        return [p for p, _ in tracked.blended_tokens(2, first_is_causal)]

    assert positions(False) == [4, 5, 9, 10, 14, 15]
    assert positions(True) == [9, 10, 14, 15]
    # vLLM's prefix cache may share the cache blocks before the first position changed:
    # with the first chunk's KV its isolated (causal) KV, blocks up to the second chunk.
    assert tracked.first_changed(2, first_is_causal=False) == 4
    assert tracked.first_changed(2, first_is_causal=True) == 9
    assert tracked.first_changed(0, first_is_causal=True) is None
    # The first chunk recomputed whole and attended last: the second one now follows sys.
    tracked.shifts = ((4, 9, 10), (9, 14, -5), (14, 19, -5))
    tracked.recomputed = {1: range(5)}
    assert positions(True) == [4, 5, 6, 7, 8, 14, 15]
    assert tracked.first_changed(2, first_is_causal=True) == 4
    tracked.recomputed = {}  # moved, not recomputed: still not where it stands
    assert tracked.first_changed(0, first_is_causal=True) == 4
