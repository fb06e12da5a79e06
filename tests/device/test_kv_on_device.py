"""The KV math on a real accelerator against the CPU path: each cache layout's rotated write
(torch ops on CUDA; torch-npu's npu_rotary_mul where its rules allow on Ascend) lands the
same keys and values as the CPU writes them (<= 1e-6 fp32). Skipped where the host has no
GPU or NPU; tests/kv proves the layouts' indexing on CPU tensors everywhere."""

from __future__ import annotations

import pytest
import torch

from chunkstore.kv.cache_layouts import (
    CacheLayout,
    LatentLayout,
    PackedLayout,
    SplitLayout,
    StackedLayout,
)
from chunkstore.kv.rope import RotaryConfig, rotation_table

BLOCKS, BLOCK_SIZE, HEADS, DIM = 6, 16, 4, 64
SLOTS = torch.tensor([5, 0, 17, 9, 23, 12, 80, 95])


def caches(device: str) -> list[tuple[CacheLayout, object]]:
    return [
        (PackedLayout(DIM), torch.zeros(BLOCKS, HEADS, BLOCK_SIZE, 2 * DIM, device=device)),
        (StackedLayout(0), torch.zeros(2, BLOCKS, BLOCK_SIZE, HEADS, DIM, device=device)),
        (StackedLayout(1), torch.zeros(BLOCKS, 2, BLOCK_SIZE, HEADS, DIM, device=device)),
        (
            SplitLayout(),
            (
                torch.zeros(BLOCKS, BLOCK_SIZE, HEADS, DIM, device=device),
                torch.zeros(BLOCKS, BLOCK_SIZE, HEADS, DIM, device=device),
            ),
        ),
    ]


def test_rotated_writes_on_the_device_match_the_cpu(accelerator: str) -> None:
    rotary = RotaryConfig(head_dim=DIM, rotary_dim=DIM, theta=10000.0)
    g = torch.Generator().manual_seed(0)
    keys = torch.randn(len(SLOTS), HEADS, DIM, generator=g)
    values = torch.randn(len(SLOTS), HEADS, DIM, generator=g)
    cos, sin = rotation_table(rotary, 123, len(SLOTS))
    for (layout, on_cpu), (_, on_device) in zip(caches("cpu"), caches(accelerator), strict=True):
        layout.write(on_cpu, keys, values, SLOTS, (cos, sin), rotary)
        layout.write(
            on_device,
            keys.to(accelerator),
            values.to(accelerator),
            SLOTS.to(accelerator),
            (cos.to(accelerator), sin.to(accelerator)),
            rotary,
        )
        want_k, want_v = layout.read(on_cpu, SLOTS)
        got_k, got_v = layout.read(on_device, SLOTS.to(accelerator))
        assert (got_k.cpu() - want_k).abs().max() <= 1e-6, layout.name
        assert torch.equal(got_v.cpu(), want_v), layout.name  # type: ignore[union-attr]


def test_mla_latent_rotates_on_the_device_as_on_the_cpu(accelerator: str) -> None:
    lora, rope = 32, 16
    rotary = RotaryConfig(head_dim=lora + rope, rotary_dim=rope, theta=10000.0, rotary_offset=lora)
    latent = torch.randn(len(SLOTS), 1, lora + rope)
    rotation = rotation_table(rotary, 9, len(SLOTS))
    on_cpu = torch.zeros(BLOCKS, BLOCK_SIZE, lora + rope)
    on_device = on_cpu.to(accelerator)
    LatentLayout().write(on_cpu, latent, None, SLOTS, rotation, rotary)
    LatentLayout().write(
        on_device,
        latent.to(accelerator),
        None,
        SLOTS.to(accelerator),
        tuple(t.to(accelerator) for t in rotation),  # type: ignore[arg-type]
        rotary,
    )
    assert (on_device.cpu() - on_cpu).abs().max() <= 1e-6


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_writes_round_like_the_cpu(accelerator: str, dtype: torch.dtype) -> None:
    rotary = RotaryConfig(head_dim=DIM, rotary_dim=DIM, theta=10000.0)
    keys = torch.randn(len(SLOTS), HEADS, DIM).to(dtype)
    cos, sin = rotation_table(rotary, 7, len(SLOTS))
    layout = SplitLayout()
    on_cpu = tuple(torch.zeros(BLOCKS, BLOCK_SIZE, HEADS, DIM, dtype=dtype) for _ in "kv")
    on_device = (on_cpu[0].to(accelerator), on_cpu[1].to(accelerator))
    layout.write(on_cpu, keys, keys, SLOTS, (cos, sin), rotary)
    layout.write(
        on_device,
        keys.to(accelerator),
        keys.to(accelerator),
        SLOTS.to(accelerator),
        (cos.to(accelerator), sin.to(accelerator)),
        rotary,
    )
    # One rounding apart at most: the device may fuse the multiply-add.
    eps = torch.finfo(dtype).eps
    diff = (on_device[0].cpu().float() - on_cpu[0].float()).abs()
    assert float(diff.max()) <= 2 * eps * float(on_cpu[0].float().abs().max())
