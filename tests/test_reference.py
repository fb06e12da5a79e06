"""The HF reference on a model whose layers differ (tiny-gemma3: sliding layers of window 32
at RoPE base 1e4, global ones at 1e6): its forward is HF's own (HF's sliding masks) though
it passes explicit masks, and keys it moves are the keys HF computes where they move to,
each layer with its own base."""

from __future__ import annotations

import pytest
import torch

from chunkstore.errors import UnsupportedRotaryError
from chunkstore.models import model_dir
from chunkstore.reference import HFReference, relative_error


@pytest.fixture(scope="module")
def gemma3() -> HFReference:
    return HFReference.load(model_dir("tiny-gemma3"))


def test_forward_past_the_window_is_hfs_own(gemma3) -> None:
    ids = [
        int(t) for t in torch.randint(3, 600, (120,), generator=torch.Generator().manual_seed(0))
    ]
    with torch.no_grad():
        own = gemma3.model(input_ids=torch.tensor([ids])).logits[0]
    whole = gemma3.forward(ids, 0)
    assert torch.allclose(whole.logits, own, atol=1e-5)  # all 120: 88 past the window of 32
    # ... and on top of a past, the question after the prompt's first 90 tokens.
    past = gemma3.forward(ids[:90], 0).kv
    top = gemma3.forward(ids[90:], 90, past=past)
    assert torch.allclose(top.logits, own[90:], atol=1e-5)


def test_moved_keys_are_computed_there_each_layer_with_its_base(gemma3) -> None:
    ids = list(range(10, 50))
    here, there = gemma3.forward(ids, 0).kv, gemma3.forward(ids, 300).kv
    assert relative_error(here.remapped(300, gemma3.layers).keys, there.keys) < 1e-5
    with pytest.raises(UnsupportedRotaryError):
        gemma3.rotary  # noqa: B018 (one rotary for every layer would move 4 of 6 wrong)
