"""The reference every served KV is measured against: HF transformers, fp32, eager attention.

Two oracles (docs/semantics.md#what-is-exact):
- ``masked_prompt``: the whole prompt in one forward pass under the isolation mask (a 4D mask),
  at the actual positions. In ``isolation: none`` reused chunks must equal it.
- ``assembled_cache``: what chunkstore itself builds: sys computed alone, each chunk computed
  after its context at its virtual start and rotated to its actual start, the question
  computed on top. It is the exact reference for ``isolation: sys``, and for end-to-end tests.
- ``default_reference``: a prompt as the connector serves it with its defaults (the chunks it
  moves attended where they move, those it recomputes blended there): what the end-to-end
  tests and ``chunkstore doctor`` compare vLLM's answers with.

KV is held as [layers, tokens, kv_heads, head_dim], the layout chunkstore stores; an MLA
model's (DeepSeek-V2) as transformers caches it: the compressed latent as keys and k_pe as
values, [layers, tokens, 1, kv_lora_rank] and [..., rope_dim] (side by side: the entry).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch

from chunkstore.errors import UnsupportedRotaryError
from chunkstore.kv.fingerprint import layer_kv_shape
from chunkstore.kv.keys import Isolation
from chunkstore.kv.layer_rotary import LayerRotary
from chunkstore.kv.masks import MaskForm, SegmentLayout, isolation_mask
from chunkstore.kv.remap import remap_keys
from chunkstore.kv.rope import RotaryConfig
from chunkstore.kv.segments import Segment, SegmentKind
from chunkstore.policy.treatment import BackEnd, QualityConfig, treat


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

    def remapped(self, delta: int, rotary: RotaryConfig | LayerRotary) -> KV:
        """Keys rotated by ``delta`` positions, values untouched; with a ``LayerRotary``,
        each layer with its own (Gemma 3). An MLA model's (as HF's DeepSeek-V2 caches it:
        the compressed latent as keys, k_pe as values): k_pe rotated, the latent untouched
        (``rotary`` rotates the two side by side)."""
        if delta == 0:
            return self
        if isinstance(rotary, LayerRotary):
            if len(rotary.kinds) > 1:
                keys = torch.stack(
                    [remap_keys(layer, delta, rotary.layer(i)) for i, layer in enumerate(self.keys)]
                )
                return KV(keys, self.values)
            rotary = rotary.kinds[0]
        if rotary.rotary_offset and rotary.rotary_offset == self.keys.shape[-1]:  # MLA
            latent = torch.cat([self.keys, self.values], dim=-1)
            moved = torch.stack([remap_keys(layer, delta, rotary) for layer in latent])
            return KV(moved[..., : rotary.rotary_offset], moved[..., rotary.rotary_offset :])
        keys = torch.stack([remap_keys(layer, delta, rotary) for layer in self.keys])
        return KV(keys, self.values)


@dataclass
class Forward:
    logits: torch.Tensor  # [tokens, vocab]
    kv: KV  # the new tokens' KV


@dataclass
class Attended:
    """A question's attention, per layer (``HFReference.question_attention``)."""

    queries: list[torch.Tensor]  # [Tq, query heads, head_dim], rotated at their positions
    keys: list[torch.Tensor]  # [Tk, KV heads, head_dim]: the past's, then the question's
    probabilities: list[torch.Tensor]  # [query heads, Tq, Tk], HF's own


