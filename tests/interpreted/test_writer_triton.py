"""The fused Triton writer (``chunkstore.kv.writer_triton``) writes what the torch path writes,
bit for bit: every rotary variant, fp32 / fp16 / bf16, the flat cache ``write_chunk`` hands a
writer and strided per-layer views of each back end's layout, padded slots skipped and every
other slot left as it was. Run on CPU tensors by Triton's interpreter (no GPU here); the
compiled kernel on a GPU is checked by tests/device and by the writer's own self-check."""

from __future__ import annotations

import logging
import sys
from types import ModuleType

import pytest
import torch

from chunkstore.kv import writer
from chunkstore.kv.cache_layouts import (
    CacheLayout,
    LatentLayout,
    PackedLayout,
    SplitLayout,
    StackedLayout,
)
from chunkstore.kv.paging import PAD_SLOT
from chunkstore.kv.rope import RotaryConfig, rotation_table
from chunkstore.kv.writer import write_chunk, write_torch
from chunkstore.testing.devices import DTYPES, ROTARY_VARIANTS

KERNEL = "chunkstore.kv.writer_triton"
LAYERS, HEADS, BLOCKS, BLOCK_SIZE = 2, 2, 4, 4
SLOTS = torch.tensor([9, PAD_SLOT, 0, 14, 5, PAD_SLOT, 3])  # across blocks, out of order


def chunk(
    dims: int, dtype: torch.dtype, seed: int = 0, tokens: int = len(SLOTS)
) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shape = (LAYERS, tokens, HEADS, dims)
    return torch.randn(shape, generator=g).to(dtype), torch.randn(shape, generator=g).to(dtype)


