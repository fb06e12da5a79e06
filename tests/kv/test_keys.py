"""Cache keys: content, context, model and layout; never position; the same in every process."""

from __future__ import annotations

import subprocess
import sys

from chunkstore.kv.fingerprint import weights_digest
from chunkstore.kv.keys import (
    Isolation,
    KVLayout,
    model_fingerprint,
    prefix_keys,
    segment_keys,
)
from chunkstore.kv.rope import RotaryConfig
from chunkstore.kv.segments import split_prompt

SEP = [0]
ROTARY = RotaryConfig(head_dim=64, rotary_dim=64, theta=100000.0)
MODEL = model_fingerprint("weights-a", "float32", ROTARY)
LAYOUT = KVLayout(num_layers=30, num_kv_heads=3, head_dim=64).fingerprint()


def keys_of(
    prompt: list[int],
    isolation: Isolation = Isolation.SYS,
    model: bytes = MODEL,
    layout: bytes = LAYOUT,
) -> dict[tuple[int, ...], bytes | None]:
    segs = split_prompt(prompt, SEP)
    return {
        s.token_ids: k
        for s, k in zip(segs, segment_keys(segs, model, layout, isolation), strict=True)
    }


def test_same_chunk_same_key_at_any_position_and_under_any_question() -> None:
    a = keys_of([1, 2, 0, 5, 5, 0, 7, 7, 7, 0, 9])
    b = keys_of([1, 2, 0, 7, 7, 7, 0, 8, 0, 5, 5, 0, 4, 4])
    assert a[(5, 5, 0)] == b[(5, 5, 0)]
    assert a[(7, 7, 7, 0)] == b[(7, 7, 7, 0)]
    assert a[(1, 2, 0)] == b[(1, 2, 0)]
    assert a[(9,)] is None  # the question is never cached
    assert len(a[(5, 5, 0)] or b"") == 16


def test_different_sys_context_gives_different_chunk_keys() -> None:
    a = keys_of([1, 2, 0, 5, 5, 0, 9])
    b = keys_of([1, 3, 0, 5, 5, 0, 9])
    assert a[(5, 5, 0)] != b[(5, 5, 0)]
    # In isolation none the chunk saw nothing but itself: sys does not matter.
    a = keys_of([1, 2, 0, 5, 5, 0, 9], Isolation.NONE)
    b = keys_of([1, 3, 0, 5, 5, 0, 9], Isolation.NONE)
    assert a[(5, 5, 0)] == b[(5, 5, 0)]


def test_a_cache_salt_is_part_of_every_chunk_and_sys_key() -> None:
    """vLLM's cache_salt: no key of one salt is a key of another, or of the shared
    namespace; the same salt gives the same keys; no salt gives the keys of before salts."""
    prompt = [1, 2, 0, 5, 5, 0, 7, 0, 9]
    segs = split_prompt(prompt, SEP)
    for isolation in Isolation:

        def salted(salt: str) -> set[bytes]:
            keys = segment_keys(segs, MODEL, LAYOUT, isolation, 0, salt)  # noqa: B023
            return {k for k in keys if k}

        shared, alice, bob = salted(""), salted("alice"), salted("bob")
        assert len(shared) == len(alice) == len(bob) == 3  # sys and two chunks
        assert not (shared & alice or shared & bob or alice & bob)
        assert salted("alice") == alice
        assert shared == {k for k in keys_of(prompt, isolation).values() if k}


def test_isolation_mode_model_and_layout_change_the_key() -> None:
    prompt = [1, 2, 0, 5, 5, 0, 9]
    base = keys_of(prompt)[(5, 5, 0)]
    assert keys_of(prompt, Isolation.NONE)[(5, 5, 0)] != base
    other_weights = model_fingerprint("weights-b", "float32", ROTARY)
    other_dtype = model_fingerprint("weights-a", "bfloat16", ROTARY)
    other_rotary = model_fingerprint(
        "weights-a", "float32", RotaryConfig(head_dim=64, rotary_dim=64, theta=10000.0)
    )
    for model in (other_weights, other_dtype, other_rotary):
        assert keys_of(prompt, model=model)[(5, 5, 0)] != base
    for layout in (KVLayout(30, 3, 128), KVLayout(24, 3, 64), KVLayout(30, 1, 64, kind="mla")):
        assert keys_of(prompt, layout=layout.fingerprint())[(5, 5, 0)] != base