def attention_queries(module: Any, args: Any, kwargs: dict[str, Any]) -> torch.Tensor:
    """The queries an HF attention layer is about to attend with, from its forward
    pre-hook's arguments: projected and rotated at their positions, [Tq, query heads,
    head_dim] of the batch's first sequence, float32."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    hidden = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
    cos, sin = kwargs["position_embeddings"]
    q = module.q_proj(hidden).view(*hidden.shape[:-1], -1, module.head_dim)
    if getattr(module, "q_norm", None) is not None:  # Qwen3, Gemma 3: normed before RoPE
        q = module.q_norm(q)
    rotated, _ = apply_rotary_pos_emb(q.transpose(1, 2), q.transpose(1, 2), cos, sin)
    return rotated[0].transpose(0, 1).float()


class HFReference:
    """An HF causal LM driven token-exactly: explicit positions, masks and past KV.

    A model whose layers differ (Gemma 3: sliding-window layers at RoPE base 1e4, global
    ones at 1e6) has each layer's keys moved with its own rotary, and its sliding layers
    attend only keys less than their window behind, by position, as HF's own masks and
    vLLM's kernel do; every layer keeps every token's KV (as vLLM does with its hybrid
    KV-cache manager off, which it is with a connector), the window is a mask."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model.eval()
        self.config: Any = model.config
        self.layers = layer_kv_shape(model.config)[0]  # as the served engine caches keys

    @property
    def rotary(self) -> RotaryConfig:
        """The rotary of a model whose layers share one (else: ``layers``)."""
        if len(self.layers.kinds) > 1:
            raise UnsupportedRotaryError("per-layer", "each layer has its own: use .layers")
        return self.layers.kinds[0]

    @classmethod
    def load(cls, model_dir: str | Path) -> HFReference:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(
            model_dir, dtype=torch.float32, attn_implementation="eager"
        )
        return cls(model)

    def _cache(self, past: KV | None) -> Any:
        """``past`` as HF's cache ([1, KV heads, tokens, head_dim] a layer), empty for None."""
        from transformers import DynamicCache

        # With the config, HF's cache drops a sliding layer's keys past its window: this one
        # keeps them (the KV returned is every token's) and ``forward`` masks them instead.
        windowed = any(self.layers.windows)
        cache = DynamicCache() if windowed else DynamicCache(config=self.config)
        if past is not None:
            for layer in range(past.keys.shape[0]):
                cache.update(
                    past.keys[layer].transpose(0, 1)[None],
                    past.values[layer].transpose(0, 1)[None],
                    layer,
                )
        return cache

    @torch.no_grad()
    def forward(
        self,
        token_ids: Sequence[int],
        start: int,
        past: KV | None = None,
        allowed: torch.Tensor | None = None,
        positions: Sequence[int] | None = None,
        layer_allowed: Callable[[int, torch.Tensor], torch.Tensor] | None = None,
    ) -> Forward:
        """Run ``token_ids`` at positions start.. (or at ``positions``) on top of ``past``
        (which stands at positions 0.., in order, as every caller builds it).

        ``allowed`` is a boolean [new tokens, past + new tokens] mask; by default every new
        token sees all of ``past`` and the earlier new tokens (causal). ``layer_allowed``:
        such a mask for each layer instead, from the layer's index and its queries as
        attention uses them ([new tokens, query heads, head_dim], rotated): a sparse load's,
        each layer attending the blocks its own queries choose. A sliding-window layer's
        mask is narrowed to its window either way.
        """
        n = len(token_ids)
        past_len = past.num_tokens if past is not None else 0
        if allowed is None:
            allowed = torch.ones(n, past_len + n, dtype=torch.bool)
            allowed[:, past_len:] = torch.ones(n, n, dtype=torch.bool).tril()
        at = torch.arange(start, start + n) if positions is None else torch.tensor(positions)
        behind = at[:, None] - torch.cat([torch.arange(past_len), at])[None, :]
        cache = self._cache(past)
        hooks = self._layer_masks(allowed, layer_allowed, behind)
        additive = torch.zeros(allowed.shape).masked_fill_(~allowed, float("-inf"))
        try:
            out = self.model(
                input_ids=torch.tensor([list(token_ids)]),
                position_ids=at[None],
                attention_mask=additive[None, None],
                past_key_values=cache,
                use_cache=True,
            )
        finally:
            for hook in hooks:
                hook.remove()
        keys = torch.stack([k[0].transpose(0, 1)[past_len:] for k, _, _ in out.past_key_values])
        values = torch.stack([v[0].transpose(0, 1)[past_len:] for _, v, _ in out.past_key_values])
        return Forward(out.logits[0].float(), KV(keys, values))

    def _layer_masks(
        self,
        allowed: torch.Tensor,
        layer_allowed: Callable[[int, torch.Tensor], torch.Tensor] | None,
        behind: torch.Tensor,
    ) -> list[Any]:
        """Where a layer's mask is not ``allowed`` (``layer_allowed`` chooses it, or the
        layer slides a window over ``behind``, each query's distance to each key): a forward
        pre-hook on each attention layer that puts its own mask in; the hooks, to remove
        after the forward."""
        windows = self.layers.windows
        if layer_allowed is None and not any(windows):
            return []
        choose, everywhere = layer_allowed, allowed

        def masked(index: int) -> Any:
            def hook(module: Any, args: Any, kwargs: dict[str, Any]) -> Any:
                mask = (
                    everywhere
                    if choose is None
                    else choose(index, attention_queries(module, args, kwargs))
                )
                if windows[index]:  # HF's and vLLM's window: i - j < W
                    mask = mask & (behind < windows[index])
                layer_additive = torch.zeros(mask.shape).masked_fill_(~mask, float("-inf"))
                kwargs["attention_mask"] = layer_additive[None, None]
                return args, kwargs

            return hook

        layers: Any = cast(Any, self.model).model.layers
        return [
            layer.self_attn.register_forward_pre_hook(masked(i), with_kwargs=True)
            for i, layer in enumerate(layers)
        ]

    @torch.no_grad()
    def question_attention(self, token_ids: Sequence[int], start: int, past: KV) -> Attended:
        """``token_ids`` (a question) at positions start.. on top of ``past``, causally: per
        layer its queries as attention uses them (projected, rotated), the keys they attend
        (``past``'s, then its own) and HF's attention probabilities (``output_attentions``):
        what ``kv.attended`` is measured against."""
        model: Any = self.model
        layers = model.model.layers
        queries: list[torch.Tensor] = [torch.empty(0)] * len(layers)

        def capture(index: int) -> Any:
            def hook(module: Any, args: Any, kwargs: dict[str, Any]) -> None:
                queries[index] = attention_queries(module, args, kwargs)

            return hook

        cache = self._cache(past)
        hooks = [
            layer.self_attn.register_forward_pre_hook(capture(i), with_kwargs=True)
            for i, layer in enumerate(layers)
        ]
        try:
            n = len(token_ids)
            out = self.model(
                input_ids=torch.tensor([list(token_ids)]),
                position_ids=torch.arange(start, start + n)[None],
                past_key_values=cache,
                use_cache=True,
                output_attentions=True,
            )
        finally:
            for hook in hooks:
                hook.remove()
        keys = [k[0].transpose(0, 1).float() for k, _, _ in out.past_key_values]
        return Attended(queries, keys, [a[0].float() for a in out.attentions])

    def masked_prompt(
        self,
        segments: Sequence[Segment],
        isolation: Isolation,
        shifts: dict[int, int] | None = None,
    ) -> Forward:
        """The whole prompt in one pass under the isolation mask, at actual positions, or
        with ``shifts`` (segment index -> positions) those chunks that far on."""
        tokens = [t for s in segments for t in s.token_ids]
        layout = SegmentLayout.from_segments(segments)
        shifts = shifts or {}
        positions = [
            seg.start + i + shifts.get(index, 0)
            for index, seg in enumerate(segments)
            for i in range(len(seg))
        ]
        allowed = isolation_mask(layout, isolation, MaskForm.BOOL)
        return self.forward(tokens, 0, allowed=allowed, positions=positions)

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
        shifts: dict[int, int] | None = None,
    ) -> Forward:
        """Reused segments put together as chunkstore serves them, the question on top.

        Returns the question's logits (empty without a question) and the KV of the whole
        prompt. Chunks are computed at the virtual start their context gives them:
        ``virtual_gap`` tokens past sys in ``isolation: sys``, ``none_virtual_start`` in
        ``isolation: none``; ``shifts`` (segment index -> positions) attends those chunks
        that far from where they stand (``relevant_last``: the prompt with them put last).
        """
        shifts = shifts or {}
        parts: list[KV] = []
        sys_kv: KV | None = None
        question: Segment | None = None
        for index, seg in enumerate(segments):
            if seg.kind is SegmentKind.SYS:
                sys_kv = self.segment_kv(seg, None, 0)
                parts.append(sys_kv)
            elif seg.kind is SegmentKind.CHUNK:
                if isolation is Isolation.SYS and sys_kv is not None:
                    context, virtual_start = sys_kv, sys_kv.num_tokens + virtual_gap
                else:
                    context, virtual_start = None, none_virtual_start
                kv = self.segment_kv(seg, context, virtual_start)
                delta = seg.start + shifts.get(index, 0) - virtual_start
                parts.append(kv.remapped(delta, self.layers))
            else:
                question = seg
        cache = KV.cat(parts)
        if question is None:
            return Forward(torch.empty(0, self.config.vocab_size), cache)
        top = self.forward(question.token_ids, question.start, past=cache)
        return Forward(top.logits, KV.cat([cache, top.kv]))

    def blended_cache(
        self,
        segments: Sequence[Segment],
        isolation: Isolation,
        recompute_tokens: int,
        virtual_gap: int = 0,
        recompute_chunks: Sequence[int] | Mapping[int, range] = (),
    ) -> Forward:
        """The assembled cache with the first ``recompute_tokens`` tokens of each chunk, and
        every token of the chunks ``recompute_chunks`` (segment indices, or segment index ->
        the offsets in it recomputed), recomputed seeing
        everything before them (EPIC's selection, CacheBlend's blend), the question on top:
        the connector's ``recompute_tokens`` and ``recompute_chunks``.

        One forward pass over the selected tokens, again at their positions, and the
        question, on top of the assembled (isolated) cache: a selected token sees the
        cache's other tokens before it and the recomputed selected tokens up to itself, never
        its own isolated copy; the question sees the cache with every selected token's
        recomputed KV in place of its isolated one. Layer by layer that is what the
        connector computes. Returns the question's logits and the blended KV of the prompt.
        """
        *stored, question = segments
        if question.kind is not SegmentKind.QUESTION:
            raise ValueError("blending recomputes for a question: the prompt needs one")
        cache = self.assembled_cache(stored, isolation, virtual_gap=virtual_gap).kv
        spans = (
            recompute_chunks
            if isinstance(recompute_chunks, Mapping)
            else {i: range(len(stored[i])) for i in recompute_chunks}
        )
        selected = [
            seg.start + offset
            for index, seg in enumerate(stored)
            if seg.kind is SegmentKind.CHUNK
            for offset in range(len(seg))
            if offset < recompute_tokens or offset in spans.get(index, range(0))
        ]
        positions = [*selected, *range(question.start, question.end)]
        ids = [t for seg in stored for t in seg.token_ids]
        new_ids = [ids[p] for p in selected] + list(question.token_ids)
        past_len, s, n = cache.num_tokens, len(selected), len(positions)
        pos = torch.tensor(positions)
        allowed = torch.zeros(n, past_len + n, dtype=torch.bool)
        original = torch.ones(past_len, dtype=torch.bool)
        original[selected] = False  # recomputed: nobody sees the isolated copy
        allowed[:, :past_len] = original[None] & (torch.arange(past_len)[None] < pos[:, None])
        allowed[:, past_len : past_len + s] = pos[None, :s] <= pos[:, None]
        allowed[s:, past_len + s :] = torch.ones(n - s, n - s, dtype=torch.bool).tril()
        top = self.forward(new_ids, 0, past=cache, allowed=allowed, positions=positions)
        keys, values = cache.keys.clone(), cache.values.clone()
        keys[:, selected], values[:, selected] = top.kv.keys[:, :s], top.kv.values[:, :s]
        return Forward(top.logits[s:], KV.cat([KV(keys, values), top.kv.slice(s, n)]))


