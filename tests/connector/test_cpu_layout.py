"""Writes into vLLM's CPU attention cache: the fused rotate-and-write kernel against vLLM's own
write op (``cpu_attn_reshape_and_cache``, the real one) after a torch remap."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
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


WARM_UP = """
import sys
import torch
from chunkstore.kv.rope import RotaryConfig, rotation_table
from tests.connector.test_cpu_layout import layout

rotary = RotaryConfig(64, 64, 10000.0)
cache = torch.randn(6, 3, 16, 128)
before = cache.clone()
plain = layout()
assert plain.probe("layer.0", cache)
plain.warm_up("layer.0", cache, rotary)
assert torch.equal(cache, before), "block 0 restored"
if "numba" not in sys.modules:
    print("cold")
    raise SystemExit
from chunkstore.kv.writer_cpu import _write_vec_f32 as kernel

warmed = len(kernel.signatures)
slots = torch.tensor([20, 21, 40], dtype=torch.int64)
keys, values = plain.read(cache, slots)  # as the hook moves a chunk
plain.write_rotated("layer.0", cache, keys, values, slots, rotation_table(rotary, 7, 3), rotary)
staged = torch.randn(2, 2, 3, 3, 64)  # as a load: an entry's [layers, tokens, heads, dim]
plain.write_rotated("layer.0", cache, staged[0, 1], staged[1, 1], slots, None, rotary)
from chunkstore.protocol import streamcopy
from chunkstore.protocol.streamcopy_kernel import streaming

copied = len(streaming.signatures)
pool = torch.zeros(4096, dtype=torch.uint8).numpy()
streamcopy.copy(pool[100:164], torch.ones(64, dtype=torch.uint8).numpy())  # as a save
print("warm", warmed, len(kernel.signatures), copied, len(streaming.signatures))
"""


@pytest.mark.parametrize("multiprocessing", ["1", "0"])
def test_the_fused_write_is_loaded_at_start_up_in_a_worker_process(multiprocessing) -> None:
    """The kernels' import and machine code at registration, not in the first request; and
    not in an in-process engine (vLLM's start-up scan of a later engine trips on numba)."""
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": multiprocessing}
    run = subprocess.run(
        [sys.executable, "-c", WARM_UP],
        env=env,
        cwd=Path(__file__).parents[2],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    got = run.stdout.split()[-5:] if multiprocessing == "1" else run.stdout.split()[-1:]
    # The requests' calls found the specializations the warm-up made (the write kernel's,
    # the streaming copy's): none compiled after.
    want = ["warm", "1", "1", "1", "1"] if multiprocessing == "1" else ["cold"]
    assert got == want, run.stdout
