"""Rotating cached keys on the device they are on: the rotation kernel of each device type
(``ROTATORS``: torch ops on CPU and CUDA, ``rope.rotate_with_torch``; torch-npu's fused kernel
on Ascend, ``rope_npu``) and the two calls every caller makes through it: ``rotate_keys`` by a
rotation table, ``remap_keys`` by position deltas (the RoPE remap, see ``rope``). It sits
above both kernels, which import only ``rope``."""

from __future__ import annotations

import torch

from chunkstore.errors import LayoutError
from chunkstore.kv import rope_npu
from chunkstore.kv.rope import RotaryConfig, Rotator, rotate_with_torch, rotation_table

# Device type -> rotation kernel. Adding a device back end is adding its file and an entry.
ROTATORS: dict[str, Rotator] = {
    "cpu": rotate_with_torch,
    "cuda": rotate_with_torch,
    "npu": rope_npu.rotate,
}


def rotate_keys(
    keys: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    cfg: RotaryConfig,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Rotate keys shaped [tokens, (heads,) head_dim] by the angles in a rotation table.

    ``out`` may be ``keys`` itself (in place) or any tensor of the same shape and dtype.
    """
    if keys.shape[-1] != cfg.head_dim:
        raise LayoutError(f"keys have last dim {keys.shape[-1]}, rotary expects {cfg.head_dim}")
    if cos.shape != (keys.shape[0], cfg.rotary_dim // 2):
        raise LayoutError(
            f"rotation table {tuple(cos.shape)} does not fit keys {tuple(keys.shape)}"
        )
    if keys.dim() == 3:
        cos, sin = cos[:, None, :], sin[:, None, :]
    out = keys if out is None else out
    rotator = ROTATORS.get(keys.device.type)
    if rotator is None:
        raise LayoutError(f"no rotation kernel for device type {keys.device.type!r}")
    rotator(keys, cos.to(keys.device), sin.to(keys.device), cfg, out)
    return out


def remap_keys(keys: torch.Tensor, deltas: torch.Tensor | int, cfg: RotaryConfig) -> torch.Tensor:
    """A copy of ``keys`` rotated by ``deltas`` positions (one per token, or one for all)."""
    cos, sin = rotation_table(cfg, deltas, keys.shape[0], keys.device)
    return rotate_keys(keys, cos, sin, cfg, out=torch.empty_like(keys))
