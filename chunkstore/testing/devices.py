"""What the device suite (tests/device) shares: which accelerators this host has
(``device_ipc.accelerators``), every rotary variant the remap supports, and how far a
device's result may be from the CPU fp32 reference."""

from __future__ import annotations

import torch

from chunkstore.device.device_ipc import accelerators as real_devices  # noqa: F401
from chunkstore.kv.rope import RotaryConfig

# Every rotary variant the remap supports (rope.SUPPORTED_ROPE_TYPES), with the pairings and
# partial / offset widths real models use.
ROTARY_VARIANTS = {
    "default": RotaryConfig(head_dim=64, rotary_dim=64, theta=10000.0),
    "gptj-partial": RotaryConfig(head_dim=64, rotary_dim=32, theta=10000.0, style="gptj"),
    "linear": RotaryConfig(64, 64, 10000.0, "linear", scaling=(("factor", 4.0),)),
    "llama3": RotaryConfig(
        128,
        128,
        500000.0,
        "llama3",
        scaling=(
            ("factor", 8.0),
            ("high_freq_factor", 4.0),
            ("low_freq_factor", 1.0),
            ("original_max_position_embeddings", 8192),
        ),
    ),
    "yarn": RotaryConfig(
        64,
        64,
        10000.0,
        "yarn",
        scaling=(("factor", 4.0), ("original_max_position_embeddings", 4096)),
    ),
    "proportional": RotaryConfig(
        64, 64, 10000.0, "proportional", scaling=(("partial_rotary_factor", 0.25),)
    ),
    "mla-offset": RotaryConfig(head_dim=80, rotary_dim=16, theta=10000.0, rotary_offset=64),
}
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def tolerance(dtype: torch.dtype, scale: float) -> float:
    """How far a device's rotated key may be from the CPU fp32 reference: fp32, a few ulps
    (the device may fuse the multiply-add); half types, one rounding of the stored value."""
    if dtype == torch.float32:
        return 1e-5 * max(scale, 1.0)
    return 2 * torch.finfo(dtype).eps * scale
