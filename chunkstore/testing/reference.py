"""The reference every served KV is measured against: HF transformers, fp32, eager attention.

Two oracles (DESIGN.md, "What is exact"):
- ``masked_prompt``: the whole prompt in one forward pass under the isolation mask (a 4D mask),
  at the actual positions. In ``isolation: none`` reused chunks must equal it.
- ``assembled_cache``: what chunkstore itself builds: sys computed alone, each chunk computed
  after its context at its virtual start and rotated to its actual start, the question
  computed on top. It is the exact reference for ``isolation: sys``, and for end-to-end tests.

KV is held as [layers, tokens, kv_heads, head_dim], the layout chunkstore stores.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from chunkstore.kv.keys import Isolation
from chunkstore.kv.masks import MaskForm, SegmentLayout, isolation_mask
from chunkstore.kv.rope import RotaryConfig, remap_keys
from chunkstore.kv.segments import Segment, SegmentKind


@dataclass
class KV:
    keys: torch.Tensor  # [layers, tokens, kv_heads, head_dim]
    values: torch.Tensor

    @property
    def num_tokens(self) -> int:
        return self.keys.shape[1]

    def slice(self, start: int, end: int) -> KV:
        return KV(self.keys[:, start:end], self.values[:, start:end])

    @staticmethod
    def cat(parts: Sequence[KV]) -> KV:
        return KV(torch.cat([p.keys for p in parts], 1), torch.cat([p.values for p in parts], 1))

    def remapped(self, delta: int, rotary: RotaryConfig) -> KV:
        """Keys rotated by ``delta`` positions, values untouched."""
        if delta == 0:
            return self
        keys = torch.stack([remap_keys(layer, delta, rotary) for layer in self.keys])
        return KV(keys, self.values)


@dataclass
class Forward:
    logits: torch.Tensor  # [tokens, vocab]
    kv: KV  # the new tokens' KV


class HFReference:
    """An HF causal LM driven token-exactly: explicit positions, masks and past KV."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model.eval()
        self.config: Any = model.config
        self.rotary = RotaryConfig.from_hf_config(model.config)

    @classmethod
    def load(cls, model_dir: str | Path) -> HFReference:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(
            model_dir, dtype=torch.float32, attn_implementation="eager"
        )
        return cls(model)

    @torch.no_grad()
    def forward(
        self,
        token_ids: Sequence[int],
        start: int,
        past: KV | None = None,
        allowed: torch.Tensor | None = None,
    ) -> Forward:
        """Run ``token_ids`` at positions start.. on top of ``past``.

        ``allowed`` is a boolean [new tokens, past + new tokens] mask; by default every new
        token sees all of ``past`` and the earlier new tokens (causal).
        """
        from transformers import DynamicCache

        n = len(token_ids)
        past_len = past.num_tokens if past is not None else 0
        if allowed is None:
            allowed = torch.ones(n, past_len + n, dtype=torch.bool)
            allowed[:, past_len:] = torch.ones(n, n, dtype=torch.bool).tril()
        additive = torch.zeros(allowed.shape).masked_fill_(~allowed, float("-inf"))
        cache = DynamicCache(config=self.config)
        if past is not None:
            for layer in range(past.keys.shape[0]):
                cache.update(
                    past.keys[layer].transpose(0, 1)[None],
                    past.values[layer].transpose(0, 1)[None],
                    layer,
                )
        out = self.model(
            input_ids=torch.tensor([list(token_ids)]),
            position_ids=torch.arange(start, start + n)[None],
            attention_mask=additive[None, None],
            past_key_values=cache,
            use_cache=True,
        )
        keys = torch.stack([k[0].transpose(0, 1)[past_len:] for k, _, _ in out.past_key_values])
        values = torch.stack([v[0].transpose(0, 1)[past_len:] for _, v, _ in out.past_key_values])
        return Forward(out.logits[0].float(), KV(keys, values))

    def masked_prompt(self, segments: Sequence[Segment], isolation: Isolation) -> Forward:
        """The whole prompt in one pass under the isolation mask, at actual positions."""
        tokens = [t for s in segments for t in s.token_ids]
        layout = SegmentLayout.from_segments(segments)
        return self.forward(tokens, 0, allowed=isolation_mask(layout, isolation, MaskForm.BOOL))

    def segment_kv(self, segment: Segment, context: KV | None, virtual_start: int) -> KV:
        """A segment's KV as chunkstore stores it: computed after its context, at
        ``virtual_start``, seeing nothing else."""
        return self.forward(segment.token_ids, virtual_start, past=context).kv

    def assembled_cache(
        self,
        segments: Sequence[Segment],
        isolation: Isolation,
        none_virtual_start: int = 0,
        virtual_gap: int = 0,
    ) -> Forward:
        """Reused segments put together as chunkstore serves them, the question on top.

        Returns the question's logits (empty without a question) and the KV of the whole
        prompt. Chunks are computed at the virtual start their context gives them:
        ``virtual_gap`` tokens past sys in ``isolation: sys``, ``none_virtual_start`` in
        ``isolation: none``.
        """
        parts: list[KV] = []
        sys_kv: KV | None = None
        question: Segment | None = None
        for seg in segments:
            if seg.kind is SegmentKind.SYS:
                sys_kv = self.segment_kv(seg, None, 0)
                parts.append(sys_kv)
            elif seg.kind is SegmentKind.CHUNK:
                if isolation is Isolation.SYS and sys_kv is not None:
                    context, virtual_start = sys_kv, sys_kv.num_tokens + virtual_gap
                else:
                    context, virtual_start = None, none_virtual_start
                kv = self.segment_kv(seg, context, virtual_start)
                parts.append(kv.remapped(seg.start - virtual_start, self.rotary))
            else:
                question = seg
        cache = KV.cat(parts)
        if question is None:
            return Forward(torch.empty(0, self.config.vocab_size), cache)
        top = self.forward(question.token_ids, question.start, past=cache)
        return Forward(top.logits, KV.cat([cache, top.kv]))


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """||actual - expected|| / ||expected||, in float64."""
    diff = (actual.double() - expected.double()).norm()
    return float(diff / expected.double().norm().clamp_min(1e-30))
