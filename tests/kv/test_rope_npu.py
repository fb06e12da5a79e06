"""The torch-npu rotation path, driven through a FAKE torch_npu (no NPU is reachable here).

FakeTorchNpu implements ``npu_rotary_mul`` as torch-npu documents it (input * r1 +
rotate(input) * r2 on 4D tensors; "half" swaps halves, "interleave" swaps pairs). What this
checks is our side of the boundary: the cos / sin expansion, the reshapes, the pass-through
dims. Whether the real kernel matches its documentation is for a run on Ascend hardware.
"""

from __future__ import annotations

import types

import pytest
import torch

from chunkstore.kv import rope_npu
from chunkstore.kv.remap import ROTATORS, remap_keys
from chunkstore.kv.rope import RotaryConfig, rotation_table


def _fake_rotary_mul(
    x: torch.Tensor, r1: torch.Tensor, r2: torch.Tensor, rotary_mode: str = "half"
) -> torch.Tensor:
    # What the documentation says the kernel refuses (A2 / A3, BSND, see rope_npu), refused
    # here too, so a call the real kernel would refuse cannot pass unseen:
    if not (x.dim() == 4 and r1.dim() == 4 and r2.dim() == 4):
        raise RuntimeError("npu_rotary_mul takes 4D tensors")
    b, s, n, d = x.shape
    if d % 2 or d >= 896 or b >= 1000 or n >= 1000:
        raise RuntimeError(f"npu_rotary_mul: shape {tuple(x.shape)} out of range")
    if rotary_mode == "interleave" and b * n >= 1000:
        raise RuntimeError("npu_rotary_mul: interleave takes B * N under 1000")
    if r1.shape != r2.shape or r1.shape not in ((1, s, 1, d), (b, s, 1, d), (b, s, n, d)):
        raise RuntimeError(f"npu_rotary_mul: r1 / r2 {tuple(r1.shape)} do not broadcast")
    if rotary_mode == "half":
        x1, x2 = x.chunk(2, dim=-1)
        rotated = torch.cat((-x2, x1), dim=-1)
    elif rotary_mode == "interleave":
        rotated = torch.stack((-x[..., 1::2], x[..., 0::2]), dim=-1).flatten(-2)
    else:
        raise ValueError(rotary_mode)
    return x * r1 + rotated * r2


FakeTorchNpu = types.SimpleNamespace(npu_rotary_mul=_fake_rotary_mul)


@pytest.fixture
def fake_torch_npu(monkeypatch):
    monkeypatch.setitem(__import__("sys").modules, "torch_npu", FakeTorchNpu)


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
        _fake_rotary_mul(x, r, r)
    with pytest.raises(RuntimeError, match="out of range"):
        _fake_rotary_mul(torch.zeros(1, 4, 1000, 64), r[..., :64], r[..., :64])
    with pytest.raises(RuntimeError, match="do not broadcast"):
        _fake_rotary_mul(
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
