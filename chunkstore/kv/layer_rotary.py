"""Rotary per layer kind: models whose layers rotate keys differently (Gemma 3: sliding-window
layers at base 1e4, global ones at 1e6) are remapped layer by layer, each with its own
frequencies (``rope``); a model with one rotary has one kind.

A layer's kind is read from transformers 5's ``layer_types`` with ``rope_parameters`` keyed by
layer type, or from a transformers-4 Gemma 3 config (``rope_theta`` for global layers,
``rope_local_base_freq`` for sliding ones, every ``sliding_window_pattern``-th layer global).
A layout it cannot read is refused (``UnsupportedRotaryError``), never served with one theta.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

import torch

from chunkstore.errors import UnsupportedRotaryError
from chunkstore.kv.rope import RotaryConfig, RotaryStyle, rotation_table

SLIDING = "sliding_attention"
FULL = "full_attention"

Rotation = tuple[torch.Tensor, torch.Tensor]  # cos, sin


@dataclass(frozen=True)
class LayerRotary:
    """``kinds``: each distinct rotary; ``of_layer``: each layer's index into them;
    ``windows``: each layer's sliding window in tokens (0: it attends everything)."""

    kinds: tuple[RotaryConfig, ...]
    of_layer: tuple[int, ...]
    windows: tuple[int, ...]

    @property
    def uniform(self) -> bool:
        """One rotary and no window: keyed exactly as before layers had kinds."""
        return len(self.kinds) == 1 and not any(self.windows)

    @classmethod
    def single(cls, rotary: RotaryConfig) -> LayerRotary:
        """One rotary for every layer, however many (no layer list: never fingerprinted)."""
        return cls((rotary,), (), ())

    def kind(self, index: int) -> int:
        """Layer ``index``'s rotary, as an index into ``kinds``."""
        return self.of_layer[index] if self.of_layer else 0

    def layer(self, index: int) -> RotaryConfig:
        return self.kinds[self.kind(index)]

    def window(self, index: int) -> int:
        """Layer ``index``'s sliding window (0: it attends everything)."""
        return self.windows[index] if self.windows else 0

    def tables(
        self, delta: int, num_tokens: int, device: torch.device | str = "cpu"
    ) -> tuple[Rotation, ...]:
        """One rotation table per kind (``rope.rotation_table``), indexed as ``kinds``."""
        return tuple(rotation_table(kind, delta, num_tokens, device) for kind in self.kinds)

    def describe(self) -> str:
        """What the model fingerprint hashes: every layer's rotary and window, in order."""
        layers = [
            {"rotary": asdict(self.layer(i)), "window": self.windows[i]}
            for i in range(len(self.of_layer))
        ]
        return json.dumps(layers, sort_keys=True, default=str)

    @classmethod
    def from_hf_config(cls, config: Any, style: RotaryStyle = "neox") -> LayerRotary:
        layers = int(config.num_hidden_layers)
        params = getattr(config, "rope_parameters", None) or {}
        per_type = bool(params) and all(isinstance(v, Mapping) for v in params.values())
        local_base = getattr(config, "rope_local_base_freq", None)
        if not per_type and local_base is None:  # one rotary for every layer
            rotary = RotaryConfig.from_hf_config(config, style)
            return cls((rotary,), (0,) * layers, _windows(config, _layer_types(config, layers)))
        types = _layer_types(config, layers)
        if types is None:
            raise UnsupportedRotaryError(
                "per-layer", "rotary differs by layer, and the config names no layer types"
            )
        if per_type:
            missing = sorted(set(types) - set(params))
            if missing:
                raise UnsupportedRotaryError(
                    "per-layer", f"rope_parameters has no entry for layer types {missing}"
                )
            by_type = {t: dict(params[t]) for t in dict.fromkeys(types)}
        else:  # transformers 4: rope_theta (+ rope_scaling) global, rope_local_base_freq local
            global_params = {**(getattr(config, "rope_scaling", None) or {})}
            global_params.setdefault("rope_theta", getattr(config, "rope_theta", None))
            local = {"rope_type": "default", "rope_theta": local_base}
            by_type = {FULL: global_params, SLIDING: local}
            unknown = sorted(set(types) - set(by_type))
            if unknown:
                raise UnsupportedRotaryError("per-layer", f"unknown layer types {unknown}")
        kinds: list[RotaryConfig] = []
        index: dict[str, int] = {}
        for layer_type in dict.fromkeys(types):
            rotary = RotaryConfig.from_hf_config(_OneLayerType(config, by_type[layer_type]), style)
            if rotary not in kinds:
                kinds.append(rotary)
            index[layer_type] = kinds.index(rotary)
        return cls(tuple(kinds), tuple(index[t] for t in types), _windows(config, types))


def _layer_types(config: Any, layers: int) -> list[str] | None:
    """Each layer's type: ``layer_types``, else the Gemma 3 pattern (every
    ``sliding_window_pattern``-th layer global), else None."""
    types = getattr(config, "layer_types", None)
    if types is not None:
        if len(types) != layers:
            raise UnsupportedRotaryError(
                "per-layer", f"{len(types)} layer types for {layers} layers"
            )
        return [str(t) for t in types]
    pattern = getattr(config, "sliding_window_pattern", None) or getattr(
        config, "_sliding_window_pattern", None
    )
    if not pattern:
        return None
    return [FULL if (i + 1) % int(pattern) == 0 else SLIDING for i in range(layers)]


def _windows(config: Any, types: list[str] | None) -> tuple[int, ...]:
    """Each layer's sliding window (0: none), from its type: a config that names no types
    keeps the windows out of its fingerprint, as before layers had kinds."""
    layers = int(config.num_hidden_layers)
    if types is None:
        return (0,) * layers
    window = int(getattr(config, "sliding_window", None) or 0)
    if any(t == SLIDING for t in types) and not window:
        raise UnsupportedRotaryError("per-layer", "sliding layers without a sliding_window")
    return tuple(window if t == SLIDING else 0 for t in types)


class _OneLayerType:
    """``config`` as one layer type sees it: its own rotary parameters, nothing else's."""

    def __init__(self, config: Any, params: dict[str, Any]) -> None:
        self._config = config
        self.rope_parameters = params
        self.rope_scaling = None
        self.rope_local_base_freq = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self._config, name)
