"""Recomputing selected chunk tokens in the isolation hook (worker process): the connector's
``recompute_chunks`` and ``recompute_tokens``, EPIC's choice of tokens (each chunk's first
ones, where isolation leaves attention sinks the question over-weights) with CacheBlend's
way of blending them (their KV recomputed layer by layer, seeing everything before them;
every other chunk token keeps its isolated KV).

vLLM computes only a suffix of a request, and the chunks are the prefix the store loads,
so the selected tokens cannot be scheduled. The hook runs them itself in the step that
computes the first causal row after the chunks: they ride in vLLM's batch, rows after its
own (``Recomputer.ride``: vLLM's embedding, norms, projections, rotary and MLP take them,
one pass over the weights), or, where vLLM compiles the model, take each layer's modules
in a pass of their own (``Recomputer.layer``). At each layer, after the chunk rows and
before the causal rows, the hook computes their attention against the request's cache
(sys, the chunks, the recomputed tokens in place of their isolated copies, causally) and
writes their new KV over the isolated one. The causal rows, this step's and every later
one (decode), then read the blend from vLLM's cache with vLLM's kernel, and the same
happens whether the chunks were loaded or computed in the request.

The same machinery recomputes whole chunks (``recompute_chunks``, chosen by ``selection``),
wherever they stand among the chunks: each selected token sees the cache before it, the
other selected tokens before it recomputed. Where chunks are attended elsewhere
(``relevant_last``) "before" is in the attended order: the tokens take their attended
positions (``Blend.attended``) and the hook runs their attention over the request's KV
copied in that order (``step_split.Reordered``).

The isolated KV it overwrites is kept for the step's saves (the store holds chunks as
computed in isolation). Llama and Qwen2 models are served; anything else is refused at
load, with the reason (chunks then stay isolated).
"""

from __future__ import annotations

import gc
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from ..cpu_layout import CpuKVLayout


@dataclass
class Blend:
    """One request's selected tokens in one step: their hidden states between layers and,
    per layer, the isolated KV their recomputed KV replaced in the cache."""

    req_id: str
    block_table: torch.Tensor  # the request's row of vLLM's block table
    positions: torch.Tensor  # int64, ascending: where the tokens stand in the cache
    token_ids: torch.Tensor
    slots: torch.Tensor  # the positions' cache slots
    # Where the tokens are attended (their rotary positions): their positions, plus the shift
    # of the chunk each is in where chunks are attended elsewhere (``relevant_last``).
    attended: torch.Tensor
    hidden: torch.Tensor | None = None  # input of the next layer
    next_layer: int = 0
    isolated: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)


