"""Loads rotate each layer with its own rotary: a chunk computed alone at one position and
loaded at another, through the worker's own layer write (``Loads._write_layer``, the fused
rotate-and-write into vLLM's CPU cache layout), is the chunk's KV computed at the new position
by HF transformers in fp32, in every layer. On Gemma 3 (sliding layers at base 1e4, global ones
at 1e6, QK-norm, window 32) also in the sliding layers, whose keys depend on the window only
through the attention that made them, the same wherever the chunk stands; chunks shorter and
longer than the window, moved to positions before and past it. And on Qwen3 (QK-norm, one
rotary)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM, DynamicCache

from chunkstore.kv.fingerprint import fingerprint
from chunkstore.models import model_dir
from chunkstore.reference import relative_error
from chunkstore_vllm.cpu_layout import CpuKVLayout
from chunkstore_vllm.loads import Fetched, Loads

TOLERANCE = 1e-5  # as tests/kv/test_exactness.py for Llama and Qwen2
BLOCK_SIZE, BLOCKS = 16, 40


@pytest.fixture(scope="module", params=["tiny-gemma3", "tiny-qwen3"])
def model(request: pytest.FixtureRequest) -> Any:
    folder = model_dir(request.param)
    hf = AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float32, attn_implementation="eager"
    )
    return hf.eval(), fingerprint(hf.config, folder, "float32").layer_rotary


@torch.no_grad()
def computed_at(hf: Any, tokens: torch.Tensor, start: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The chunk's K and V computed alone at positions start.. ([layers, tokens, heads,
    head_dim]); HF's own causal and sliding-window masks, a cache that keeps every token."""
    out = hf(
        input_ids=tokens[None],
        position_ids=torch.arange(start, start + len(tokens))[None],
        past_key_values=DynamicCache(),
        use_cache=True,
    )
    keys = torch.stack([k[0].transpose(0, 1) for k, _, _ in out.past_key_values])
    values = torch.stack([v[0].transpose(0, 1) for _, v, _ in out.past_key_values])
    return keys, values


def loaded_at(layers: Any, keys: torch.Tensor, values: torch.Tensor, delta: int) -> torch.Tensor:
    """``keys`` and ``values`` written by the worker's layer write, moved by ``delta``; the
    keys read back out of the cache."""
    num_layers, tokens, heads, dim = keys.shape
    access = CpuKVLayout(
        SimpleNamespace(compilation_config=SimpleNamespace(static_forward_context={})),
        BLOCK_SIZE,
    )
    caches = [torch.zeros(BLOCKS, heads, BLOCK_SIZE, 2 * dim) for _ in range(num_layers)]
    assert access.probe("layer.0", caches[0]) and access.plain  # the fused kernel writes
    slots = torch.arange(BLOCK_SIZE, BLOCK_SIZE + tokens)  # past block 0 (vLLM's null)
    worker = SimpleNamespace(
        cache=SimpleNamespace(
            layers=[(f"layer.{i}", c) for i, c in enumerate(caches)], access=access
        ),
        keys=SimpleNamespace(layers=layers),
    )
    rotations = layers.tables(delta, tokens) if delta else None
    entry = Fetched(None, None, keys, values, rotations, slots)  # type: ignore[arg-type]
    for layer in range(num_layers):
        Loads._write_layer(worker, entry, layer)  # type: ignore[arg-type]
    return torch.stack([CpuKVLayout.read(c, slots)[0] for c in caches])


# (chunk tokens, computed at, loaded at): window 32 on Gemma 3
MOVES = [(20, 0, 100), (20, 64, 3), (80, 0, 150), (80, 200, 7), (80, 5, 1000)]


@pytest.mark.parametrize(("tokens", "virtual", "actual"), MOVES)
def test_a_chunk_loaded_elsewhere_is_its_kv_computed_there(
    model: Any, tokens: int, virtual: int, actual: int
) -> None:
    hf, layers = model
    chunk = torch.randint(3, 600, (tokens,), generator=torch.Generator().manual_seed(tokens))
    keys, values = computed_at(hf, chunk, virtual)
    expected, _ = computed_at(hf, chunk, actual)
    loaded = loaded_at(layers, keys, values, actual - virtual)
    errors = [relative_error(loaded[i], expected[i]) for i in range(len(loaded))]
    assert max(errors) < TOLERANCE, errors
    unmoved = [relative_error(keys[i], expected[i]) for i in range(len(keys))]
    assert min(unmoved) > 1e-2  # every layer's keys did move


def test_gemma3_layers_have_two_rotaries_and_windows() -> None:
    """What the load above exercises: two kinds, and one base everywhere would be wrong."""
    config = AutoModelForCausalLM.from_pretrained(model_dir("tiny-gemma3")).config
    layers = fingerprint(config, "tiny-gemma3", "float32").layer_rotary
    assert [k.theta for k in layers.kinds] == [1e4, 1e6]
    assert layers.of_layer == (0, 0, 1, 0, 0, 1)
    assert layers.windows == (32, 32, 0, 32, 32, 0)
