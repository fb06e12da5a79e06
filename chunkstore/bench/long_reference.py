"""``bench long``'s reference engine: a long document's KV computed once by the HF fp32
reference, then questions on top of it, the document attended whole (``FULL``) or sparse,
its blocks chosen per layer at the question by a selector (``BOUND``: the summaries'
estimate; ``REFINE``: the bound's candidates, refined by exact attention over their keys;
``ORACLE``: exact attention over every key), applied as a per-head attention mask
(``SparseMask``); and the methods' names (``parse_methods``)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import torch

from chunkstore.kv import sparse
from chunkstore.reference import HFReference, attention_queries

FULL = "full"
BOUND, ORACLE, REFINE = "bound", "oracle", "refine"
UNION, EACH = "union", "each"
PREFILL_PIECE = 512  # tokens of the document a forward pass


def parse_methods(text: str) -> list[tuple[str, str, float]]:
    """``SELECTOR@THRESHOLD,...`` as (name, selector, threshold)."""
    methods = []
    for spec in filter(None, (x.strip() for x in text.split(","))):
        selector, at, threshold = spec.partition("@")
        if selector not in (BOUND, ORACLE, REFINE) or not at:
            raise ValueError(f"a method is {BOUND}@T or {ORACLE}@T, not {spec!r}")
        value = float(threshold)
        if not 0 < value <= 1:
            raise ValueError(f"a threshold is a share of the attention, in (0, 1]: {spec!r}")
        methods.append((f"{selector}@{value:g}", selector, value))
    return methods


@dataclass
class SparseMask:
    """The sparse choice as HF's attention sees it: a forward pre-hook on every attention
    layer that, while ``threshold`` is set, chooses the document's blocks at the question's
    step (``chosen`` is empty then) and replaces the layer's attention mask with one that
    hides the rest of the document from every query head, on that step and every decode step
    after it. The document stands at ``document`` (positions) of the cache; ``summaries`` is
    its summary, a layer each."""

    document: range
    summaries: list[sparse.Summary]
    threshold: float | None = None
    selector: str = BOUND
    union: bool = True  # every KV head attends the blocks any of the layer's heads chose
    candidates: float = 0.7  # the bound's threshold for REFINE's candidates
    chosen: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> [Hkv, tokens]
    densities: dict[int, float] = field(default_factory=dict)
    reads: dict[int, float] = field(default_factory=dict)  # the share of the layer read

    def reset(self, threshold: float | None, selector: str = BOUND) -> None:
        self.threshold = threshold
        self.selector = selector
        self.chosen.clear()
        self.densities.clear()
        self.reads.clear()

    def hook(self, module: Any, args: Any, kwargs: dict[str, Any]) -> Any:
        if self.threshold is None:
            return None
        layer = module.layer_idx
        hidden = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
        n = hidden.shape[1]
        summary = self.summaries[layer]
        if layer not in self.chosen:
            queries = attention_queries(module, args, kwargs)  # where the entry was computed
            cached = kwargs["past_key_values"].layers[layer].keys[0]  # [Hkv, T, D]
            keys = cached[:, self.document.start : self.document.stop].transpose(0, 1)
            read = None
            if self.selector == ORACLE:
                shares = sparse.exact_shares(queries, keys, summary.block, module.scaling)
                blocks = sparse.choose(shares, keys.shape[1], self.threshold)
            elif self.selector == REFINE:
                bound = sparse.select(queries, summary, self.candidates, scale=module.scaling)
                candidates = bound.any(0)
                taken = sparse.token_mask(candidates[None], summary)[0].nonzero().flatten()
                blocks = sparse.refine(
                    queries,
                    keys.index_select(0, taken),
                    candidates.nonzero().flatten().tolist(),
                    summary,
                    self.threshold,
                    module.scaling,
                )
                kept = blocks.any(0, keepdim=True)
                # the candidates' keys, then the kept blocks' values (every head of each)
                read = (
                    sparse.density(candidates[None], summary) + sparse.density(kept, summary)
                ) / 2
            else:
                blocks = sparse.select(queries, summary, self.threshold, scale=module.scaling)
            if self.union:
                blocks = blocks.any(0, keepdim=True).expand_as(blocks)
            self.chosen[layer] = sparse.token_mask(blocks, summary)
            self.densities[layer] = sparse.density(blocks, summary)
            union = sparse.density(blocks.any(0, keepdim=True), summary)
            self.reads[layer] = union if read is None else read
        past = kwargs["past_key_values"].get_seq_length(layer)
        heads = module.config.num_attention_heads
        allowed = torch.ones(heads, n, past + n, dtype=torch.bool)
        group = heads // summary.lo.shape[1]
        seen = self.chosen[layer].repeat_interleave(group, dim=0)  # [Hq, tokens]
        allowed[:, :, self.document.start : self.document.stop] = seen[:, None, :]
        allowed[:, :, past:] = torch.ones(n, n, dtype=torch.bool).tril()
        additive = torch.zeros(allowed.shape).masked_fill_(~allowed, float("-inf"))
        kwargs["attention_mask"] = additive[None].to(hidden.dtype)
        return args, kwargs


class LongReference:
    """A document's KV computed once by the HF reference, then questions on top of it, each
    with the document attended whole or sparse (``SparseMask``)."""

    def __init__(
        self,
        reference: HFReference,
        eos: Sequence[int],
        union: bool = True,
        candidates: float = 0.7,
    ) -> None:
        self.union = union
        self.candidates = candidates
        self.model = cast(Any, reference.model)
        self.config = reference.config
        self.eos = set(eos)
        self.mask: SparseMask | None = None
        self.cache: Any = None
        self.prefix = 0
        layers: Any = self.model.model.layers
        self._hooks = [
            layer.self_attn.register_forward_pre_hook(self._hook, with_kwargs=True)
            for layer in layers
        ]

    def close(self) -> None:
        for hook in self._hooks:
            hook.remove()

    def _hook(self, module: Any, args: Any, kwargs: dict[str, Any]) -> Any:
        return None if self.mask is None else self.mask.hook(module, args, kwargs)

    @torch.no_grad()
    def store(self, sys_ids: list[int], doc_ids: list[int], block: int) -> None:
        """sys and the document, causally (the document alone after sys: its stored KV is
        the prefix's), in pieces; its per-layer summaries in blocks of ``block``."""
        from transformers import DynamicCache

        self.mask = None
        self.cache = DynamicCache(config=self.config)
        ids = [*sys_ids, *doc_ids]
        # Computed by torch's fused attention (eager's score matrices grow with the square
        # of the document); answered by eager, whose additive mask the choice replaces.
        self.model.set_attn_implementation("sdpa")
        try:
            self._prefill(ids)
        finally:
            self.model.set_attn_implementation("eager")
        self.prefix = len(ids)
        document = range(len(sys_ids), len(ids))
        summaries = [
            sparse.summarize(
                layer.keys[0, :, document.start : document.stop].transpose(0, 1), block
            )
            for layer in self.cache.layers
        ]
        self.mask = SparseMask(document, summaries, union=self.union, candidates=self.candidates)

    def _prefill(self, ids: list[int]) -> None:
        for start in range(0, len(ids), PREFILL_PIECE):
            piece = ids[start : start + PREFILL_PIECE]
            self.model(
                input_ids=torch.tensor([piece]),
                position_ids=torch.arange(start, start + len(piece))[None],
                past_key_values=self.cache,
                use_cache=True,
            )

    @torch.no_grad()
    def answer(
        self,
        question_ids: list[int],
        threshold: float | None,
        max_tokens: int,
        selector: str = BOUND,
    ) -> Answer:
        """Greedy tokens of the answer on top of the stored document, attended whole for
        ``threshold`` None, else sparse, the blocks chosen by ``selector``."""
        assert self.mask is not None, "store a document first"
        extra = self.cache.get_seq_length() - self.prefix
        if extra:
            self.cache.crop(-extra)
        self.mask.reset(threshold, selector)
        ids, start, tokens = question_ids, self.prefix, list[int]()
        first = torch.empty(0)
        for _ in range(max_tokens):
            logits = self.model(
                input_ids=torch.tensor([ids]),
                position_ids=torch.arange(start, start + len(ids))[None],
                past_key_values=self.cache,
                use_cache=True,
            ).logits[0, -1]
            first = logits if not tokens else first
            token = int(logits.argmax())
            if token in self.eos:
                break
            tokens.append(token)
            start += len(ids)
            ids = [token]
        densities, reads = self.mask.densities, self.mask.reads
        density = sum(densities.values()) / len(densities) if densities else 1.0
        read = sum(reads.values()) / len(reads) if reads else 1.0
        return Answer(tokens, density, first, read)


@dataclass(frozen=True)
class Answer:
    tokens: list[int]
    density: float  # the share of the document's (layer, KV head, token) KV attended
    first_logits: torch.Tensor  # the question's last row's
    read: float = 1.0  # the share of the entry's bytes a sparse load reads (summary aside)
