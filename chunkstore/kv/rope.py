"""RoPE remap: re-rotate cached keys from the positions they were computed at to new ones.

A rotary embedding that is a fixed set of per-pair frequencies f_i rotates pair i of a key at
position p by the angle p * f_i. Rotations compose, so a key computed at virtual start v and
rotated by (p - v) * f_i is the key at p; values are untouched ("copy + RoPE remap":
docs/design.md#sources). Variants whose frequencies depend on the sequence (dynamic NTK,
LongRoPE) or that are not a plain 1D rotation (multimodal rotary) cannot be remapped exactly and
raise UnsupportedRotaryError, so callers fall back to computing.

The frequencies are computed in float32 exactly as the serving engines compute them (HF
transformers, vLLM): a key rotated with slightly different frequencies would drift by
delta * error, which grows with the distance moved.

This module is the rotation's definition and its plain-torch kernel (CPU, CUDA); the Ascend
kernel is ``rope_npu``, and ``remap`` picks one by the keys' device and applies it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from chunkstore.errors import LayoutError, UnsupportedRotaryError

RotaryStyle = Literal["neox", "gptj"]

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "proportional")
_LENGTH_DEPENDENT = {
    "dynamic": "its frequencies change with the sequence length",
    "longrope": "it switches frequency sets with the sequence length",
}


@dataclass(frozen=True)
class RotaryConfig:
    """The rotary embedding applied to a model's cached keys.

    ``rotary_dim`` dims starting at ``rotary_offset`` of the last axis are rotated (partial
    rotary leaves the rest alone; MLA's latent cache keeps its decoupled ``k_pe`` after the
    compressed KV, at offset ``kv_lora_rank``). ``style`` says how dims pair up: "neox" pairs
    i with i + rotary_dim / 2, "gptj" pairs 2i with 2i + 1.
    """

    head_dim: int
    rotary_dim: int
    theta: float
    rope_type: str = "default"
    style: RotaryStyle = "neox"
    rotary_offset: int = 0
    scaling: tuple[tuple[str, Any], ...] = field(default=())

    def __post_init__(self) -> None:
        if self.rope_type in _LENGTH_DEPENDENT:
            raise UnsupportedRotaryError(self.rope_type, _LENGTH_DEPENDENT[self.rope_type])
        if self.rope_type not in SUPPORTED_ROPE_TYPES:
            raise UnsupportedRotaryError(self.rope_type, "not a known fixed-frequency variant")
        if self.style not in ("neox", "gptj"):
            raise UnsupportedRotaryError(self.rope_type, f"unknown pairing style {self.style!r}")
        if self.rotary_dim % 2 or not 0 < self.rotary_dim <= self.head_dim - self.rotary_offset:
            raise LayoutError(
                f"rotary_dim {self.rotary_dim} at offset {self.rotary_offset} "
                f"does not fit head_dim {self.head_dim} in pairs"
            )

    @property
    def params(self) -> dict[str, Any]:
        return dict(self.scaling)

    @classmethod
    def from_hf_config(cls, config: Any, style: RotaryStyle = "neox") -> RotaryConfig:
        """Read the rotary set-up from a transformers config (``rope_parameters`` as of
        transformers 5, ``rope_scaling`` + ``rope_theta`` before). ``style`` is the engine's
        pairing of the cached keys (vLLM's ``is_neox_style``)."""
        params = dict(getattr(config, "rope_parameters", None) or {})
        legacy = dict(getattr(config, "rope_scaling", None) or {})
        if params and all(isinstance(v, Mapping) for v in params.values()):
            raise UnsupportedRotaryError("per-layer", "layers use different rotary settings")
        params = {**legacy, **params}
        if "mrope_section" in params or params.get("mrope_interleaved"):
            raise UnsupportedRotaryError("mrope", "multimodal rotary is not a 1D rotation")
        rope_type = str(params.pop("rope_type", None) or params.pop("type", None) or "default")
        params.pop("type", None)
        theta = float(params.pop("rope_theta", None) or getattr(config, "rope_theta", 10000.0))
        partial = float(
            params.pop("partial_rotary_factor", None)
            or getattr(config, "partial_rotary_factor", None)
            or 1.0
        )
        head_dim = getattr(config, "head_dim", None) or (
            config.hidden_size // config.num_attention_heads
        )
        if rope_type in ("yarn", "llama3") and "original_max_position_embeddings" not in params:
            params["original_max_position_embeddings"] = config.max_position_embeddings
        if rope_type == "yarn" and params.get("factor") is None:
            params["factor"] = (
                config.max_position_embeddings / params["original_max_position_embeddings"]
            )
        scaling = tuple(sorted((k, v) for k, v in params.items() if v is not None))
        kv_lora_rank = getattr(config, "kv_lora_rank", None)
        if kv_lora_rank and getattr(config, "qk_rope_head_dim", None):
            # MLA: the cache holds one latent per token, [compressed KV | k_pe]; only the
            # decoupled k_pe is rotated.
            rope_dim = config.qk_rope_head_dim
            return cls(
                kv_lora_rank + rope_dim, rope_dim, theta, rope_type, style, kv_lora_rank, scaling
            )
        if rope_type == "proportional":
            # Rotates the whole head; the tail pairs have frequency zero.
            return cls(
                head_dim,
                head_dim,
                theta,
                rope_type,
                style,
                0,
                scaling + (("partial_rotary_factor", partial),),
            )
        return cls(head_dim, int(head_dim * partial), theta, rope_type, style, 0, scaling)


def inv_frequencies(cfg: RotaryConfig) -> torch.Tensor:
    """Per-pair inverse frequencies, float32, as transformers and vLLM compute them."""
    dim = cfg.rotary_dim
    p = cfg.params
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    base = 1.0 / (cfg.theta**exponents)
    if cfg.rope_type == "default":
        return base
    if cfg.rope_type == "linear":
        return base / p["factor"]
    if cfg.rope_type == "llama3":
        return _llama3_frequencies(base, p)
    if cfg.rope_type == "yarn":
        return _yarn_frequencies(cfg, p)
    if cfg.rope_type == "proportional":
        angles = int(p.get("partial_rotary_factor", 1.0) * cfg.head_dim // 2)
        rotated = 1.0 / cfg.theta ** (
            torch.arange(0, 2 * angles, 2, dtype=torch.int64).float() / cfg.head_dim
        )
        zeros = torch.zeros(cfg.head_dim // 2 - angles)
        return torch.cat((rotated, zeros)) / p.get("factor", 1.0)
    raise UnsupportedRotaryError(cfg.rope_type, "not a known fixed-frequency variant")


def _llama3_frequencies(base: torch.Tensor, p: dict[str, Any]) -> torch.Tensor:
    """Llama 3.1's smooth interpolation between scaled low and unscaled high frequencies."""
    factor, low, high = p["factor"], p["low_freq_factor"], p["high_freq_factor"]
    old_len = p["original_max_position_embeddings"]
    wavelen = 2 * math.pi / base
    scaled = torch.where(wavelen > old_len / low, base / factor, base)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < old_len / high) * ~(wavelen > old_len / low)
    return torch.where(medium, smoothed, scaled)


def _yarn_frequencies(cfg: RotaryConfig, p: dict[str, Any]) -> torch.Tensor:
    """YaRN (Peng et al. 2023): extrapolate high frequencies, interpolate low ones, ramp
    between. Its attention factor scales cos and sin at compute time and so is already in the
    cached keys; a rotation by a delta must not apply it again."""
    dim, theta, factor = cfg.rotary_dim, cfg.theta, p["factor"]
    beta_fast, beta_slow = p.get("beta_fast") or 32, p.get("beta_slow") or 1
    old_len = p["original_max_position_embeddings"]

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(old_len / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if p.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = theta ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation = 1.0 / pos_freqs
    interpolation = 1.0 / (factor * pos_freqs)
    keep = 1 - ramp
    return interpolation * (1 - keep) + extrapolation * keep


def rotation_table(
    cfg: RotaryConfig,
    deltas: torch.Tensor | int,
    num_tokens: int | None = None,
    device: torch.device | str = "cpu",
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of delta * f_i, float32, shaped [tokens, rotary_dim / 2].

    The angles are formed in float64 from the float32 frequencies, so the only rounding left is
    the engine's own at the original position.
    """
    if isinstance(deltas, int):
        if num_tokens is None:
            raise ValueError("a scalar delta needs num_tokens")
        deltas = torch.full((num_tokens,), deltas, dtype=torch.int64)
    angles = deltas.to("cpu", torch.float64)[:, None] * inv_frequencies(cfg).double()[None, :]
    return angles.cos().float().to(device), angles.sin().float().to(device)


def pair_indices(cfg: RotaryConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """The two dims of each rotated pair, in frequency order (int64)."""
    j = torch.arange(cfg.rotary_dim // 2)
    if cfg.style == "neox":
        first, second = j, j + cfg.rotary_dim // 2
    else:
        first, second = 2 * j, 2 * j + 1
    return first + cfg.rotary_offset, second + cfg.rotary_offset


# A rotation kernel (one per device type, ``remap.ROTATORS``): keys, cos, sin, config, out.
Rotator = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, RotaryConfig, torch.Tensor], None]


def rotate_with_torch(
    keys: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    cfg: RotaryConfig,
    out: torch.Tensor,
) -> None:
    """Plain torch ops: CPU and CUDA. Computes in float32 whatever the storage dtype."""
    lo, hi, half = cfg.rotary_offset, cfg.rotary_offset + cfg.rotary_dim, cfg.rotary_dim // 2
    x = keys[..., lo:hi].float()
    if cfg.style == "neox":
        x1, x2 = x[..., :half], x[..., half:]
    else:
        x1, x2 = x[..., 0::2], x[..., 1::2]
    rotated = torch.empty_like(x)
    r1, r2 = (
        (rotated[..., :half], rotated[..., half:])
        if cfg.style == "neox"
        else (rotated[..., 0::2], rotated[..., 1::2])
    )
    torch.mul(x1, cos, out=r1)
    r1.addcmul_(x2, sin, value=-1.0)
    torch.mul(x2, cos, out=r2)
    r2.addcmul_(x1, sin)
    if out.data_ptr() != keys.data_ptr():
        if lo > 0:
            out[..., :lo].copy_(keys[..., :lo])
        if hi < keys.shape[-1]:
            out[..., hi:].copy_(keys[..., hi:])
    out[..., lo:hi].copy_(rotated)
