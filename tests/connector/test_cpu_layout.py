"""Writes into vLLM's CPU attention cache: the fused rotate-and-write kernel against vLLM's own
write op (``cpu_attn_reshape_and_cache``, the real one) after a torch remap."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from chunkstore.kv.remap import rotate_keys
from chunkstore.kv.rope import RotaryConfig, rotation_table
from chunkstore_vllm.cpu_layout import CpuKVLayout

BLOCKS, HEADS, BLOCK_SIZE, DIM = 6, 3, 16, 64


def layout() -> CpuKVLayout:
    config = SimpleNamespace(compilation_config=SimpleNamespace(static_forward_context={}))
    return CpuKVLayout(config, BLOCK_SIZE)  # no layer set an isa: vLLM's default, "vec"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "rotary",
    [RotaryConfig(DIM, DIM, 10000.0), RotaryConfig(DIM, 32, 10000.0, style="gptj")],
    ids=["neox", "gptj-partial"],
)
@pytest.mark.parametrize("delta", [0, 37, -5])
def test_the_fused_write_is_vllms_write_of_the_remapped_keys(dtype, rotary, delta) -> None:
    g = torch.Generator().manual_seed(delta + 100)
    tokens = 40
    keys = torch.randn(tokens, HEADS, DIM, generator=g).to(dtype)
    values = torch.randn(tokens, HEADS, DIM, generator=g).to(dtype)
    slots = torch.randperm(BLOCKS * BLOCK_SIZE, generator=g)[:tokens].sort().values
    slots[10:20] = slots[10:20].flip(0)  # any order
    rotation = rotation_table(rotary, delta, tokens) if delta else None
    fused, fallback, reference = (
        torch.zeros(BLOCKS, HEADS, BLOCK_SIZE, 2 * DIM, dtype=dtype) for _ in range(3)
    )
    plain = layout()
    assert plain.probe("layer.0", fused) and plain.plain
    plain.write_rotated("layer.0", fused, keys, values, slots, rotation, rotary)
    other = layout()  # not probed: remap, then vLLM's op
    other.write_rotated("layer.0", fallback, keys, values, slots, rotation, rotary)
    remapped = (
        keys
        if rotation is None
        else rotate_keys(keys, *rotation, rotary, out=torch.empty_like(keys))
    )
    other.write("layer.0", reference, remapped, values, slots)
    assert torch.equal(fallback, reference)
    got_k, got_v = CpuKVLayout.read(fused, slots)
    want_k, want_v = CpuKVLayout.read(reference, slots)
    assert torch.equal(got_v, want_v)
    if rotation is None:
        assert torch.equal(fused, reference)
    elif dtype == torch.float32:
        torch.testing.assert_close(got_k, want_k, rtol=0, atol=1e-6)
    else:  # at most one bf16 ulp apart (torch may fuse the multiply-add)
        ulps = (got_k.view(torch.int16).int() - want_k.view(torch.int16).int()).abs()
        assert int(ulps.max()) <= 1
    untouched = torch.ones(BLOCKS * BLOCK_SIZE, dtype=torch.bool)
    untouched[slots] = False
    k_all, v_all = CpuKVLayout.read(fused, torch.arange(BLOCKS * BLOCK_SIZE))
    assert not k_all[untouched].any() and not v_all[untouched].any()