def filled_cache(dims: int, dtype: torch.dtype, seed: int = 1) -> torch.Tensor:
    """A cache already holding other tokens: slots not written must keep their bytes."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(LAYERS, BLOCKS, BLOCK_SIZE, HEADS, dims, generator=g).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("variant", list(ROTARY_VARIANTS))
def test_every_rotary_variant_and_dtype_writes_the_torch_paths_bits(
    kernel: ModuleType, variant: str, dtype: torch.dtype
) -> None:
    rotary = ROTARY_VARIANTS[variant]
    keys, values = chunk(rotary.head_dim, dtype)
    deltas = torch.tensor([300, -41, 7, 4096, 0, 1, -1000])  # each token moved its own way
    caches = [filled_cache(rotary.head_dim, dtype) for _ in range(4)]
    write_chunk(keys, values, *caches[:2], SLOTS, deltas, rotary, writer=kernel.write_triton)
    write_chunk(keys, values, *caches[2:], SLOTS, deltas, rotary, writer=write_torch)
    assert torch.equal(caches[0], caches[2]), "keys"  # every slot: written, padded, untouched
    assert torch.equal(caches[1], caches[3]), "values"


def test_padded_slots_and_slots_not_written_keep_their_bytes(kernel: ModuleType) -> None:
    rotary = ROTARY_VARIANTS["default"]
    keys, values = chunk(rotary.head_dim, torch.bfloat16)
    caches = [filled_cache(rotary.head_dim, torch.bfloat16) for _ in "kv"]
    before = [cache.clone() for cache in caches]
    write_chunk(keys, values, *caches, SLOTS, 77, rotary, writer=kernel.write_triton)
    written = torch.zeros(BLOCKS * BLOCK_SIZE, dtype=torch.bool)
    written[SLOTS[SLOTS >= 0]] = True
    for cache, was in zip(caches, before, strict=True):
        assert torch.equal(cache.flatten(1, 2)[:, ~written], was.flatten(1, 2)[:, ~written])
        assert not torch.equal(cache.flatten(1, 2)[:, written], was.flatten(1, 2)[:, written])
    after = [cache.clone() for cache in caches]
    nothing = torch.full_like(SLOTS, PAD_SLOT)  # every token another rank's
    write_chunk(keys, values, *caches, nothing, 77, rotary, writer=kernel.write_triton)
    assert all(torch.equal(c, a) for c, a in zip(caches, after, strict=True))


@pytest.mark.parametrize("rotary", [ROTARY_VARIANTS["default"], None], ids=["shift-0", "none"])
def test_a_zero_shift_or_no_rotary_copies_keys_as_stored(
    kernel: ModuleType, rotary: RotaryConfig | None
) -> None:
    keys, values = chunk(64, torch.bfloat16)
    key_cache, value_cache = (
        torch.zeros(LAYERS, BLOCKS, BLOCK_SIZE, HEADS, 64, dtype=torch.bfloat16) for _ in "kv"
    )
    write_chunk(keys, values, key_cache, value_cache, SLOTS, 0, rotary, writer=kernel.write_triton)
    kept = SLOTS >= 0
    assert torch.equal(key_cache.flatten(1, 2)[:, SLOTS[kept]], keys[:, kept])
    assert torch.equal(value_cache.flatten(1, 2)[:, SLOTS[kept]], values[:, kept])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_halfway_cases_round_to_even_as_torch_does(kernel: ModuleType, dtype: torch.dtype) -> None:
    """cos 1.5 and sin 0 turn a half-precision key into a float32 one bit longer than the
    storage keeps: about half of them lie exactly halfway between two neighbours."""
    rotary = RotaryConfig(head_dim=64, rotary_dim=64, theta=10000.0)
    keys, values = chunk(64, dtype, tokens=16)
    slots = torch.arange(16)
    cos, sin = torch.full((16, 32), 1.5), torch.zeros(16, 32)
    fused, ops = (torch.zeros(LAYERS, 16, HEADS, 64, dtype=dtype) for _ in "ft")
    kernel.write_triton(keys, values, fused, torch.empty_like(fused), slots, cos, sin, rotary)
    write_torch(keys, values, ops, torch.empty_like(ops), slots, cos, sin, rotary)
    halfway = keys.float() * 1.5 != (keys.float() * 1.5).to(dtype).float()
    assert float(halfway.float().mean()) > 0.3
    assert torch.equal(fused, ops)


def hnd_views(dims: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer's K and V as FlashInfer's HND order lays them out (heads before the block's
    tokens in memory), viewed [blocks, block_size, heads, dims]."""
    g = torch.Generator().manual_seed(2)
    hnd = torch.randn(2, BLOCKS, HEADS, BLOCK_SIZE, dims, generator=g).to(dtype)
    key_view, value_view = hnd.transpose(2, 3).unbind(0)
    return key_view, value_view


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("variant", ["default", "gptj-partial", "yarn", "mla-offset"])
def test_one_layer_into_a_strided_hnd_view_writes_the_torch_paths_bits(
    kernel: ModuleType, variant: str, dtype: torch.dtype
) -> None:
    rotary = ROTARY_VARIANTS[variant]
    keys, values = (x[0] for x in chunk(rotary.head_dim, dtype))
    rotation = rotation_table(rotary, torch.arange(-3, 4) * 500, len(SLOTS))
    fused = hnd_views(rotary.head_dim, dtype)
    assert kernel.write_layer_triton(keys, values, *fused, SLOTS, rotation, rotary)
    ops = [view.flatten(0, 1).clone() for view in hnd_views(rotary.head_dim, dtype)]
    write_torch(keys[None], values[None], ops[0][None], ops[1][None], SLOTS, *rotation, rotary)
    assert torch.equal(fused[0].flatten(0, 1), ops[0])
    assert torch.equal(fused[1].flatten(0, 1), ops[1])


