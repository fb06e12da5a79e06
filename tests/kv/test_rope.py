"""RoPE remap agrees with transformers' own rotary implementation for every supported variant."""

from __future__ import annotations

import pytest
import torch
from transformers import DeepseekV3Config, GPTJConfig, GPTNeoXConfig, LlamaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.deepseek_v3 import modeling_deepseek_v3 as hf_deepseek
from transformers.models.gpt_neox import modeling_gpt_neox as hf_neox
from transformers.models.gptj import modeling_gptj as hf_gptj
from transformers.models.llama import modeling_llama as hf_llama

from chunkstore.errors import LayoutError, UnsupportedRotaryError
from chunkstore.kv.remap import remap_keys
from chunkstore.kv.rope import RotaryConfig, inv_frequencies, rotation_table

EPS32 = 2.0**-24

LLAMA_VARIANTS = {
    "default": {"rope_type": "default", "rope_theta": 10000.0},
    "linear": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
    "llama3": {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    },
    "yarn": {
        "rope_type": "yarn",
        "rope_theta": 10000.0,
        "factor": 4.0,
        "original_max_position_embeddings": 2048,
    },
    "yarn-untruncated": {
        "rope_type": "yarn",
        "rope_theta": 1000000.0,
        "factor": 8.0,
        "beta_fast": 16,
        "beta_slow": 2,
        "original_max_position_embeddings": 1024,
        "truncate": False,
        "attention_factor": 1.3,
    },
}


def llama_config(params: dict, head_dim: int = 64) -> LlamaConfig:
    return LlamaConfig(
        hidden_size=head_dim * 4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=head_dim,
        max_position_embeddings=8192,
        rope_parameters=dict(params),
    )


def hf_llama_keys(config: LlamaConfig, raw: torch.Tensor, positions: torch.Tensor):
    """raw [tokens, heads, dim] rotated by transformers' Llama path at ``positions``."""
    rotary = hf_llama.LlamaRotaryEmbedding(config)
    cos, sin = rotary(raw, positions[None])
    k = raw.transpose(0, 1)[None]
    _, k_rot = hf_llama.apply_rotary_pos_emb(k, k, cos, sin)
    return k_rot[0].transpose(0, 1)


def angle_tolerance(max_position: int, keys: torch.Tensor) -> float:
    """Both sides round the angle p * f in float32; that error bounds the agreement."""
    return 8 * max_position * EPS32 * float(keys.abs().max()) + 1e-6


@pytest.mark.parametrize("name", list(LLAMA_VARIANTS))
def test_frequencies_match_transformers(name: str) -> None:
    config = llama_config(LLAMA_VARIANTS[name])
    cfg = RotaryConfig.from_hf_config(config)
    assert cfg.rope_type == LLAMA_VARIANTS[name]["rope_type"]
    rope_type = cfg.rope_type
    if rope_type == "default":
        expected, _ = hf_llama.LlamaRotaryEmbedding.compute_default_rope_parameters(config)
    else:
        expected, _ = ROPE_INIT_FUNCTIONS[rope_type](config, "cpu")
    torch.testing.assert_close(inv_frequencies(cfg), expected.float(), rtol=1e-6, atol=0)


def test_proportional_frequencies_match_transformers() -> None:
    params = {
        "rope_type": "proportional",
        "rope_theta": 10000.0,
        "partial_rotary_factor": 0.25,
        "factor": 2.0,
    }
    config = llama_config(params)
    cfg = RotaryConfig.from_hf_config(config)
    expected, _ = ROPE_INIT_FUNCTIONS["proportional"](config, "cpu")
    torch.testing.assert_close(inv_frequencies(cfg), expected.float(), rtol=1e-6, atol=0)


@pytest.mark.parametrize("name", list(LLAMA_VARIANTS))
@pytest.mark.parametrize(("virtual_start", "actual_start"), [(0, 300), (57, 13), (200, 200)])
def test_remap_equals_rotation_at_new_position(
    name: str, virtual_start: int, actual_start: int
) -> None:
    config = llama_config(LLAMA_VARIANTS[name])
    cfg = RotaryConfig.from_hf_config(config)
    torch.manual_seed(1)
    raw = torch.randn(40, 2, 64)
    at_v = hf_llama_keys(config, raw, torch.arange(virtual_start, virtual_start + 40))
    at_p = hf_llama_keys(config, raw, torch.arange(actual_start, actual_start + 40))
    remapped = remap_keys(at_v, actual_start - virtual_start, cfg)
    tol = angle_tolerance(max(virtual_start, actual_start) + 40, raw)
    torch.testing.assert_close(remapped, at_p, rtol=0, atol=tol)


def test_partial_rotary_neox_matches_gpt_neox() -> None:
    config = GPTNeoXConfig(
        hidden_size=256, num_attention_heads=4, rotary_pct=0.25, max_position_embeddings=4096
    )
    cfg = RotaryConfig.from_hf_config(config)
    assert (cfg.head_dim, cfg.rotary_dim) == (64, 16)
    torch.manual_seed(2)
    raw = torch.randn(30, 4, 64)
    rotary = hf_neox.GPTNeoXRotaryEmbedding(config)

    def at(start: int) -> torch.Tensor:
        cos, sin = rotary(raw, torch.arange(start, start + 30)[None])
        k = raw.transpose(0, 1)[None]
        return hf_neox.apply_rotary_pos_emb(k, k, cos, sin)[1][0].transpose(0, 1)

    remapped = remap_keys(at(5), 400 - 5, cfg)
    torch.testing.assert_close(remapped, at(400), rtol=0, atol=angle_tolerance(430, raw))
    torch.testing.assert_close(remapped[..., 16:], raw[..., 16:], rtol=0, atol=0)