def test_token_boundaries_are_unambiguous() -> None:
    # Length-prefixed fields: moving a token between context and content changes the key.
    assert keys_of([1, 0, 2, 0])[(2, 0)] != keys_of([1, 2, 0, 0])[(0,)]


CHILD = """
from chunkstore.kv.keys import Isolation, KVLayout, model_fingerprint, segment_keys
from chunkstore.kv.rope import RotaryConfig
from chunkstore.kv.segments import split_prompt
rotary = RotaryConfig(head_dim=64, rotary_dim=64, theta=100000.0)
model = model_fingerprint("weights-a", "float32", rotary)
layout = KVLayout(num_layers=30, num_kv_heads=3, head_dim=64).fingerprint()
segs = split_prompt([1, 2, 0, 5, 5, 0, 70000, 0, 9], [0])
print(",".join(k.hex() for k in segment_keys(segs, model, layout, Isolation.SYS) if k))
"""


def test_keys_are_identical_across_processes() -> None:
    # Separate interpreters, each with its own hash randomization seed.
    outputs = {
        subprocess.run(
            [sys.executable, "-c", CHILD],
            capture_output=True,
            text=True,
            check=True,
            env={"PYTHONHASHSEED": seed, **_env()},
        ).stdout.strip()
        for seed in ("1", "2")
    }
    assert len(outputs) == 1
    segs = split_prompt([1, 2, 0, 5, 5, 0, 70000, 0, 9], [0])
    here = ",".join(k.hex() for k in segment_keys(segs, MODEL, LAYOUT, Isolation.SYS) if k)
    assert outputs == {here}


def _env() -> dict[str, str]:
    import os

    return {k: v for k, v in os.environ.items() if k != "PYTHONHASHSEED"}


def test_weights_digest_tracks_weight_bytes(tmp_path) -> None:
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "model.safetensors").write_bytes(b"\x00" * 100)
    first = weights_digest(tmp_path)
    assert weights_digest(tmp_path) == first
    (tmp_path / "model.safetensors").write_bytes(b"\x00" * 99 + b"\x01")
    assert weights_digest(tmp_path) != first


def test_prefix_keys_chain_every_token_before_a_block_and_the_salt() -> None:
    prompt = list(range(1, 41))
    keys = prefix_keys(MODEL, LAYOUT, prompt, 16)
    assert len(keys) == 2  # two whole blocks; the 8 tokens after them have no key
    assert keys == prefix_keys(MODEL, LAYOUT, prompt[:32], 16)  # what follows is not in it
    changed = [99, *prompt[1:]]  # the first token differs: so do both blocks' keys
    assert all(a != b for a, b in zip(keys, prefix_keys(MODEL, LAYOUT, changed, 16), strict=True))
    second_only = [*prompt[:16], 99, *prompt[17:]]
    assert prefix_keys(MODEL, LAYOUT, second_only, 16)[0] == keys[0]
    assert prefix_keys(MODEL, LAYOUT, second_only, 16)[1] != keys[1]
    salted = prefix_keys(MODEL, LAYOUT, prompt, 16, salt="tenant-a")
    assert not set(salted) & set(keys)
    assert not set(salted) & set(prefix_keys(MODEL, LAYOUT, prompt, 16, salt="tenant-b"))
    assert not set(keys) & set(prefix_keys(MODEL, b"other", prompt, 16))
    # A block is never a sys segment of the same tokens (that key has no chained root).
    sys_key = keys_of([*prompt[:16], *SEP, 5])[(*prompt[:16], *SEP)]
    assert sys_key not in prefix_keys(MODEL, LAYOUT, [*prompt[:16], *SEP], 17)
