"""A model whose rotary the connector cannot remap (a length-dependent variant; before
per-layer rotary, Gemma 3's two bases) starts with chunk loads off, said and counted, and its
exact prefix blocks still shared: both sides build the same key space, no exception reaches
vLLM. (No vLLM here: its config is stood in for by the fields the connector reads.)"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
from transformers import LlamaConfig

from chunkstore.connector_config import ConnectorConfig
from chunkstore.errors import UnsupportedRotaryError
from chunkstore.kv.fingerprint import fingerprint
from chunkstore_vllm.keys import ModelKeys
from chunkstore_vllm.scheduler import SchedulerSide
from chunkstore_vllm.worker import WorkerSide

SEPARATOR = 7


def llama(rope: dict[str, Any]) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=64,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rope_parameters=rope,
    )


def deployment(hf_config: LlamaConfig) -> Any:
    return SimpleNamespace(
        model_config=SimpleNamespace(
            hf_config=hf_config, model="tiny-dynamic", tokenizer="", dtype="float32"
        ),
        cache_config=SimpleNamespace(cache_dtype="auto", block_size=16),
        parallel_config=SimpleNamespace(tensor_parallel_size=1),
        kv_transfer_config=SimpleNamespace(kv_role="kv_both"),
    )


DYNAMIC = {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}
CONFIG = ConnectorConfig(address="unix:/nonexistent/cs.sock", separator=[SEPARATOR])


def test_the_rotary_is_one_the_connector_cannot_remap() -> None:
    with pytest.raises(UnsupportedRotaryError):
        fingerprint(llama(DYNAMIC), "tiny-dynamic", "float32")


def test_both_sides_start_with_the_same_key_space_and_the_refusal(
    caplog: pytest.LogCaptureFixture,
) -> None:
    vllm_config = deployment(llama(DYNAMIC))
    with caplog.at_level("INFO", "chunkstore.connector"):
        scheduler = SchedulerSide(vllm_config, CONFIG)
        worker = WorkerSide(vllm_config, CONFIG)
    assert scheduler.keys == worker.keys
    assert "dynamic" in scheduler.keys.rotary_refused
    errors = [r for r in caplog.records if r.levelname == "ERROR"]
    assert len(errors) == 1
    assert "tiny-dynamic" in errors[0].getMessage() and "chunk loads are off" in (
        errors[0].getMessage()
    )


def test_a_refused_model_never_shares_a_fingerprint_with_a_remappable_one() -> None:
    refused = ModelKeys.from_vllm(deployment(llama(DYNAMIC)), CONFIG).fingerprint
    default = {"rope_type": "default", "rope_theta": 10000.0}
    served = ModelKeys.from_vllm(deployment(llama(default)), CONFIG).fingerprint
    assert not served.refused and refused.refused
    assert refused.model_fp != served.model_fp
    assert refused.layout == served.layout  # the KV's shape is the model's all the same


def test_a_chunked_prompt_is_served_as_a_plain_one_its_prefix_blocks_shared() -> None:
    scheduler = SchedulerSide(deployment(llama(DYNAMIC)), CONFIG)
    prompt = [1, 2, 3, SEPARATOR, *range(10, 40), SEPARATOR, 4, 5] * 10  # 340 tokens
    request = SimpleNamespace(request_id="r", prompt_token_ids=prompt, cache_salt=None)
    tracked = scheduler._track(request)  # type: ignore[arg-type]
    assert tracked is not None and not tracked.chunked  # no chunk looked up, loaded or stored
    assert [p.tokens for p in tracked.cacheable] == [256]  # its exact prefix block
    assert scheduler.stats.data["rotary_refused_prompts"] == 1
    plain = SimpleNamespace(request_id="p", prompt_token_ids=[1, 2, 3] * 100, cache_salt=None)
    scheduler._track(plain)  # type: ignore[arg-type]
    assert scheduler.stats.data["rotary_refused_prompts"] == 1  # only prompts with a separator
