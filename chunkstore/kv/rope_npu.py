"""Key rotation on Ascend NPUs through torch-npu's fused rotary kernel.

Written against torch-npu's documented ``torch_npu.npu_rotary_mul(input, r1, r2,
rotary_mode)``: it computes ``input * r1 + rotate(input) * r2`` on 4D tensors, where
``rotate`` is the neox half-swap (``rotary_mode="half"``) or the GPT-J pair swap
(``"interleave"``), and r1 / r2 hold cos / sin for every rotated dim. No NPU is reachable
here, so tests drive this module through a fake ``torch_npu`` named as such.
"""

from __future__ import annotations

import logging

import torch

from chunkstore.kv.rope import RotaryConfig, rotate_with_torch

log = logging.getLogger(__name__)

# npu_rotary_mul's documented limits on Atlas A2 / A3 (its page in Ascend's op-plugin
# documentation), for our call: BSND input [1, tokens,
# heads, D], r1 / r2 [1, tokens, 1, D]. D even and under 896; B and N under 1000; in
# "interleave" mode B * N under 1000 too.
MAX_ROTATED_DIMS = 896
MAX_HEADS = 1000
_told: set[str] = set()


def kernel_refusal(cfg: RotaryConfig, heads: int) -> str | None:
    """Why npu_rotary_mul would refuse these keys (None: it takes them)."""
    if cfg.rotary_dim >= MAX_ROTATED_DIMS:  # even: RotaryConfig refuses odd widths
        return f"it rotates under {MAX_ROTATED_DIMS} dims, not {cfg.rotary_dim}"
    if heads >= MAX_HEADS:
        return f"it takes under {MAX_HEADS} heads, not {heads}"
    return None


def full_width(table: torch.Tensor, cfg: RotaryConfig) -> torch.Tensor:
    """Expand a [..., rotary_dim / 2] cos or sin table to every rotated dim."""
    if cfg.style == "neox":
        return torch.cat((table, table), dim=-1)
    return table.repeat_interleave(2, dim=-1)


def rotate(
    keys: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    cfg: RotaryConfig,
    out: torch.Tensor,
) -> None:
    lo, hi = cfg.rotary_offset, cfg.rotary_offset + cfg.rotary_dim
    x = keys[..., lo:hi]
    heads = x[0].numel() // cfg.rotary_dim if x.shape[0] else 1
    refusal = kernel_refusal(cfg, heads)
    if refusal is not None:  # the same rotation in plain torch ops, on the NPU
        if refusal not in _told:
            _told.add(refusal)
            log.warning("npu_rotary_mul not used (%s): rotating with torch ops", refusal)
        rotate_with_torch(keys, cos, sin, cfg, out)
        return

    import torch_npu

    # The kernel takes 4D operands: [1, tokens, heads, dims].
    x4 = x.reshape(1, x.shape[0], -1, cfg.rotary_dim)
    r1 = full_width(cos, cfg).reshape(1, x.shape[0], -1, cfg.rotary_dim).to(x.dtype)
    r2 = full_width(sin, cfg).reshape(1, x.shape[0], -1, cfg.rotary_dim).to(x.dtype)
    mode = "half" if cfg.style == "neox" else "interleave"
    rotated = torch_npu.npu_rotary_mul(x4, r1, r2, rotary_mode=mode).reshape(x.shape)
    if out.data_ptr() != keys.data_ptr():
        out.copy_(keys)
    out[..., lo:hi].copy_(rotated)
