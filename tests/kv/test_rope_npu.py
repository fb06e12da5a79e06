"""The torch-npu rotation path, driven through a FAKE torch_npu (no NPU is reachable here).

FakeTorchNpu implements ``npu_rotary_mul`` as torch-npu documents it (input * r1 +
rotate(input) * r2 on 4D tensors; "half" swaps halves, "interleave" swaps pairs). What this
checks is our side of the boundary: the cos / sin expansion, the reshapes, the pass-through
dims. Whether the real kernel matches its documentation is for a run on Ascend hardware.
"""

from __future__ import annotations

import sys

import pytest
import torch

from chunkstore.kv import rope_npu
from chunkstore.kv.remap import ROTATORS, remap_keys
from chunkstore.kv.rope import RotaryConfig, rotation_table
from chunkstore.testing import fake_torch_npu as fake_torch_npu_module


@pytest.fixture
def fake_torch_npu(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch_npu", fake_torch_npu_module)


@pytest.mark.parametrize(
    "cfg",
    [
        RotaryConfig(head_dim=64, rotary_dim=64, theta=10000.0),
        RotaryConfig(head_dim=64, rotary_dim=32, theta=10000.0, style="gptj"),
        RotaryConfig(head_dim=80, rotary_dim=16, theta=10000.0, rotary_offset=64),
    ],
    ids=["neox", "gptj-partial", "mla-offset"],
)
def test_npu_path_equals_torch_path(fake_torch_npu, cfg: RotaryConfig) -> None:
    keys = torch.randn(10, 3, cfg.head_dim)
    cos, sin = rotation_table(cfg, 321, 10)
    out = torch.empty_like(keys)
    rope_npu.rotate(keys, cos[:, None], sin[:, None], cfg, out)
    torch.testing.assert_close(out, remap_keys(keys, 321, cfg), rtol=0, atol=1e-6)


def test_npu_tensors_dispatch_to_the_npu_path() -> None:
    assert ROTATORS["npu"] is not ROTATORS["cpu"]
    assert ROTATORS["cuda"] is ROTATORS["cpu"]


def test_the_fake_refuses_what_the_kernel_refuses() -> None:
    x = torch.zeros(1, 4, 2, 896)
    r = torch.zeros(1, 4, 1, 896)
    with pytest.raises(RuntimeError, match="out of range"):
        fake_torch_npu_module.npu_rotary_mul(x, r, r)
    with pytest.raises(RuntimeError, match="out of range"):
        fake_torch_npu_module.npu_rotary_mul(torch.zeros(1, 4, 1000, 64), r[..., :64], r[..., :64])
    with pytest.raises(RuntimeError, match="do not broadcast"):
        fake_torch_npu_module.npu_rotary_mul(
            torch.zeros(1, 4, 2, 64), torch.zeros(1, 1, 2, 64), torch.zeros(1, 1, 2, 64)
        )


@pytest.mark.parametrize(
    "cfg, heads",
    [
        (RotaryConfig(head_dim=1024, rotary_dim=1024, theta=10000.0), 2),
        (RotaryConfig(head_dim=64, rotary_dim=64, theta=10000.0), 1000),
    ],
    ids=["too-many-dims", "too-many-heads"],
)
def test_what_the_kernel_refuses_is_rotated_with_torch_ops(
    fake_torch_npu, cfg: RotaryConfig, heads: int
) -> None:
    assert rope_npu.kernel_refusal(cfg, heads) is not None
    keys = torch.randn(3, heads, cfg.head_dim)
    cos, sin = rotation_table(cfg, 77, 3)
    out = torch.empty_like(keys)
    rope_npu.rotate(keys, cos[:, None], sin[:, None], cfg, out)  # the fake would raise
    torch.testing.assert_close(out, remap_keys(keys, 77, cfg), rtol=0, atol=1e-6)
