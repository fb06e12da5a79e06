"""FAKE ``torch_npu``: the two torch-npu kernels chunkstore calls, restated from torch-npu's
documentation on CPU tensors, for hosts without an Ascend NPU (all of this project's). It
refuses what the documentation says the real kernels refuse, so a call the NPU would reject
cannot pass here unseen. What it proves is our side of the boundary (shapes, dtypes,
expansions); whether the real kernels match their documentation is for a run on Ascend
(``scripts/device-check --device npu`` there).

- ``npu_rotary_mul(input, r1, r2, rotary_mode)``: ``input * r1 + rotate(input) * r2`` on 4D
  tensors (BSND), "half" swapping halves (neox), "interleave" swapping pairs (GPT-J);
  D even and under 896, B and N under 1000, B * N under 1000 in "interleave"
  (its page in Ascend's op-plugin documentation).
- ``_npu_reshape_and_cache(key, value, key_cache, value_cache, slot_indices)``: as vllm-ascend
  calls it (attention_v1.py): ``key_cache[slot // block_size, slot % block_size] = key[t]``,
  value likewise, int32 slots, caches [blocks, block_size, heads, dim] in the ND format.
"""

from __future__ import annotations

import torch

FAKE = True  # the device check reports which torch_npu ran


def npu_rotary_mul(
    x: torch.Tensor, r1: torch.Tensor, r2: torch.Tensor, rotary_mode: str = "half"
) -> torch.Tensor:
    if not (x.dim() == 4 and r1.dim() == 4 and r2.dim() == 4):
        raise RuntimeError("npu_rotary_mul takes 4D tensors")
    b, s, n, d = x.shape
    if d % 2 or d >= 896 or b >= 1000 or n >= 1000:
        raise RuntimeError(f"npu_rotary_mul: shape {tuple(x.shape)} out of range")
    if rotary_mode == "interleave" and b * n >= 1000:
        raise RuntimeError("npu_rotary_mul: interleave takes B * N under 1000")
    if r1.shape != r2.shape or r1.shape not in ((1, s, 1, d), (b, s, 1, d), (b, s, n, d)):
        raise RuntimeError(f"npu_rotary_mul: r1 / r2 {tuple(r1.shape)} do not broadcast")
    if r1.dtype != x.dtype:
        raise RuntimeError(f"npu_rotary_mul: r1 is {r1.dtype}, input {x.dtype}")
    if rotary_mode == "half":
        x1, x2 = x.chunk(2, dim=-1)
        rotated = torch.cat((-x2, x1), dim=-1)
    elif rotary_mode == "interleave":
        rotated = torch.stack((-x[..., 1::2], x[..., 0::2]), dim=-1).flatten(-2)
    else:
        raise RuntimeError(f"npu_rotary_mul: unknown rotary_mode {rotary_mode!r}")
    return x * r1 + rotated * r2


def _npu_reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_indices: torch.Tensor,
) -> None:
    if slot_indices.dtype != torch.int32:
        raise RuntimeError(f"_npu_reshape_and_cache: slot_indices are {slot_indices.dtype}")
    if key_cache.dim() != 4 or key_cache.shape != value_cache.shape:
        raise RuntimeError("_npu_reshape_and_cache: caches are two [blocks, block, heads, dim]")
    if key.shape[1:] != key_cache.shape[2:] or key.dtype != key_cache.dtype:
        raise RuntimeError(
            f"_npu_reshape_and_cache: key {tuple(key.shape)} {key.dtype} does not fit "
            f"{tuple(key_cache.shape)} {key_cache.dtype}"
        )
    block_size = key_cache.shape[1]
    slots = slot_indices.long()
    blocks, offsets = slots // block_size, slots % block_size
    key_cache[blocks, offsets] = key
    value_cache[blocks, offsets] = value
