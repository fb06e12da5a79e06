"""The fingerprints of a served model, computed the same way in every process that needs
them: the connector's scheduler and workers, ``chunkstore ingest``, tests."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import xxhash

from chunkstore.errors import UnsupportedRotaryError
from chunkstore.kv.keys import (
    KVLayout,
    layered_model_fingerprint,
    length_prefixed,
    model_fingerprint,
    unremappable_fingerprint,
)
from chunkstore.kv.layer_rotary import LayerRotary
from chunkstore.kv.rope import RotaryConfig


def weights_digest(model_dir: str | Path) -> str:
    """Identity of a model's weights: xxh3-128 over its config and weight files, in name order."""
    root = Path(model_dir)
    names = ("config.json", "*.safetensors", "*.bin", "*.gguf")
    files = sorted({p for pattern in names for p in root.glob(pattern)})
    if not files:
        raise FileNotFoundError(f"no config or weight files in {root}")
    h = xxhash.xxh3_128()
    for path in files:
        h.update(length_prefixed(path.name.encode()))
        with path.open("rb") as f:
            while block := f.read(1 << 22):
                h.update(block)
    return h.hexdigest()


@dataclass(frozen=True)
class ModelFingerprint:
    model_fp: bytes
    layout_fp: bytes
    rotary: RotaryConfig
    layout: KVLayout
    kv_dtype: str
    # Why keys cannot be re-rotated for this model ("": they can). Then ``rotary`` is a
    # stand-in that must rotate nothing: only exact prefix entries, never moved, are served.
    refused: str = ""
    # Each layer's rotary and window (None: ``rotary`` in every layer, no window). With
    # several kinds, ``rotary`` is layer 0's: what rotates keys must take each layer's.
    layers: LayerRotary | None = None

    @classmethod
    def of(
        cls,
        weights_id: str,
        kv_dtype: str,
        rotary: RotaryConfig,
        layout: KVLayout,
        layers: LayerRotary | None = None,
    ) -> ModelFingerprint:
        """The fingerprints of weights ``weights_id`` whose KV has this dtype, rotary set-up
        (``layers``: per layer, with the windows) and layout."""
        if layers is not None and not layers.uniform:  # every layer's rotary and window
            model_fp = layered_model_fingerprint(weights_id, kv_dtype, layers.describe())
            rotary = layers.layer(0)
        else:
            model_fp = model_fingerprint(weights_id, kv_dtype, rotary)
        return cls(model_fp, layout.fingerprint(), rotary, layout, kv_dtype, "", layers)

    @property
    def layer_rotary(self) -> LayerRotary:
        """Each layer's rotary and window."""
        if self.layers is not None:
            return self.layers
        count = self.layout.num_layers
        return LayerRotary((self.rotary,), (0,) * count, (0,) * count)


def fingerprint(hf_config: Any, model: str | Path, kv_dtype: str) -> ModelFingerprint:
    """``model`` is the folder vLLM loads (its weights are hashed) or, for a hub name, the
    name itself; ``kv_dtype`` the dtype of the KV cache ("float32", "bfloat16", ...)."""
    layers, layout = layer_kv_shape(hf_config)
    path = Path(model)
    weights = weights_digest(path) if path.is_dir() else str(model)
    return ModelFingerprint.of(weights, kv_dtype, layers.layer(0), layout, layers)


def unremappable(hf_config: Any, model: str | Path, kv_dtype: str, reason: str) -> ModelFingerprint:
    """The fingerprints of a model whose rotary cannot be remapped (``reason``): its model
    fingerprint hashes the config's raw rotary settings (never equal to a remappable one's),
    its ``rotary`` a stand-in over the whole head that nothing may rotate with."""
    head_dim = getattr(hf_config, "head_dim", None) or (
        hf_config.hidden_size // hf_config.num_attention_heads
    )
    layout = KVLayout(
        num_layers=hf_config.num_hidden_layers,
        num_kv_heads=getattr(hf_config, "num_key_value_heads", None)
        or hf_config.num_attention_heads,
        head_dim=head_dim,
    )
    raw = {name: getattr(hf_config, name, None) for name in RAW_ROTARY_FIELDS}
    path = Path(model)
    weights = weights_digest(path) if path.is_dir() else str(model)
    model_fp = unremappable_fingerprint(weights, kv_dtype, raw)
    stand_in = RotaryConfig(head_dim, head_dim, 10000.0)
    return ModelFingerprint(model_fp, layout.fingerprint(), stand_in, layout, kv_dtype, reason)


# What an unremappable model's fingerprint hashes of its config.
RAW_ROTARY_FIELDS = (
    "rope_parameters",
    "rope_scaling",
    "rope_theta",
    "rope_local_base_freq",
    "partial_rotary_factor",
    "layer_types",
    "sliding_window",
    "sliding_window_pattern",
)


def kv_shape(hf_config: Any) -> tuple[RotaryConfig, KVLayout]:
    """The rotary set-up and the KV layout of a model whose layers share one rotary (a model
    with several kinds is refused: its callers need ``layer_kv_shape``)."""
    layers, layout = layer_kv_shape(hf_config)
    if len(layers.kinds) > 1:
        raise UnsupportedRotaryError("per-layer", "layers use different rotary settings")
    return layers.kinds[0], layout


def layer_kv_shape(hf_config: Any) -> tuple[LayerRotary, KVLayout]:
    """Each layer's rotary and window, and the KV layout of a fingerprint, from the config
    alone: what ``chunkstore doctor`` checks in seconds, whatever the size of the weights."""
    if is_mla(hf_config):
        # One latent a token, [compressed KV | k_pe], shared by every head; vLLM rotates k_pe
        # in GPT-J pairs (vllm/model_executor/models/deepseek_v2.py: is_neox_style=False).
        rotary = RotaryConfig.from_hf_config(hf_config, "gptj")
        count = hf_config.num_hidden_layers
        layers = LayerRotary((rotary,), (0,) * count, (0,) * count)
        return layers, KVLayout(count, 1, rotary.head_dim, "mla")
    layers = LayerRotary.from_hf_config(hf_config)
    layout = KVLayout(
        num_layers=hf_config.num_hidden_layers,
        num_kv_heads=getattr(hf_config, "num_key_value_heads", None)
        or hf_config.num_attention_heads,
        head_dim=layers.kinds[0].head_dim,
    )
    return layers, layout


def is_mla(hf_config: Any) -> bool:
    """Whether the model attends through multi-head latent attention (DeepSeek V2 / V3):
    its cache holds one latent a token instead of K and V per head."""
    return bool(getattr(hf_config, "kv_lora_rank", None)) and bool(
        getattr(hf_config, "qk_rope_head_dim", None)
    )


def fingerprint_of_folder(model_dir: str | Path, kv_dtype: str) -> ModelFingerprint:
    from transformers import AutoConfig

    return fingerprint(AutoConfig.from_pretrained(model_dir), model_dir, kv_dtype)