def layouts(dtype: torch.dtype) -> dict[str, tuple[CacheLayout, object]]:
    """A cache of each back end's layout (as tests/kv/test_cache_layouts.py builds them)."""
    dim = 16
    nhd = torch.zeros(BLOCKS, BLOCK_SIZE, HEADS, 2 * dim, dtype=dtype).transpose(1, 2)
    return {
        "packed-NHD": (PackedLayout(dim), nhd),
        "packed-HND": (
            PackedLayout(dim),
            torch.zeros(BLOCKS, HEADS, BLOCK_SIZE, 2 * dim, dtype=dtype),
        ),
        "stacked1": (StackedLayout(1), torch.zeros(BLOCKS, 2, BLOCK_SIZE, HEADS, dim, dtype=dtype)),
        "split": (
            SplitLayout(),
            tuple(torch.zeros(BLOCKS, BLOCK_SIZE, HEADS, dim, dtype=dtype) for _ in "kv"),
        ),
        "latent": (LatentLayout(), torch.zeros(BLOCKS, BLOCK_SIZE, 24, dtype=dtype)),
    }


def as_tensors(cache: object) -> list[torch.Tensor]:
    return list(cache) if isinstance(cache, tuple) else [cache]  # type: ignore[arg-type]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_cache_layouts_write_through_the_kernel_where_the_device_has_it(
    kernel: ModuleType, monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype
) -> None:
    """``CacheLayout.write`` takes the device's fused layer writer (``writer.layer_writer_for``;
    the CPU has none, so the interpreted kernel stands in for it) and writes what its torch
    path writes, in every layout."""
    launched: list[str] = []

    def fused(*args: object) -> bool:
        launched.append("kernel")
        return bool(kernel.write_layer_triton(*args))

    for name, (layout, cache) in layouts(dtype).items():
        rotary = (
            RotaryConfig(head_dim=24, rotary_dim=8, theta=10000.0, rotary_offset=16)
            if name == "latent"
            else RotaryConfig(head_dim=16, rotary_dim=16, theta=10000.0)
        )
        heads = 1 if name == "latent" else HEADS
        g = torch.Generator().manual_seed(3)
        keys = torch.randn(len(SLOTS), heads, rotary.head_dim, generator=g).to(dtype)
        values = None if name == "latent" else torch.randn(keys.shape, generator=g).to(dtype)
        rotation = rotation_table(rotary, 1234, len(SLOTS))
        on_torch = layouts(dtype)[name][1]
        layout.write(on_torch, keys, values, SLOTS, rotation, rotary)
        with monkeypatch.context() as patch:
            patch.setitem(writer._layer_writers, "cpu", fused)
            layout.write(cache, keys, values, SLOTS, rotation, rotary)
        assert launched.pop() == "kernel", name
        for got, want in zip(as_tensors(cache), as_tensors(on_torch), strict=True):
            assert torch.equal(got, want), name


def test_a_device_gets_the_kernel_only_once_its_self_check_passes(
    kernel: ModuleType, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The registration on CUDA and NPUs (``writer._triton_writer``), here run for CPU
    tensors: the kernel where its self-check writes torch's bits; else torch ops, said once."""
    monkeypatch.setattr(writer, "_triton_problems", {})
    assert writer.triton_problem("cpu") is None
    assert writer._triton_writer("cpu") is not write_torch
    assert writer._triton_layer_writer("cpu") is kernel.write_layer_triton

    for why, patch_kernel in (
        ("wrote other bits", lambda: monkeypatch.setattr(kernel, "self_check", lambda *_: "x")),
        ("triton unavailable", lambda: monkeypatch.setitem(sys.modules, KERNEL, None)),
    ):
        monkeypatch.setattr(writer, "_triton_problems", {})
        patch_kernel()
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger=writer.__name__):
            assert writer._triton_writer("cpu") is write_torch
            assert writer._triton_layer_writer("cpu") is None
        assert len(caplog.records) == 1, why
        assert "using torch ops" in caplog.records[0].getMessage()


def test_the_self_check_catches_a_kernel_that_writes_wrong_bits(
    kernel: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    def rotating_backwards(keys, values, flat_k, flat_v, slots, cos, sin, rotary):  # type: ignore[no-untyped-def]
        write_torch(keys, values, flat_k, flat_v, slots, cos, -sin, rotary)

    assert kernel.self_check("cpu", write_torch) is None
    monkeypatch.setattr(kernel, "write_triton", rotating_backwards)
    assert "other bits" in str(kernel.self_check("cpu", write_torch))