def random_llama(
    seed: int, vocab_size: int = 200, max_positions: int = 1024, **config: Any
) -> torch.nn.Module:
    """A random-weight Llama small enough for a unit test (3 layers, GQA 4:2, head_dim 32),
    eager attention, fp32; ``config`` adds or overrides LlamaConfig fields."""
    from transformers import LlamaConfig, LlamaForCausalLM

    settings: dict[str, Any] = {
        "vocab_size": vocab_size,
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "max_position_embeddings": max_positions,
        **config,
    }
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**settings)).eval()
    model.set_attn_implementation("eager")
    return model


def random_deepseek(
    seed: int, vocab_size: int = 200, max_positions: int = 1024, **config: Any
) -> torch.nn.Module:
    """A random-weight DeepSeek-V2 (multi-head latent attention) small enough for a unit test:
    2 layers, 4 heads, latent 64 + rope 16 (the rope part in GPT-J pairs, as vLLM caches it),
    dense MLPs, eager attention, fp32; ``config`` adds or overrides DeepseekV2Config fields."""
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM

    settings: dict[str, Any] = {
        "vocab_size": vocab_size,
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "q_lora_rank": None,
        "kv_lora_rank": 64,
        "qk_nope_head_dim": 32,
        "qk_rope_head_dim": 16,
        "v_head_dim": 32,
        "first_k_dense_replace": 2,  # no MoE layer
        "max_position_embeddings": max_positions,
        **config,
    }
    torch.manual_seed(seed)
    model = DeepseekV2ForCausalLM(DeepseekV2Config(**settings)).eval()
    model.set_attn_implementation("eager")
    return model


