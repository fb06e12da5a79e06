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
from chunkstore.kv.rope import ROTATORS, RotaryConfig, remap_keys, rotation_table


def _fake_rotary_mul(
    x: torch.Tensor, r1: torch.Tensor, r2: torch.Tensor, rotary_mode: str = "half"
) -> torch.Tensor:
    assert x.dim() == 4 and r1.dim() == 4 and r2.dim() == 4, "npu_rotary_mul takes 4D tensors"
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
