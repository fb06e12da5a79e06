"""The Ascend twin of the device check: the two torch-npu kernels chunkstore calls, against
the CPU fp32 reference. ``npu_rotary_mul`` (``kv/rope_npu``) rotates keys of every rotary
variant its rules take, in fp32, fp16 and bf16; ``_npu_reshape_and_cache`` (the connector's
``ascend_write``) lands keys and values where vllm-ascend's split ND pair is read, and the
start-up probe trusts it. On a host with an NPU the real torch_npu runs on NPU tensors;
elsewhere (CI) the FAKE ``chunkstore.testing.fake_torch_npu`` runs on CPU tensors, which
proves our side of the boundary only (test_device_pool.py covers torch_npu's IPC where an
NPU exists)."""

from __future__ import annotations

import sys
from types import ModuleType

import pytest
import torch

from chunkstore.kv import rope_npu
from chunkstore.kv.cache_layouts import SplitLayout
from chunkstore.kv.remap import remap_keys
from chunkstore.kv.rope import rotation_table
from chunkstore.testing import fake_torch_npu
from chunkstore.testing.devices import DTYPES, ROTARY_VARIANTS, real_devices, tolerance
from chunkstore_vllm.device_layout import DeviceKVLayout, ascend_write


@pytest.fixture
def npu(monkeypatch: pytest.MonkeyPatch) -> tuple[str, ModuleType]:
    """(device, torch_npu): the real one on an NPU, else the FAKE on CPU tensors."""
    if "npu" in real_devices():
        import torch_npu

        return "npu", torch_npu
    monkeypatch.setitem(sys.modules, "torch_npu", fake_torch_npu)
    return "cpu", fake_torch_npu


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("variant", ["default", "gptj-partial", "llama3", "yarn", "mla-offset"])
def test_npu_rotary_mul_rotates_like_the_cpu_reference(
    npu: tuple[str, ModuleType], variant: str, dtype: torch.dtype
) -> None:
    device, _ = npu
    cfg = ROTARY_VARIANTS[variant]
    assert rope_npu.kernel_refusal(cfg, 3) is None  # the kernel itself runs, no fallback
    g = torch.Generator().manual_seed(11)
    keys = torch.randn(48, 3, cfg.head_dim, generator=g).to(dtype)
    deltas = torch.randint(-2048, 2048, (48,), generator=g)
    reference = remap_keys(keys.float(), deltas, cfg)
    cos, sin = rotation_table(cfg, deltas, 48, device)
    on_device = keys.to(device)
    out = torch.empty_like(on_device)
    rope_npu.rotate(on_device, cos[:, None], sin[:, None], cfg, out)
    error = float((out.cpu().float() - reference).abs().max())
    # The kernel multiplies in the keys' dtype (r1 / r2 cast to it): two roundings.
    assert error <= 2 * tolerance(dtype, float(reference.abs().max())), (variant, error)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_the_ascend_write_lands_where_the_split_layout_reads(
    npu: tuple[str, ModuleType], dtype: torch.dtype
) -> None:
    device, _ = npu
    blocks, block_size, heads, dim = 5, 16, 4, 64
    cache = tuple(
        torch.zeros(blocks, block_size, heads, dim, dtype=dtype, device=device) for _ in "kv"
    )
    access = DeviceKVLayout(SplitLayout(), ascend_write, block_size)
    assert access.probe("layer.0", cache)  # the op writes where the layout reads
    assert not any(bool(part.any()) for part in cache)  # and the probe left it as it was
    g = torch.Generator().manual_seed(2)
    keys = torch.randn(9, heads, dim, generator=g).to(dtype)
    values = torch.randn(9, heads, dim, generator=g).to(dtype)
    slots = torch.tensor([17, 18, 19, 20, 33, 34, 35, 70, 71])
    ascend_write(cache, keys.to(device), values.to(device), slots.to(device))
    got_k, got_v = access.read(cache, slots)
    assert torch.equal(got_k.cpu(), keys) and torch.equal(got_v.cpu(), values)
    want_k, _ = SplitLayout().read(tuple(part.cpu() for part in cache), slots)
    assert torch.equal(want_k, keys)