@dataclass(frozen=True)
class IsolatedCopy:
    """The isolated KV of a request's recomputed tokens, [layers, tokens, heads, head_dim],
    for saving the chunks they belong to as the store holds them."""

    positions: torch.Tensor
    keys: torch.Tensor
    values: torch.Tensor

    def restore(self, start: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Put the isolated KV back into a segment's KV read from the cache (positions
        [start, start + tokens), [layers, tokens, ...]), in place."""
        if self.keys.shape[0] != keys.shape[0]:
            raise ValueError(f"the blend ran {self.keys.shape[0]} of {keys.shape[0]} layers")
        inside = (self.positions >= start) & (self.positions < start + keys.shape[1])
        if bool(inside.any()):
            rows = self.positions[inside] - start
            keys[:, rows] = self.keys[:, inside].to(keys.dtype)
            values[:, rows] = self.values[:, inside].to(values.dtype)


def _decoder_classes() -> dict[type, type]:
    """Decoder layer class -> its attention class, for the architectures the recomputer
    drives: pre-norm residual blocks with a fused QKV projection, rotary, a gated MLP
    (Llama; Qwen2, whose projections carry a bias and which may normalize q and k)."""
    classes: dict[type, type] = {}
    try:
        from vllm.model_executor.models.llama import LlamaAttention, LlamaDecoderLayer

        classes[LlamaDecoderLayer] = LlamaAttention
    except ImportError:
        pass
    try:
        from vllm.model_executor.models.qwen2 import Qwen2Attention, Qwen2DecoderLayer

        classes[Qwen2DecoderLayer] = Qwen2Attention
    except ImportError:
        pass
    return classes


def _find_decoder(first_attention: Any) -> Any | None:
    """The model whose first decoder layer's attention is ``first_attention``: vLLM gives a
    connector its attention layers, not the model, so it is found among live objects once,
    at load, by identity."""
    for obj in gc.get_objects():
        # type(), not isinstance(): isinstance asks a lazy proxy's ``__class__``, which
        # imports what it stands for (openai's client modules: ~0.2 s of start-up).
        if issubclass(type(obj), torch.nn.Module) and hasattr(obj, "embed_tokens"):
            layers = getattr(obj, "layers", None)
            if isinstance(layers, torch.nn.ModuleList) and len(layers):
                attn = getattr(getattr(layers[0], "self_attn", None), "attn", None)
                if attn is first_attention:
                    return obj
    return None


# The rows of a pass are padded to a power of two up to this, to a multiple of it past it.
# vLLM's CPU projections (oneDNN) build a primitive for each row count they have not met among
# their last 32: 0.6-1 ms a projection, a SmolLM2 layer at 20-60 rows 4.4 ms against 1.6
# once built, and the count of tokens a step recomputes is new nearly every time; a few
# padded counts stay among those met lately.
PASS_ROWS = 64


def _rows(count: int) -> int:
    if count <= PASS_ROWS:
        return 1 << max(3, (count - 1).bit_length())
    return -(-count // PASS_ROWS) * PASS_ROWS


def _padded(rows: torch.Tensor, count: int) -> torch.Tensor:
    """``rows`` with zero rows after them, ``count`` in all (a zero row stays zero through
    the norms and adds nothing to another row: each row of a projection is its own)."""
    if rows.shape[0] == count:
        return rows
    return torch.cat([rows, rows.new_zeros((count - rows.shape[0], *rows.shape[1:]))])


class Recomputer:
    """vLLM's decoder modules, driven over a request's selected tokens one layer at a time."""

    def __init__(self, decoder: Any, layout: CpuKVLayout, layer_names: list[str]) -> None:
        self.decoder = decoder
        self.layout = layout
        self.layer_names = layer_names

    @classmethod
    def find(
        cls, vllm_config: Any, layout: CpuKVLayout, layer_names: list[str]
    ) -> Recomputer | str:
        """The recomputer of this worker's model, or why there is none."""
        from vllm.distributed import get_tensor_model_parallel_world_size

        if get_tensor_model_parallel_world_size() > 1:
            return "tensor parallelism is not supported"
        classes = _decoder_classes()
        if not classes:
            return "vLLM's Llama and Qwen2 modules are not importable"
        context = vllm_config.compilation_config.static_forward_context
        decoder = _find_decoder(context[layer_names[0]])
        if decoder is None:
            return "the model's decoder (embed_tokens, layers) was not found"
        layers: list[Any] = list(decoder.layers)
        if len(layers) != len(layer_names):
            return f"{len(layers)} decoder layers for {len(layer_names)} attention layers"
        for index, (layer, name) in enumerate(zip(layers, layer_names, strict=True)):
            attn: Any = getattr(layer, "self_attn", None)
            if classes.get(type(layer)) is not type(attn):
                return f"{type(layer).__name__} is not a Llama or Qwen2 decoder layer"
            if getattr(attn, "dual_chunk_attention_config", None):
                return "dual chunk attention is not supported"
            if getattr(attn, "attn", None) is not context[name]:
                return f"{name} is not the attention of decoder layer {index}"
        return cls(decoder, layout, layer_names)

    def start(
        self,
        req_id: str,
        block_table: torch.Tensor,
        tokens: tuple[tuple[int, int], ...],
        attended: torch.Tensor | None = None,
    ) -> Blend:
        """A blend of ``tokens`` ((position, token id) each); ``attended``: every cache
        position's attended position, where chunks are attended elsewhere."""
        positions = torch.tensor([p for p, _ in tokens], dtype=torch.int64)
        ids = torch.tensor([t for _, t in tokens], dtype=torch.int64)
        slots = self.layout.slots(block_table.long(), 0, int(positions[-1]) + 1)[positions]
        at = positions if attended is None else attended[positions]
        return Blend(req_id, block_table, positions, ids, slots.contiguous(), at)

    @torch.inference_mode()
    def layer(
        self,
        blends: list[Blend],
        index: int,
        kv_cache: torch.Tensor,
        attend: Callable[[Blend, torch.Tensor], torch.Tensor],
        between: Callable[[Blend], None] | None = None,
    ) -> None:
        """Take every blend's selected tokens through decoder layer ``index`` in a pass of
        their own (where they do not ride in vLLM's batch), their projections and MLP in one
        pass, their attention as in ``attend``."""
        layer = self.decoder.layers[index]
        attn = layer.self_attn
        hidden = torch.cat(
            [
                b.hidden if b.hidden is not None else self.decoder.embed_tokens(b.token_ids)
                for b in blends
            ]
        )
        count = hidden.shape[0]
        hidden = _padded(hidden, _rows(count))
        qkv, _ = attn.qkv_proj(layer.input_layernorm(hidden))
        q, k, v = qkv[:count].split([attn.q_size, attn.kv_size, attn.kv_size], dim=-1)
        if getattr(attn, "qk_norm", False):  # per head, before rotary (Qwen2 with qk_norm)
            q = attn.q_norm(q.reshape(count, attn.num_heads, attn.head_dim)).reshape(count, -1)
            k = attn.k_norm(k.reshape(count, attn.num_kv_heads, attn.head_dim)).reshape(count, -1)
        q, k = attn.rotary_emb(torch.cat([b.attended for b in blends]), q, k)
        q = q.reshape(count, attn.num_heads, attn.head_dim)
        k = k.reshape(count, attn.num_kv_heads, attn.head_dim)
        v = v.reshape(count, attn.num_kv_heads, attn.head_dim)
        out = self.attend(blends, index, kv_cache, (q, k, v), attend, between)
        if index + 1 == len(self.layer_names):
            for blend in blends:
                blend.hidden = None  # the last layer's MLP feeds no KV
            return
        out, _ = attn.o_proj(_padded(out.reshape(count, -1).to(hidden.dtype), hidden.shape[0]))
        normed, residual = layer.post_attention_layernorm(out, hidden)
        hidden = (layer.mlp(normed) + residual)[:count]
        at = 0
        for blend in blends:
            blend.hidden = hidden[at : at + blend.positions.shape[0]]
            at += blend.positions.shape[0]

    def attend(
        self,
        blends: list[Blend],
        index: int,
        kv_cache: torch.Tensor,
        qkv: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
        attend: Callable[[Blend, torch.Tensor], torch.Tensor],
        between: Callable[[Blend], None] | None = None,
    ) -> torch.Tensor:
        """The blends' attention at layer ``index``, their queries, keys and values ``qkv``
        ([tokens, heads, head_dim], rotated to where they are attended, the blends' tokens in
        order): per blend in order, write its KV over the isolated one, then ``attend`` its
        queries (each sees the cache up to where it is attended); ``between(blend)`` runs
        before a blend's write (what must happen to the cache between two blends'
        attention). Returns the outputs, [tokens, heads, head_dim]."""
        q, k, v = qkv
        outs, at = [], 0
        for blend in blends:
            if blend.next_layer != index:
                raise RuntimeError(f"recompute: layer {index} ran before {blend.next_layer}")
            rows = slice(at, at + blend.positions.shape[0])
            at = rows.stop
            if between is not None:
                between(blend)
            blend.isolated.append(self.layout.read(kv_cache, blend.slots))
            self.layout.write(self.layer_names[index], kv_cache, k[rows], v[rows], blend.slots)
            outs.append(attend(blend, q[rows].contiguous()))
            blend.next_layer = index + 1
        return torch.cat(outs)

    def ride(self, vllm_config: Any, riders: Callable[[], list[Blend]]) -> str | None:
        """Run the blends' tokens inside vLLM's own forward from now on, or say why not:
        the decoder's forward takes each step's ``riders()`` (what the step recomputes) as
        rows after vLLM's, at the positions where they are attended, so vLLM's embedding,
        norms, projections, rotary and MLP take them with its own rows, one pass over the
        weights instead of two; the attention hook computes their attention (``attend``
        with the tail of the layer's queries, keys and values), and the decoder returns
        vLLM's rows alone. The decoder's forward is Python only when vLLM does not compile
        the model (``--enforce-eager``); otherwise the blends keep a pass of their own."""
        from vllm.config import CompilationMode
        from vllm.distributed import get_pp_group

        if vllm_config.compilation_config.mode != CompilationMode.NONE:
            return "vLLM compiles the model (run it with --enforce-eager)"
        if get_pp_group().world_size > 1:
            return "pipeline parallelism"
        original = self.decoder.forward
        embed = self.decoder.embed_tokens

        def forward(
            input_ids: torch.Tensor | None,
            positions: torch.Tensor,
            intermediate_tensors: Any = None,
            inputs_embeds: torch.Tensor | None = None,
            **kwargs: Any,
        ) -> Any:
            blends = riders() if positions.dim() == 1 else []
            if not blends:
                return original(input_ids, positions, intermediate_tensors, inputs_embeds, **kwargs)
            rows = positions.shape[0]
            ids = torch.cat([b.token_ids for b in blends])
            if inputs_embeds is not None:
                inputs_embeds = torch.cat([inputs_embeds, embed(ids).to(inputs_embeds.dtype)])
            else:
                assert input_ids is not None
                input_ids = torch.cat([input_ids, ids.to(input_ids.dtype)])
            positions = torch.cat([positions, torch.cat([b.attended for b in blends])])
            out = original(input_ids, positions, intermediate_tensors, inputs_embeds, **kwargs)
            if isinstance(out, tuple):  # with auxiliary hidden states (speculative decoding)
                return out[0][:rows], [aux[:rows] for aux in out[1]]
            return out[:rows]

        self.decoder.forward = forward
        return None

    def isolated_copy(self, blend: Blend) -> IsolatedCopy | None:
        """What the blend overwrote, once it ran at least one layer."""
        if not blend.isolated:
            return None
        keys = torch.stack([k for k, _ in blend.isolated])
        values = torch.stack([v for _, v in blend.isolated])
        return IsolatedCopy(blend.positions, keys, values)