def mla_latents(model: torch.nn.Module, token_ids: Sequence[int], start: int) -> torch.Tensor:
    """The latent cache of an MLA model (DeepSeek-V2 in transformers, which caches the
    normalised compressed KV as keys and the rotated k_pe as values) for ``token_ids``
    computed alone at positions [start, ...): [layers, tokens, 1, kv_lora_rank + rope_dim],
    the entry layout of an MLA model."""
    ids = torch.tensor([list(token_ids)])
    positions = torch.arange(start, start + len(token_ids))[None]
    with torch.no_grad():
        cache = model(input_ids=ids, position_ids=positions, use_cache=True).past_key_values
    return torch.stack(
        [torch.cat([layer.keys[0, 0], layer.values[0, 0]], dim=-1) for layer in cache.layers]
    )[:, :, None]


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """||actual - expected|| / ||expected||, in float64."""
    diff = (actual.double() - expected.double()).norm()
    return float(diff / expected.double().norm().clamp_min(1e-30))


DEFAULTS = QualityConfig()


def default_treatment(
    segments: tuple[Segment, ...] | list[Segment],
    isolation: Isolation,
    virtual_gap: int = 0,
    recompute: bool = True,
    quality: QualityConfig = DEFAULTS,
    inband: bool = True,
) -> tuple[dict[int, range], dict[int, int], int]:
    """What the connector's defaults (or ``quality``) do with a prompt's chunks
    (``chunkstore.policy.treatment``, the policy the connector runs; ``recompute``: its workers
    can recompute, not under tensor parallelism; ``inband``: the in-band hook runs, not for
    an MLA model or one whose layers rotate differently): segment index -> the offsets
    recomputed in it, segment index -> positions each chunk moves, and how many first
    tokens of every other chunk are recomputed with them, for the HF reference of a served
    prompt."""
    back_end = BackEnd(inband=inband, recompute=recompute)
    treated = treat(segments, quality, isolation, virtual_gap, back_end)
    return treated.recomputed, treated.shifts, treated.first_tokens


