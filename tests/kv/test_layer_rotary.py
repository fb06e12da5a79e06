"""Rotary per layer kind (``chunkstore.kv.layer_rotary``): Gemma 3's two bases read from
transformers 5's ``rope_parameters`` by layer type and from a transformers-4 config alike, a
layout that cannot be read refused (never one theta for every layer), and the model
fingerprint keyed by every layer's rotary and window."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace
from typing import Any

import pytest
from transformers import Gemma3TextConfig, LlamaConfig

from chunkstore.connector_config import ConnectorConfig
from chunkstore.errors import UnsupportedRotaryError
from chunkstore.kv.fingerprint import fingerprint, kv_shape
from chunkstore.kv.keys import model_fingerprint
from chunkstore.kv.layer_rotary import LayerRotary
from chunkstore.models import model_dir
from chunkstore_vllm.config import for_deployment
from chunkstore_vllm.doctor.stages import support

SLIDING, FULL = "sliding_attention", "full_attention"
SIZES = dict(
    num_hidden_layers=6,
    hidden_size=128,
    num_attention_heads=4,
    num_key_value_heads=1,
    head_dim=64,
    max_position_embeddings=4096,
)


def gemma3(**changes: Any) -> Gemma3TextConfig:
    settings: dict[str, Any] = dict(
        **SIZES,
        layer_types=[SLIDING, SLIDING, FULL] * 2,
        sliding_window=32,
        rope_parameters={
            SLIDING: {"rope_type": "default", "rope_theta": 10000.0},
            FULL: {"rope_type": "default", "rope_theta": 1000000.0},
        },
    )
    return Gemma3TextConfig(**{**settings, **changes})


def legacy_gemma3(**changes: Any) -> SimpleNamespace:
    """A transformers-4 Gemma 3 config: two top-level bases and the sliding pattern."""
    settings: dict[str, Any] = dict(
        **SIZES,
        rope_theta=1000000.0,
        rope_local_base_freq=10000.0,
        rope_scaling=None,
        sliding_window=32,
        sliding_window_pattern=3,
    )
    return SimpleNamespace(**{**settings, **changes})


def test_each_layer_gets_its_types_rotary_and_window() -> None:
    layers = LayerRotary.from_hf_config(gemma3())
    assert [k.theta for k in layers.kinds] == [1e4, 1e6]
    assert [layers.layer(i).theta for i in range(6)] == [1e4, 1e4, 1e6] * 2
    assert layers.windows == (32, 32, 0) * 2 and not layers.uniform


def test_a_transformers_4_config_reads_as_its_transformers_5_form() -> None:
    assert LayerRotary.from_hf_config(legacy_gemma3()) == LayerRotary.from_hf_config(gemma3())
    assert (
        fingerprint(legacy_gemma3(), "w", "float32").model_fp
        == fingerprint(gemma3(), "w", "float32").model_fp
    )
    linear = {"rope_type": "linear", "factor": 8.0}  # Gemma 3 4B+: global layers scaled
    layers = LayerRotary.from_hf_config(legacy_gemma3(rope_scaling=linear))
    assert layers.layer(2).rope_type == "linear" and layers.layer(0).rope_type == "default"


@pytest.mark.parametrize(
    ("config", "why"),
    [
        (legacy_gemma3(sliding_window_pattern=None), "no layer types"),
        (
            legacy_gemma3(
                layer_types=[SLIDING, SLIDING, FULL] * 2,
                rope_parameters={SLIDING: {"rope_theta": 1e4}},
            ),
            "no entry",
        ),
        (legacy_gemma3(layer_types=[SLIDING, "chunked"] * 3), "unknown layer types"),
    ],
    ids=["local-base-without-pattern", "type-without-rotary", "unknown-type"],
)
def test_a_layout_it_cannot_read_is_refused_not_served_with_one_theta(config, why) -> None:
    with pytest.raises(UnsupportedRotaryError, match=why):
        fingerprint(config, "w", "float32")


def test_the_fingerprint_tells_windows_patterns_and_bases_apart() -> None:
    def model_fp(config: Any) -> bytes:
        return fingerprint(config, "w", "float32").model_fp

    base = model_fp(gemma3())
    assert model_fp(gemma3(sliding_window=64)) != base
    assert model_fp(gemma3(layer_types=[SLIDING, FULL, FULL] * 2)) != base
    rope = {k: {"rope_type": "default", "rope_theta": 1e4} for k in (SLIDING, FULL)}
    assert model_fp(gemma3(rope_parameters=rope)) != base  # one base, still windows


def test_a_model_with_one_rotary_keeps_its_fingerprint() -> None:
    llama = LlamaConfig(**SIZES, rope_parameters={"rope_type": "default", "rope_theta": 1e5})
    fp = fingerprint(llama, "w", "float32")
    assert fp.layer_rotary.uniform
    assert fp.model_fp == model_fingerprint("w", "float32", kv_shape(llama)[0])


def test_callers_of_a_single_rotary_refuse_several() -> None:
    with pytest.raises(UnsupportedRotaryError, match="per-layer"):
        kv_shape(legacy_gemma3())  # transformers 4: was read as theta 1e6 for every layer


def test_doctor_reports_each_kind() -> None:
    checks, _ = support(model_dir("tiny-gemma3"))
    (rotary,) = [c for c in checks if c.name == "rotary"]
    assert rotary.ok and "layers 0,1,3,4 (window 32): default, theta 10000" in rotary.detail
    assert "layers 2,5 (no window): default, theta 1e+06" in rotary.detail


def test_the_hook_serves_windowed_layers_without_what_attends_elsewhere() -> None:
    """The hook rotates each layer with its own rotary and passes each layer's window to
    vLLM's kernel; what attends chunks where they do not stand in the cache (relevant_last
    moves, recompute, question re-weighting, gap filling) and sparse reads (one rotary) are
    off for a windowed model, and the whole hook with a ``virtual_gap`` (its window counts
    positions from sys)."""

    def deployment(hf_config: Any) -> Any:
        return SimpleNamespace(
            model_config=SimpleNamespace(hf_config=hf_config),
            parallel_config=SimpleNamespace(),
            device_config=SimpleNamespace(device_type="cpu"),
        )

    config = ConnectorConfig.from_extra({"sparse_threshold": 0.5})
    served = for_deployment(config, deployment(gemma3()))
    assert served.inband_isolation and not served.fill_gaps and not served.sparse_threshold
    assert served.quality.relevant_last == 0
    assert served.quality.recompute_tokens == served.quality.recompute_chunks == 0
    assert not served.quality.reweights_questions
    gap = ConnectorConfig(virtual_gap=8)
    assert not for_deployment(gap, deployment(gemma3())).inband_isolation
    served = for_deployment(config, deployment(LlamaConfig(**SIZES)))
    assert served.back_end.inband and dataclasses.replace(served, decided=None) == config
