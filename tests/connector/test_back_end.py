"""The back end decides the in-band hook once, at configuration (``config.for_deployment``):
on a CUDA or an Ascend (NPU) deployment, default settings give a connector with the hook off
whose scheduler plans no move, no recompute and no hook work (what the router's order
expects: the relevant chunks standing last left to vLLM), said once in the scheduler's log;
vLLM's CPU back end keeps the hook. (No GPU here: vLLM's config is stood in for by the fields
the connector reads, the device named as vLLM's ``device_config.device_type`` names it.)"""

from __future__ import annotations

import logging
from types import SimpleNamespace
from typing import Any

import pytest
from transformers import LlamaConfig

from chunkstore.connector_config import ConnectorConfig
from chunkstore.kv.segments import SegmentKind
from chunkstore_vllm.config import for_deployment
from chunkstore_vllm.scheduler import SchedulerSide

SEPARATOR = 7
SYS = [1, 2, 3]
# Chunk 1 holds the question's 42s: the relevant one. Long enough to be stored (``min``).
CHUNKS = [[10, 11, 12, 13] * 4, [20, 42, 42, 21] * 4, [30, 31, 32, 33] * 4]
QUESTION = [42, 5]


def fake_vllm_config(device: str) -> Any:
    """A stand-in for vLLM's config (a fake: only the fields the connector reads), the
    model a 2-layer Llama, on ``device``."""
    hf_config = LlamaConfig(
        vocab_size=64,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
    )
    return SimpleNamespace(
        model_config=SimpleNamespace(
            hf_config=hf_config,
            model="tiny-llama",
            tokenizer="",
            dtype="float32",
            architectures=["LlamaForCausalLM"],
        ),
        cache_config=SimpleNamespace(cache_dtype="auto", block_size=16),
        parallel_config=SimpleNamespace(tensor_parallel_size=1),
        kv_transfer_config=SimpleNamespace(kv_role="kv_both"),
        device_config=SimpleNamespace(device_type=device),
    )


def prompt(chunks: list[list[int]]) -> list[int]:
    ids = list(SYS)
    for chunk in chunks:
        ids += [SEPARATOR, *chunk]
    return [*ids, SEPARATOR, *QUESTION]


def scheduler_on(device: str, extra: dict[str, Any] | None = None) -> SchedulerSide:
    """The scheduler side as the connector builds it: the settings from the extra config,
    narrowed once by ``for_deployment``."""
    asked = ConnectorConfig.from_extra(
        {"address": "unix:/nonexistent/cs.sock", "separator": [SEPARATOR], **(extra or {})}
    )
    vllm_config = fake_vllm_config(device)
    return SchedulerSide(vllm_config, for_deployment(asked, vllm_config))


def planned(scheduler: SchedulerSide, ids: list[int]) -> Any:
    """What the scheduler plans for a request of ``ids``: its tracked state, and the hook's
    work in the step that computes the whole prompt (None: none)."""
    request = SimpleNamespace(
        request_id="r", prompt_token_ids=ids, cache_salt=None, kv_transfer_params=None
    )
    tracked = scheduler._track(request)
    assert tracked is not None and tracked.chunked
    return tracked, scheduler._isolated_step(tracked, 0, len(ids))


@pytest.mark.parametrize("device", ["cuda", "npu"])
def test_a_gpu_or_npu_deployment_plans_no_hook_work_by_default(device: str) -> None:
    scheduler = scheduler_on(device)
    assert not scheduler.back_end.inband and not scheduler.back_end.recompute
    assert not scheduler.fills_gaps
    # The relevant chunk in the middle: loaded as stored, nothing moves or is recomputed.
    tracked, step = planned(scheduler, prompt(CHUNKS))
    assert (tracked.shifts, tracked.recomputed, tracked.first_tokens, step) == ((), {}, 0, None)
    assert scheduler.stats.data.get("moved_chunks", 0) == 0
    assert scheduler.stats.data.get("recomputed_chunks", 0) == 0
    # Sent as the router orders it (the relevant chunk last): vLLM computes it, after the
    # run before it loads; only that run is looked up.
    sent = prompt([CHUNKS[0], CHUNKS[2], CHUNKS[1]])
    scheduler.request_finished(SimpleNamespace(request_id="r"))
    tracked, step = planned(scheduler, sent)
    last = [s for s in tracked.segments if s.kind is SegmentKind.CHUNK][-1]
    assert last.token_ids[: len(CHUNKS[1])] == tuple(CHUNKS[1])  # (its separator after)
    assert tracked.causal_start == last.start
    assert all(plan.segment.end <= last.start for plan in tracked.cacheable)
    assert step is None


def test_vllm_s_cpu_back_end_keeps_the_hook() -> None:
    scheduler = scheduler_on("cpu")
    assert scheduler.back_end.inband and scheduler.back_end.recompute
    tracked, step = planned(scheduler, prompt(CHUNKS))
    # The relevant chunk (segment 2) is attended last and recomputed there: the hook's work.
    assert tracked.shifts and 2 in tracked.recomputed
    assert step is not None and step.moves and step.recompute
    # Asked off, it is off on the CPU too.
    assert not scheduler_on("cpu", {"inband_isolation": False}).back_end.inband


def test_the_decision_is_said_once_with_the_router_s_part(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The scheduler's connector logs it (``for_deployment``'s ``say``), the workers' do
    not; settings that act only in the hook are named as off."""
    asked = ConnectorConfig.from_extra({"recompute_tokens": 8})
    log = logging.getLogger("chunkstore.test")
    with caplog.at_level(logging.INFO, logger="chunkstore.test"):
        served = for_deployment(asked, fake_vllm_config("cuda"), log)
        for_deployment(asked, fake_vllm_config("cuda"))  # a worker's: nothing said
    assert not served.back_end.inband
    [said] = [r.getMessage() for r in caplog.records]
    assert "in-band isolation is off (the cuda attention back end" in said
    assert "chunkstore router" in said and "off with the hook: recompute_tokens" in said
    with caplog.at_level(logging.INFO, logger="chunkstore.test"):
        caplog.clear()
        assert for_deployment(asked, fake_vllm_config("cpu"), log).back_end.inband
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
