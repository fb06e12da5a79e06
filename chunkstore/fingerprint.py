"""The fingerprints of a served model, computed the same way in every process that needs
them: the connector's scheduler and workers, ``chunkstore ingest``, tests."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from chunkstore.keys import KVLayout, model_fingerprint, weights_digest
from chunkstore.rope import RotaryConfig


@dataclass(frozen=True)
class ModelFingerprint:
    model_fp: bytes
    layout_fp: bytes
    rotary: RotaryConfig
    layout: KVLayout
    kv_dtype: str


def fingerprint(hf_config: Any, model: str | Path, kv_dtype: str) -> ModelFingerprint:
    """``model`` is the folder vLLM loads (its weights are hashed) or, for a hub name, the
    name itself; ``kv_dtype`` the dtype of the KV cache ("float32", "bfloat16", ...)."""
    rotary = RotaryConfig.from_hf_config(hf_config)
    path = Path(model)
    weights = weights_digest(path) if path.is_dir() else str(model)
    layout = KVLayout(
        num_layers=hf_config.num_hidden_layers,
        num_kv_heads=getattr(hf_config, "num_key_value_heads", None)
        or hf_config.num_attention_heads,
        head_dim=rotary.head_dim,
    )
    return ModelFingerprint(
        model_fingerprint(weights, kv_dtype, rotary), layout.fingerprint(), rotary, layout, kv_dtype
    )


def fingerprint_of_folder(model_dir: str | Path, kv_dtype: str) -> ModelFingerprint:
    from transformers import AutoConfig

    return fingerprint(AutoConfig.from_pretrained(model_dir), model_dir, kv_dtype)
