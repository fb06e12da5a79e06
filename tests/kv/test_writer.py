"""Writing a stored chunk into a paged cache: every back end, every rotary layout."""

from __future__ import annotations

import functools

import pytest
import torch

from chunkstore.errors import LayoutError
from chunkstore.kv.paging import PAD_SLOT, slot_mapping
from chunkstore.kv.remap import remap_keys
from chunkstore.kv.rope import RotaryConfig
from chunkstore.kv.writer import write_chunk, write_torch
from chunkstore.kv.writer_cpu import write_cpu

WRITERS = {
    "cpu-fused": write_cpu,
    "torch-tiled": functools.partial(write_torch, tile_tokens=3),
    "torch": write_torch,
}
ROTARIES = {
    "neox": RotaryConfig(head_dim=16, rotary_dim=16, theta=10000.0),
    "gptj-partial": RotaryConfig(head_dim=16, rotary_dim=8, theta=10000.0, style="gptj"),
    "mla-k_pe": RotaryConfig(head_dim=24, rotary_dim=8, theta=10000.0, rotary_offset=16),
}


@pytest.mark.parametrize("writer", list(WRITERS))
@pytest.mark.parametrize("rotary", list(ROTARIES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotated_keys_and_values_land_in_their_slots(writer, rotary, dtype) -> None:
    cfg = ROTARIES[rotary]
    layers, tokens, heads, dim = 3, 11, 2, cfg.head_dim
    torch.manual_seed(0)
    keys = torch.randn(layers, tokens, heads, dim).to(dtype)
    values = torch.randn(layers, tokens, heads, dim).to(dtype)
    key_cache = torch.zeros(layers, 8, 4, heads, dim, dtype=dtype)
    value_cache = torch.zeros_like(key_cache)
    actual_start, virtual_start = 6, 2
    table = torch.tensor([[5, 1, 7, 3, 2]])
    positions = torch.arange(actual_start, actual_start + tokens)
    slots = slot_mapping(torch.zeros_like(positions), positions, table, 4)
    write_chunk(
        keys,
        values,
        key_cache,
        value_cache,
        slots,
        actual_start - virtual_start,
        cfg,
        writer=WRITERS[writer],
    )
    flat_k = key_cache.view(layers, -1, heads, dim)
    flat_v = value_cache.view(layers, -1, heads, dim)
    for layer in range(layers):
        expected = remap_keys(keys[layer], actual_start - virtual_start, cfg)
        torch.testing.assert_close(flat_k[layer, slots], expected, rtol=0, atol=1e-6)
        assert torch.equal(flat_v[layer, slots], values[layer])
    untouched = torch.ones(flat_k.shape[1], dtype=torch.bool)
    untouched[slots] = False
    assert not flat_k[:, untouched].any() and not flat_v[:, untouched].any()


@pytest.mark.parametrize("writer", list(WRITERS))
def test_zero_delta_or_no_rotary_is_a_plain_copy(writer) -> None:
    keys, values = torch.randn(2, 5, 1, 16), torch.randn(2, 5, 1, 16)
    slots = torch.tensor([9, 2, 3, 4, 0])
    for delta, rotary in ((0, ROTARIES["neox"]), (7, None)):
        key_cache, value_cache = torch.zeros(2, 3, 4, 1, 16), torch.zeros(2, 3, 4, 1, 16)
        write_chunk(
            keys, values, key_cache, value_cache, slots, delta, rotary, writer=WRITERS[writer]
        )
        assert torch.equal(key_cache.view(2, -1, 1, 16)[:, slots], keys)


@pytest.mark.parametrize("writer", list(WRITERS))
def test_tokens_another_cp_rank_owns_are_skipped(writer) -> None:
    rotary = RotaryConfig(head_dim=8, rotary_dim=8, theta=10000.0)
    keys, values = torch.randn(1, 6, 1, 8), torch.randn(1, 6, 1, 8)
    key_cache, value_cache = torch.zeros(1, 4, 2, 1, 8), torch.zeros(1, 4, 2, 1, 8)
    slots = torch.tensor([0, PAD_SLOT, 1, PAD_SLOT, 2, PAD_SLOT])
    write_chunk(keys, values, key_cache, value_cache, slots, 5, rotary, writer=WRITERS[writer])
    flat = value_cache.view(-1, 1, 8)
    assert torch.equal(flat[:3], values[0, ::2]) and not flat[3:].any()
    expected = remap_keys(keys[0], 5, rotary)[::2]
    torch.testing.assert_close(key_cache.view(-1, 1, 8)[:3], expected, rtol=0, atol=1e-6)


def test_fused_cpu_kernel_matches_torch_within_one_bf16_ulp() -> None:
    cfg = ROTARIES["neox"]
    torch.manual_seed(3)
    keys = torch.randn(2, 4096, 3, 16).bfloat16()
    values = torch.randn(2, 4096, 3, 16).bfloat16()
    slots = torch.randperm(5000)[:4096]
    caches = [torch.zeros(2, 1250, 4, 3, 16, dtype=torch.bfloat16) for _ in range(4)]
    write_chunk(keys, values, caches[0], caches[1], slots, 999, cfg, writer=write_cpu)
    write_chunk(keys, values, caches[2], caches[3], slots, 999, cfg, writer=write_torch)
    assert torch.equal(caches[1], caches[3])  # values are copied bit for bit
    fused, ops = caches[0].float(), caches[2].float()
    ulp = torch.finfo(torch.bfloat16).eps
    assert bool(((fused - ops).abs() <= ulp * ops.abs()).all())
    assert float((fused == ops).float().mean()) > 0.99  # rounding differs only at ties


def test_mismatched_layouts_are_refused() -> None:
    keys = torch.randn(2, 4, 1, 8)
    cache = torch.zeros(2, 4, 2, 2, 8)
    with pytest.raises(LayoutError):  # heads differ
        write_chunk(keys, keys, cache, cache.clone(), torch.arange(4), 0, None)
    cache = torch.zeros(2, 1, 2, 1, 8)
    with pytest.raises(LayoutError, match="beyond"):  # slot 3 of a 2-slot cache
        write_chunk(keys, keys, cache, cache.clone(), torch.arange(4), 0, None)
    with pytest.raises(LayoutError):  # dtype differs
        write_chunk(
            keys,
            keys,
            torch.zeros(2, 4, 2, 1, 8, dtype=torch.bfloat16),
            torch.zeros(2, 4, 2, 1, 8, dtype=torch.bfloat16),
            torch.arange(4),
            0,
            None,
        )
