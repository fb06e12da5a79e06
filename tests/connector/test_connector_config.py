"""The connector's settings (``kv_connector_extra_config``) and the deployments it refuses."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from chunkstore_vllm.config import ConnectorConfig, unsupported_parallelism


def test_settings_come_from_the_extra_config_and_typos_are_refused() -> None:
    config = ConnectorConfig.from_extra({"address": "unix:/tmp/x.sock", "isolation": "none"})
    assert config.daemon_address == "unix:/tmp/x.sock" and config.overlap_layers
    with pytest.raises(ValueError, match="unknown kv_connector_extra_config keys"):
        ConnectorConfig.from_extra({"adress": "unix:/tmp/x.sock"})
    with pytest.raises(ValueError):
        ConnectorConfig.from_extra({"isolation": "chunk"})
    with pytest.raises(ValueError, match="transport"):
        ConnectorConfig.from_extra({"transport": "rdma"})


def parallel(**sizes: int) -> SimpleNamespace:
    defaults = {
        "tensor_parallel_size": 1,
        "pipeline_parallel_size": 1,
        "prefill_context_parallel_size": 1,
        "decode_context_parallel_size": 1,
    }
    return SimpleNamespace(parallel_config=SimpleNamespace(**{**defaults, **sizes}))


def test_context_and_pipeline_parallelism_keep_the_connector_off() -> None:
    assert unsupported_parallelism(parallel()) is None
    assert unsupported_parallelism(parallel(tensor_parallel_size=4)) is None
    for name in (
        "decode_context_parallel_size",
        "prefill_context_parallel_size",
        "pipeline_parallel_size",
    ):
        reason = unsupported_parallelism(parallel(**{name: 2}))
        assert reason is not None and name in reason