def default_reference(
    ref: HFReference,
    segments: tuple[Segment, ...] | list[Segment],
    isolation: Isolation,
    virtual_gap: int = 0,
    recompute: bool = True,
    quality: QualityConfig = DEFAULTS,
    inband: bool = True,
) -> Forward:
    """The HF reference of a prompt the connector serves with its defaults (or ``quality``'s
    settings; ``inband``: ``default_treatment``'s): the assembled
    cache with the chunks ``default_treatment`` moves attended where it moves them (the
    prompt with them put last), those it recomputes blended there (and every other chunk's
    first tokens), the question on top. The KV is returned in the served prompt's order,
    each chunk's keys rotated to where it is attended, as the connector's cache holds it."""
    recomputed, shifts, first = default_treatment(
        segments, isolation, virtual_gap, recompute, quality, inband
    )
    if not recomputed:
        return ref.assembled_cache(segments, isolation, virtual_gap=virtual_gap, shifts=shifts)
    return blended_where_attended(ref, segments, isolation, shifts, recomputed, first, virtual_gap)


def blended_where_attended(
    ref: HFReference,
    segments: tuple[Segment, ...] | list[Segment],
    isolation: Isolation,
    shifts: dict[int, int],
    recomputed: Sequence[int] | Mapping[int, range],
    first_tokens: int,
    virtual_gap: int = 0,
) -> Forward:
    """The HF reference of chunks attended ``shifts`` (segment index -> positions) from
    where they stand, the ``recomputed`` ones (segment indices, or segment index -> offsets)
    blended there with every
    other chunk's first ``first_tokens``: ``HFReference.blended_cache`` of the prompt as
    attended (``reordered``), its KV returned in the served prompt's order (each chunk's
    keys rotated to where it is attended), as the connector's cache holds it."""
    attended, order = reordered(segments, shifts)
    if not isinstance(recomputed, Mapping):
        recomputed = {i: range(len(segments[i])) for i in recomputed}
    blended = ref.blended_cache(
        attended,
        isolation,
        first_tokens,
        virtual_gap,
        recompute_chunks={order.index(i): r for i, r in recomputed.items()},
    )
    # Position p of the served prompt is attended at p + its chunk's shift.
    at = [p + shifts.get(i, 0) for i, seg in enumerate(segments) for p in range(seg.start, seg.end)]
    at += range(len(at), blended.kv.num_tokens)  # what the question's forward added
    index = torch.tensor(at)
    kv = type(blended.kv)(blended.kv.keys[:, index], blended.kv.values[:, index])
    return type(blended)(blended.logits, kv)


def reordered(
    segments: tuple[Segment, ...] | list[Segment], shifts: dict[int, int]
) -> tuple[list[Segment], list[int]]:
    """The prompt as the connector attends it where chunks move (segment index -> shift):
    each segment at its start plus its shift, in that order; and the served segment index
    of each."""
    order = sorted(range(len(segments)), key=lambda i: segments[i].start + shifts.get(i, 0))
    moved = [
        Segment(segments[i].kind, segments[i].start + shifts.get(i, 0), segments[i].token_ids)
        for i in order
    ]
    return moved, order
