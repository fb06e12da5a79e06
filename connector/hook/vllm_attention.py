"""vLLM's attention layers as the isolation hook serves them (worker process): the only code
that touches vLLM's attention objects (a layer's ``impl`` and the layer itself), for the
hook in ``isolation`` (docs/isolation-hook.md).

It says whether the hook can serve a layer (``unsupported``: vLLM's CPU back end, decoder
self-attention, none of the features the hook does not compute), wraps each layer's
``forward`` and cache write (``AttentionLayers.wrap``), and hands the hook's phases one
``LayerCall`` per layer call: which layer, its softmax scale, and vLLM's CPU kernel with the
layer's settings (``LayerCall.paged`` over a ``KernelBatch``). What the hook reads of a
step's attention metadata is ``StepMetadata``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, cast

import torch

if TYPE_CHECKING:  # vLLM's types at the boundary, for the type checker only
    from vllm.config import VllmConfig


class StepMetadata(Protocol):
    """What the hook reads of vLLM's CPU attention metadata for a step (every layer of the
    step shares the object)."""

    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    slot_mapping: torch.Tensor


class KernelSettings(Protocol):
    """The settings of vLLM's ``CPUAttentionBackendImpl`` its kernel takes."""

    scale: float
    num_heads: int
    num_kv_heads: int
    head_size: int
    kv_cache_dtype: str
    sliding_window: int | None  # tokens a query sees back, itself included (-1, None: all)


class CpuAttentionImpl(KernelSettings, Protocol):
    """The parts of vLLM's ``CPUAttentionBackendImpl`` the hook reads or wraps."""

    forward: Callable[..., torch.Tensor]
    do_kv_cache_update: Callable[..., None]


class AttentionLayer(Protocol):
    """The parts of vLLM's ``Attention`` layer the hook reads (``isa``: set by the CPU back
    end's metadata builder)."""

    isa: str
    _k_scale_float: float
    _v_scale_float: float


class ServedLayer(AttentionLayer, Protocol):
    impl: CpuAttentionImpl


@dataclass
class KernelBatch:
    """The rows vLLM's kernel computes, as a batch of their own: each run of rows is one
    sub-request seeing its request's positions [0, seq_len)."""

    rows: torch.Tensor  # int64 row indices into the step's batch
    query_start_loc: torch.Tensor  # int32 [runs + 1]
    seq_lens: torch.Tensor  # int32 [runs]
    block_table: torch.Tensor
    scheduler_metadata: torch.Tensor


@dataclass(frozen=True)
class LayerCall:
    """One call of an attention layer, as the hook's phases see it: the layer (``index``
    among the model's, ``name``) and vLLM's CPU kernel with its settings. The settings are
    read from vLLM's objects when used, as vLLM's own forward reads them."""

    index: int
    name: str
    impl: KernelSettings
    layer: AttentionLayer
    dtype: torch.dtype  # the model's (the kernel's scheduler plans for it)

    @property
    def scale(self) -> float:
        """The layer's softmax scale."""
        return self.impl.scale

    @property
    def window(self) -> int:
        """The layer's sliding window, -1 for none: a query at position i sees keys at
        positions (i - window, i] of the sub-request it is computed in (vLLM's kernel and
        HF's sliding masks agree on the bound)."""
        window = self.impl.sliding_window
        return -1 if window is None else int(window)

    def scheduler_metadata(
        self, query_start_loc: torch.Tensor, seq_lens: torch.Tensor
    ) -> torch.Tensor:
        """vLLM's plan for its kernel over a batch of these query starts and lengths."""
        from vllm import _custom_ops as ops
        from vllm import envs

        return ops.cpu_attn_get_scheduler_metadata(
            num_reqs=len(seq_lens),
            num_heads=self.impl.num_heads,
            num_kv_heads=self.impl.num_kv_heads,
            head_dim=self.impl.head_size,
            seq_lens=seq_lens,
            dtype=self.dtype,
            query_start_loc=query_start_loc,
            causal=True,
            # One plan for every layer of a step, as vLLM's own builder makes it where a
            # group mixes windowed and global layers (Gemma 3): the window goes with each call.
            sliding_window_size=-1,
            isa=self.layer.isa,
            enable_kv_split=envs.VLLM_CPU_ATTN_SPLIT_KV,
            kv_cache_dtype=self.impl.kv_cache_dtype,
        )

    def batch(
        self,
        rows: torch.Tensor,
        query_start_loc: torch.Tensor,
        seq_lens: torch.Tensor,
        block_table: torch.Tensor,
    ) -> KernelBatch:
        """``rows`` as a batch for vLLM's kernel, with its plan."""
        metadata = self.scheduler_metadata(query_start_loc, seq_lens)
        return KernelBatch(rows, query_start_loc, seq_lens, block_table, metadata)

    def paged(
        self, batch: KernelBatch, sub_query: torch.Tensor, kv_cache: torch.Tensor
    ) -> torch.Tensor:
        """vLLM's kernel over ``batch``: each run of queries attends causally to its
        request's cache up to its ``seq_len``, in a windowed layer to the last ``window``
        positions of it."""
        from vllm import _custom_ops as ops

        blocks, heads, block_size, _ = kv_cache.shape
        key_cache, value_cache = kv_cache.view(blocks, heads, 2 * block_size, -1).chunk(2, dim=2)
        sub_output = torch.empty_like(sub_query)
        ops.cpu_attention_with_kv_cache(
            query=sub_query,
            key_cache=key_cache,
            value_cache=value_cache,
            output=sub_output,
            query_start_loc=batch.query_start_loc,
            seq_lens=batch.seq_lens,
            scale=self.impl.scale,
            causal=True,
            alibi_slopes=None,
            sliding_window=self.window,
            block_table=batch.block_table,
            softcap=0,
            scheduler_metadata=batch.scheduler_metadata,
            s_aux=None,
            k_scale=self.layer._k_scale_float,
            v_scale=self.layer._v_scale_float,
            kv_cache_dtype=self.impl.kv_cache_dtype,
        )
        return sub_output


