"""Each back end's cache layout (``chunkstore.kv.cache_layouts``) against that back end's own
indexing rules, restated here as facts from its source (file cited at each), on CPU tensors
laid out the way the back end lays them out. No GPU or NPU ran these."""

from __future__ import annotations

import math

import pytest
import torch

from chunkstore.errors import LayoutError
from chunkstore.kv.cache_layouts import (
    CacheLayout,
    LatentLayout,
    PackedLayout,
    SplitLayout,
    StackedLayout,
)
from chunkstore.kv.paging import PAD_SLOT
from chunkstore.kv.remap import remap_keys
from chunkstore.kv.rope import RotaryConfig, rotation_table
from chunkstore.kv.writer import write_chunk

BLOCKS, BLOCK_SIZE, HEADS, DIM = 6, 4, 2, 8
SLOTS = torch.tensor([5, 0, 17, 9, 23, 12])  # across blocks, out of order


def chunk(tokens: int = len(SLOTS), dim: int = DIM, seed: int = 0) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(tokens, HEADS, dim, generator=g), torch.randn(
        tokens, HEADS, dim, generator=g
    )


def contiguous_strides(shape: tuple[int, ...]) -> list[int]:
    return [math.prod(shape[i + 1 :]) for i in range(len(shape))]


def vllm_cache(order: tuple[int, ...], layers: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM >= 0.32's allocation, restated: all layers in one flat buffer, each layer a view of
    logical shape [B, H, N, C] (C = K dims + V dims) whose physical order is the
    ``KVCacheLayout``, a permutation of the logical [L, B, H, N, C] (vllm/v1/kv_cache_layout.py:
    LBHNC = (0, 1, 2, 3, 4), LBNHC = (0, 1, 3, 2, 4); vllm/v1/kv_cache_interface.py
    ``create_kv_cache_views`` builds them with as_strided). Returns the physical array
    [in physical order] and layer 1's view."""
    logical = (layers, BLOCKS, HEADS, BLOCK_SIZE, 2 * DIM)
    physical_shape = tuple(logical[i] for i in order)
    flat = torch.zeros(math.prod(logical))
    strides = [0] * 5
    for position, axis in enumerate(order):
        strides[axis] = contiguous_strides(physical_shape)[position]
    view = flat.as_strided(logical, strides)
    return flat.view(physical_shape), view[1]


@pytest.mark.parametrize(
    "name, order", [("LBNHC (the default)", (0, 1, 3, 2, 4)), ("LBHNC", (0, 1, 2, 3, 4))]
)
def test_packed_layout_lands_where_vllm_reads(name: str, order: tuple[int, ...]) -> None:
    physical, cache = vllm_cache(order)
    keys, values = chunk()
    PackedLayout(DIM).write(cache, keys, values, SLOTS)
    for t, slot in enumerate(SLOTS.tolist()):
        b, o = divmod(slot, BLOCK_SIZE)
        for h in range(HEADS):
            logical = (1, b, h, o)  # layer 1, block, head, offset; then the content axis
            at = tuple((*logical, slice(None))[axis] for axis in order)
            row = physical[at]
            assert torch.equal(row[:DIM], keys[t, h]) and torch.equal(row[DIM:], values[t, h])
    assert int((physical != 0).sum()) == 2 * keys.numel()  # nothing else, no other layer
    # vLLM's own split of the same cache (flash_attn.py do_kv_cache_update):
    key_cache, value_cache = cache.transpose(1, 2).split(DIM, dim=-1)  # [B, N, H, D] each
    b, o = SLOTS // BLOCK_SIZE, SLOTS % BLOCK_SIZE
    assert torch.equal(key_cache[b, o], keys) and torch.equal(value_cache[b, o], values)


def test_packed_layout_takes_a_value_width_of_its_own() -> None:
    cache = torch.zeros(BLOCKS, HEADS, BLOCK_SIZE, DIM + 4)  # head_size_v = 4
    keys, _ = chunk()
    values = torch.randn(len(SLOTS), HEADS, 4)
    PackedLayout(DIM).write(cache, keys, values, SLOTS)
    got_k, got_v = PackedLayout(DIM).read(cache, SLOTS)
    assert torch.equal(got_k, keys) and torch.equal(got_v, values)  # type: ignore[arg-type]


@pytest.mark.parametrize("axis", [0, 1])
@pytest.mark.parametrize("hnd", [False, True])
def test_stacked_layouts_land_where_the_old_kernels_wrote(axis: int, hnd: bool) -> None:
    """vLLM <= 0.11: FlashAttention (2, B, N, H, D) (axis 0), FlashInfer (B, 2, N, H, D)
    (axis 1); ``get_kv_cache_stride_order`` HND = heads before block_size in memory. The
    allocation is the physical shape permuted back to the logical one (v1/worker/
    gpu_model_runner.py ``_reshape_kv_cache_tensors``); reshape_and_cache_flash writes
    ``key_cache[slot // N, slot % N, head] = key[token, head]`` (csrc/cache_kernels.cu)."""
    logical = (
        (2, BLOCKS, BLOCK_SIZE, HEADS, DIM) if axis == 0 else (BLOCKS, 2, BLOCK_SIZE, HEADS, DIM)
    )
    order = (0, 1, 3, 2, 4) if hnd else (0, 1, 2, 3, 4)
    physical = torch.zeros(tuple(logical[i] for i in order))
    cache = physical.permute(*[order.index(i) for i in range(5)])
    assert cache.shape == logical
    keys, values = chunk(seed=1)
    StackedLayout(axis).write(cache, keys, values, SLOTS)
    for t, slot in enumerate(SLOTS.tolist()):
        b, o = divmod(slot, BLOCK_SIZE)
        for h in range(HEADS):
            for kv, expected in ((0, keys), (1, values)):
                index = (kv, b, o, h) if axis == 0 else (b, kv, o, h)
                at = tuple(index[i] for i in order[:4])
                assert torch.equal(physical[at], expected[t, h])
    got_k, got_v = StackedLayout(axis).read(cache, SLOTS)
    assert torch.equal(got_k, keys) and torch.equal(got_v, values)  # type: ignore[arg-type]


def test_split_layout_lands_where_npu_reshape_and_cache_writes() -> None:
    """vllm-ascend: per layer (key_cache, value_cache), each [B, N, H, D] in ND format;
    torch_npu._npu_reshape_and_cache writes key_cache[slot // N][slot % N] = key[token]
    (vllm_ascend/attention/attention_v1.py, worker/model_runner_v1.py)."""
    key_cache = torch.zeros(BLOCKS, BLOCK_SIZE, HEADS, DIM)
    value_cache = torch.zeros(BLOCKS, BLOCK_SIZE, HEADS, DIM)
    keys, values = chunk(seed=2)
    SplitLayout().write((key_cache, value_cache), keys, values, SLOTS)
    for t, slot in enumerate(SLOTS.tolist()):
        assert torch.equal(key_cache[slot // BLOCK_SIZE][slot % BLOCK_SIZE], keys[t])
        assert torch.equal(value_cache[slot // BLOCK_SIZE][slot % BLOCK_SIZE], values[t])
    assert int((key_cache != 0).sum()) == keys.numel()


def test_latent_layout_lands_where_concat_and_cache_mla_writes() -> None:
    """vLLM MLA: [B, N, kv_lora_rank + rope_dim]; concat_and_cache_mla writes the latent to
    [:kv_lora_rank] and k_pe to [kv_lora_rank:] at (slot // N, slot % N) (vllm/
    model_executor/layers/attention/mla_attention.py, csrc/cache_kernels.cu)."""
    lora, rope = 12, 4
    cache = torch.zeros(BLOCKS, BLOCK_SIZE, lora + rope)
    latent = torch.randn(len(SLOTS), 1, lora + rope)
    LatentLayout().write(cache, latent, None, SLOTS)
    for t, slot in enumerate(SLOTS.tolist()):
        b, o = divmod(slot, BLOCK_SIZE)
        assert torch.equal(cache[b, o, :lora], latent[t, 0, :lora])
        assert torch.equal(cache[b, o, lora:], latent[t, 0, lora:])
    got, none = LatentLayout().read(cache, SLOTS)
    assert torch.equal(got, latent) and none is None


def caches(dtype: torch.dtype = torch.float32) -> list[tuple[CacheLayout, object]]:
    def zeros(*shape: int) -> torch.Tensor:
        return torch.zeros(*shape, dtype=dtype)

    return [
        (PackedLayout(DIM), zeros(BLOCKS, HEADS, BLOCK_SIZE, 2 * DIM)),
        (StackedLayout(0), zeros(2, BLOCKS, BLOCK_SIZE, HEADS, DIM)),
        (StackedLayout(1), zeros(BLOCKS, 2, BLOCK_SIZE, HEADS, DIM)),
        (
            SplitLayout(),
            (
                zeros(BLOCKS, BLOCK_SIZE, HEADS, DIM),
                zeros(BLOCKS, BLOCK_SIZE, HEADS, DIM),
            ),
        ),
    ]


@pytest.mark.parametrize("index", range(4))
def test_a_load_then_a_save_round_trips_and_skips_other_ranks_tokens(index: int) -> None:
    layout, cache = caches()[index]
    keys, values = chunk(seed=3)
    slots = SLOTS.clone()
    slots[2] = PAD_SLOT  # another context-parallel rank's token
    layout.write(cache, keys, values, slots)
    mine = slots != PAD_SLOT
    got_k, got_v = layout.read(cache, slots[mine])
    assert torch.equal(got_k, keys[mine]) and torch.equal(got_v, values[mine])  # type: ignore[arg-type]
    held = [cache] if isinstance(cache, torch.Tensor) else list(cache)  # type: ignore[call-overload]
    assert sum(int((c != 0).sum()) for c in held) == 2 * keys[mine].numel()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_keys_are_rotated_as_the_cpu_path_rotates_them(dtype: torch.dtype) -> None:
    """Against the CPU path's write (``write_chunk``: the fused numba kernel) of the same
    chunk into a [layers, blocks, block_size, heads, dim] cache."""
    rotary = RotaryConfig(head_dim=DIM, rotary_dim=DIM, theta=10000.0)
    keys, values = (t.to(dtype) for t in chunk(seed=4))
    delta = 37
    ref_k = torch.zeros(1, BLOCKS, BLOCK_SIZE, HEADS, DIM, dtype=dtype)
    ref_v = torch.zeros_like(ref_k)
    write_chunk(keys[None], values[None], ref_k, ref_v, SLOTS, delta, rotary)
    rotation = rotation_table(rotary, delta, len(SLOTS))
    b, o = SLOTS // BLOCK_SIZE, SLOTS % BLOCK_SIZE
    for layout, cache in caches(dtype):
        layout.write(cache, keys, values, SLOTS, rotation, rotary)
        got_k, got_v = layout.read(cache, SLOTS)
        assert (got_k.float() - ref_k[0, b, o].float()).abs().max() <= 1e-6, layout.name
        assert torch.equal(got_v.float(), ref_v[0, b, o].float())  # type: ignore[union-attr]


def test_mla_rotates_only_k_pe() -> None:
    lora, rope = 12, 4
    rotary = RotaryConfig(head_dim=lora + rope, rotary_dim=rope, theta=10000.0, rotary_offset=lora)
    cache = torch.zeros(BLOCKS, BLOCK_SIZE, lora + rope)
    latent = torch.randn(len(SLOTS), 1, lora + rope)
    LatentLayout().write(cache, latent, None, SLOTS, rotation_table(rotary, 9, len(SLOTS)), rotary)
    got, _ = LatentLayout().read(cache, SLOTS)
    assert torch.equal(got[..., :lora], latent[..., :lora])  # the latent is copied exactly
    assert (got - remap_keys(latent, 9, rotary)).abs().max() <= 1e-6
    assert not torch.allclose(got[..., lora:], latent[..., lora:])


def test_what_does_not_fit_is_refused() -> None:
    keys, values = chunk()
    with pytest.raises(LayoutError, match="do not fit"):
        PackedLayout(DIM).write(
            torch.zeros(BLOCKS, HEADS + 1, BLOCK_SIZE, 2 * DIM), keys, values, SLOTS
        )
    with pytest.raises(LayoutError, match="beyond"):
        SplitLayout().write(
            (torch.zeros(2, BLOCK_SIZE, HEADS, DIM), torch.zeros(2, BLOCK_SIZE, HEADS, DIM)),
            keys,
            values,
            SLOTS,
        )
    with pytest.raises(LayoutError, match="2 \\(K, V\\) on axis 1"):
        StackedLayout(1).views(torch.zeros(2, BLOCKS, BLOCK_SIZE, HEADS, DIM))
    with pytest.raises(LayoutError, match="hold values"):
        PackedLayout(DIM).write(torch.zeros(BLOCKS, HEADS, BLOCK_SIZE, 2 * DIM), keys, None, SLOTS)
    with pytest.raises(LayoutError, match="rotary config"):
        rotation = rotation_table(RotaryConfig(DIM, DIM, 10000.0), 3, len(SLOTS))
        LatentLayout().write(
            torch.zeros(BLOCKS, BLOCK_SIZE, DIM), keys[:, :1], None, SLOTS, rotation
        )
