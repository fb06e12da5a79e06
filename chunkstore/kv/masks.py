"""The chunk-isolation attention mask, in every form an attention kernel takes.

Rules (docs/semantics.md#the-contract-everything-else-serves): sys tokens are causal among
themselves; a chunk token sees sys (in ``isolation: sys``) and the earlier tokens of its own
chunk, never another chunk; question tokens see everything before them. vLLM's kernels take no
mask tensor (seq_lens and a causal flag: vLLM-Ascend's attention-mask design,
docs/design.md#sources), so there the compact form (per-token segment ids, ``visible_ranges``)
drives attention; vLLM-Ascend's take an explicit mask, int8 with 1 = masked, built once and
cached by ``AttentionMaskBuilder``. ``IsolationMaskBuilder`` does the same here.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum

import torch

from chunkstore.kv.keys import Isolation
from chunkstore.kv.segments import Segment, SegmentKind


@dataclass(frozen=True)
class SegmentLayout:
    """The compact form of a chunked prompt: segment kinds and lengths, in order."""

    kinds: tuple[SegmentKind, ...]
    lengths: tuple[int, ...]

    @classmethod
    def from_segments(cls, segments: Sequence[Segment]) -> SegmentLayout:
        return cls(tuple(s.kind for s in segments), tuple(len(s) for s in segments))

    @property
    def num_tokens(self) -> int:
        return sum(self.lengths)

    def bounds(self) -> list[tuple[int, int]]:
        out, start = [], 0
        for n in self.lengths:
            out.append((start, start + n))
            start += n
        return out

    def segment_ids(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """Per-token index of the segment the token belongs to (int32)."""
        lengths = torch.tensor(self.lengths, dtype=torch.int64)
        ids = torch.arange(len(self.lengths), dtype=torch.int32)
        return torch.repeat_interleave(ids, lengths).to(device)


@dataclass(frozen=True)
class KeyRange:
    """Keys [start, end) a query segment attends to; ``causal`` when it is the segment itself."""

    start: int
    end: int
    causal: bool


def visible_ranges(layout: SegmentLayout, isolation: Isolation, index: int) -> list[KeyRange]:
    """The key ranges that segment ``index``'s tokens attend to."""
    bounds = layout.bounds()
    kind = layout.kinds[index]
    own = KeyRange(*bounds[index], causal=True)
    if kind is SegmentKind.QUESTION:
        return [KeyRange(s, e, False) for s, e in bounds[:index] if e > s] + [own]
    if kind is SegmentKind.CHUNK and isolation is Isolation.SYS:
        sys = [
            KeyRange(s, e, False)
            for (s, e), k in zip(bounds[:index], layout.kinds, strict=False)
            if k is SegmentKind.SYS and e > s
        ]
        return [*sys, own]
    return [own]


_KIND_CODE = {kind: code for code, kind in enumerate(SegmentKind)}


def allowed(
    layout: SegmentLayout, isolation: Isolation, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """Dense boolean mask [tokens, tokens]: True where the query (row) may see the key."""
    seg = layout.segment_ids(device).long()
    codes = torch.tensor([_KIND_CODE[k] for k in layout.kinds], device=device)[seg]

    def of_kind(kind: SegmentKind) -> torch.Tensor:
        return codes == _KIND_CODE[kind]

    pos = torch.arange(layout.num_tokens, device=device)
    causal = pos[None, :] <= pos[:, None]
    same = seg[:, None] == seg[None, :]
    q_question = of_kind(SegmentKind.QUESTION)[:, None]
    sees_sys = of_kind(SegmentKind.CHUNK)[:, None] & of_kind(SegmentKind.SYS)[None, :]
    if isolation is not Isolation.SYS:
        sees_sys = torch.zeros_like(same)
    return causal & (same | q_question | sees_sys)


class MaskForm(StrEnum):
    BOOL = "bool"  # True = attend (torch SDPA)
    ADDITIVE = "additive"  # 0 = attend, -inf = masked, added to scores
    INT8 = "int8"  # 1 = masked, as vLLM-Ascend passes it to its NPU kernels


def isolation_mask(
    layout: SegmentLayout,
    isolation: Isolation,
    form: MaskForm,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
) -> torch.Tensor:
    ok = allowed(layout, isolation, device)
    if form is MaskForm.BOOL:
        return ok
    if form is MaskForm.INT8:
        return (~ok).to(torch.int8)
    mask = torch.zeros(ok.shape, dtype=dtype, device=device)
    return mask.masked_fill_(~ok, float("-inf"))


class IsolationMaskBuilder:
    """Builds isolation masks once per (layout, isolation, form, dtype, device) and keeps the
    most recent ones, as vLLM-Ascend's AttentionMaskBuilder caches its causal mask."""

    def __init__(self, capacity: int = 32) -> None:
        self.capacity = capacity
        self._cache: OrderedDict[tuple[object, ...], torch.Tensor] = OrderedDict()
        self.builds = 0

    def get(
        self,
        layout: SegmentLayout,
        isolation: Isolation,
        form: MaskForm,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> torch.Tensor:
        key = (layout, isolation, form, dtype, str(device))
        mask = self._cache.get(key)
        if mask is None:
            mask = isolation_mask(layout, isolation, form, dtype, device)
            self.builds += 1
            self._cache[key] = mask
            if len(self._cache) > self.capacity:
                self._cache.popitem(last=False)
        else:
            self._cache.move_to_end(key)
        return mask