def unsupported(impl: object, layer: object) -> str | None:
    """Why the hook cannot serve this attention layer, or None."""
    try:
        from vllm.v1.attention.backend import AttentionType
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackendImpl
    except ImportError:
        return "vLLM's CPU attention back end is not available"
    if type(impl) is not CPUAttentionBackendImpl:
        return f"attention back end {type(impl).__name__} is not one the hook knows"
    if impl.attn_type != AttentionType.DECODER:
        return f"attention type {impl.attn_type} is not decoder self-attention"
    features = {  # a sliding window is served: ``LayerCall.window``
        "ALiBi": impl.alibi_slopes is not None,
        "logit soft-capping": bool(impl.logits_soft_cap),
        "attention sinks": impl.sinks is not None,
        f"KV cache dtype {impl.kv_cache_dtype}": impl.kv_cache_dtype != "auto",
    }
    found = [name for name, present in features.items() if present]
    return f"{', '.join(found)} not supported" if found else None


QKV = tuple[torch.Tensor, torch.Tensor, torch.Tensor]
# The hook's attention of a layer call: True where it computed ``output``, False where
# vLLM's own forward is to compute it.
Serve = Callable[[LayerCall, "StepMetadata | None", QKV, torch.Tensor, torch.Tensor], bool]


class AttentionLayers:
    """The model's attention layers (``names``, in order), as vLLM built them."""

    def __init__(self, vllm_config: VllmConfig, names: list[str]) -> None:
        context = vllm_config.compilation_config.static_forward_context
        self.names = list(names)
        self._layers: list[ServedLayer] = [context[name] for name in names]
        # A torch dtype once vLLM's ModelConfig has resolved it (a name only before)
        self._dtype = cast(torch.dtype, vllm_config.model_config.dtype)

    def refused(self) -> str | None:
        """Why the hook cannot serve one of the layers (the first such), or None."""
        for name, layer in zip(self.names, self._layers, strict=True):
            why = unsupported(layer.impl, layer)
            if why:
                return f"{name}: {why}"
        return None

    def windowed(self) -> bool:
        """Whether a layer attends through a sliding window."""
        return any(self.call(index).window > 0 for index in range(len(self.names)))

    def call(self, index: int) -> LayerCall:
        """A call of layer ``index`` (outside its forward: the recomputed rows' split)."""
        layer = self._layers[index]
        return LayerCall(index, self.names[index], layer.impl, layer, self._dtype)

    def wrap(self, serve: Serve, riding: Callable[[], int]) -> None:
        """Wrap every layer's forward (``serve`` computes it, or vLLM's does) and cache
        write (without the last ``riding()`` rows of the batch: the hook writes those, in
        their order among the step's attention)."""
        for index, layer in enumerate(self._layers):
            impl = layer.impl
            impl.forward = self._forward(impl.forward, impl, index, serve)
            impl.do_kv_cache_update = _trimmed(impl.do_kv_cache_update, riding)

    def _forward(
        self,
        original: Callable[..., torch.Tensor],
        impl: CpuAttentionImpl,
        index: int,
        serve: Serve,
    ) -> Callable[..., torch.Tensor]:
        name, dtype = self.names[index], self._dtype

        def forward(
            layer: AttentionLayer,
            query: torch.Tensor,
            key: torch.Tensor,
            value: torch.Tensor,
            kv_cache: torch.Tensor,
            attn_metadata: StepMetadata | None,
            output: torch.Tensor,
            *args: object,
            **kwargs: object,
        ) -> torch.Tensor:
            call = LayerCall(index, name, impl, layer, dtype)
            if serve(call, attn_metadata, (query, key, value), kv_cache, output):
                return output
            return original(
                layer, query, key, value, kv_cache, attn_metadata, output, *args, **kwargs
            )

        return forward


def _trimmed(original: Callable[..., None], riding: Callable[[], int]) -> Callable[..., None]:
    """vLLM's cache write of a layer's keys and values, without the rows riding in the
    batch (the hook writes those, in their order among the step's attention)."""

    def update(layer: object, key: torch.Tensor, value: torch.Tensor, *args: object) -> None:
        rows = riding()
        if rows:
            key, value = key[:-rows], value[:-rows]
        original(layer, key, value, *args)

    return update


def step_metadata(layer_name: str) -> StepMetadata | None:
    """The attention metadata of the step vLLM's forward is about to run, for a layer
    (None outside a forward context or without per-layer metadata)."""
    from vllm.forward_context import get_forward_context, is_forward_context_available

    if not is_forward_context_available():
        return None
    metadata = get_forward_context().attn_metadata
    if not isinstance(metadata, dict):
        return None
    # vLLM's CPU back end's metadata (the layers are served only there: ``unsupported``)
    return cast("StepMetadata | None", metadata.get(layer_name))