def test_gptj_pairing_matches_gptj() -> None:
    config = GPTJConfig(n_embd=256, n_head=4, rotary_dim=32, n_positions=4096)
    cfg = RotaryConfig(head_dim=64, rotary_dim=config.rotary_dim, theta=10000.0, style="gptj")
    torch.manual_seed(3)
    raw = torch.randn(30, 4, 64)
    table = hf_gptj.create_sinusoidal_positions(1024, config.rotary_dim)

    def at(start: int) -> torch.Tensor:
        sincos = table[torch.arange(start, start + 30)][None]
        sin, cos = torch.split(sincos, config.rotary_dim // 2, dim=-1)
        rot = hf_gptj.apply_rotary_pos_emb(raw[None, ..., :32], sin, cos)[0]
        return torch.cat([rot, raw[..., 32:]], dim=-1)

    remapped = remap_keys(at(700), 20 - 700, cfg)
    torch.testing.assert_close(remapped, at(20), rtol=0, atol=angle_tolerance(730, raw))


def test_mla_decoupled_k_pe_matches_deepseek_v3() -> None:
    config = DeepseekV3Config(
        hidden_size=256,
        num_attention_heads=4,
        kv_lora_rank=128,
        qk_rope_head_dim=32,
        qk_nope_head_dim=32,
        v_head_dim=32,
        max_position_embeddings=16384,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 4.0,
            "original_max_position_embeddings": 4096,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
        },
    )
    cfg = RotaryConfig.from_hf_config(config)
    assert (cfg.head_dim, cfg.rotary_dim, cfg.rotary_offset) == (160, 32, 128)
    torch.manual_seed(4)
    compressed = torch.randn(25, 128)
    k_pe = torch.randn(25, 32)
    rotary = hf_deepseek.DeepseekV3RotaryEmbedding(config)

    def latent_at(start: int) -> torch.Tensor:
        cos, sin = rotary(k_pe, torch.arange(start, start + 25)[None])
        k = k_pe[None, None]
        rotated = hf_deepseek.apply_rotary_pos_emb_interleave(k, k, cos, sin)[1][0, 0]
        return torch.cat([compressed, rotated], dim=-1)

    remapped = remap_keys(latent_at(100), 1000 - 100, cfg)
    expected = latent_at(1000)
    torch.testing.assert_close(remapped, expected, rtol=0, atol=angle_tolerance(1025, k_pe))
    assert torch.equal(remapped[:, :128], compressed)


@pytest.mark.parametrize("style", ["neox", "gptj"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_rotating_by_d_then_minus_d_returns_input(style: str, dtype: torch.dtype) -> None:
    cfg = RotaryConfig(head_dim=64, rotary_dim=48, theta=10000.0, style=style)  # type: ignore[arg-type]
    torch.manual_seed(5)
    keys = torch.randn(64, 3, 64, dtype=dtype)
    deltas = torch.randint(-4096, 4096, (64,))
    back = remap_keys(remap_keys(keys, deltas, cfg), -deltas, cfg)
    assert float((back - keys).abs().max()) <= 1e-6 * float(keys.abs().max())


def test_in_place_rotation_equals_out_of_place() -> None:
    from chunkstore.kv.remap import rotate_keys

    cfg = RotaryConfig(head_dim=64, rotary_dim=64, theta=10000.0)
    keys = torch.randn(16, 2, 64)
    cos, sin = rotation_table(cfg, 33, 16)
    expected = rotate_keys(keys, cos, sin, cfg, out=torch.empty_like(keys))
    rotate_keys(keys, cos, sin, cfg)
    assert torch.equal(keys, expected)


def test_bf16_keys_are_rotated_in_float32() -> None:
    cfg = RotaryConfig(head_dim=64, rotary_dim=64, theta=10000.0)
    keys = torch.randn(32, 2, 64)
    exact = remap_keys(keys, 777, cfg)
    half = remap_keys(keys.bfloat16(), 777, cfg)
    assert half.dtype == torch.bfloat16
    torch.testing.assert_close(half.float(), exact, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize(
    "params",
    [
        {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0},
        {
            "rope_type": "longrope",
            "rope_theta": 10000.0,
            "short_factor": [1.0] * 32,
            "long_factor": [2.0] * 32,
            "original_max_position_embeddings": 2048,
        },
    ],
)
def test_length_dependent_variants_are_refused(params: dict) -> None:
    with pytest.raises(UnsupportedRotaryError) as info:
        RotaryConfig.from_hf_config(llama_config(params))
    assert info.value.rope_type == params["rope_type"]


def test_multimodal_and_unknown_rotary_are_refused() -> None:
    class Multimodal:
        rope_parameters = {"rope_type": "default", "rope_theta": 1e6, "mrope_section": [16, 24, 24]}
        head_dim = 128

    with pytest.raises(UnsupportedRotaryError, match="multimodal"):
        RotaryConfig.from_hf_config(Multimodal())
    with pytest.raises(UnsupportedRotaryError):
        RotaryConfig(head_dim=64, rotary_dim=64, theta=1e4, rope_type="su")


def test_layout_errors_are_typed() -> None:
    cfg = RotaryConfig(head_dim=64, rotary_dim=64, theta=1e4)
    with pytest.raises(LayoutError):
        remap_keys(torch.randn(4, 2, 32), 1, cfg)
    with pytest.raises(LayoutError):
        RotaryConfig(head_dim=64, rotary_dim=66, theta=1e4)
