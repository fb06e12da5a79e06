"""Cache keys: xxh3-128 over (model fingerprint, KV layout fingerprint, context key, token IDs).

Positions are not part of a key: a chunk's KV is stored at a virtual start and re-rotated to
wherever it is reused (docs/semantics.md#the-contract-everything-else-serves). Every field is
length-prefixed and encoded little-endian, so a key is the same in every process and on every
machine.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from enum import StrEnum
from typing import TYPE_CHECKING

import xxhash

from chunkstore.kv.segments import Segment, SegmentKind

if TYPE_CHECKING:  # rope needs torch; keys alone must not (the daemon imports them)
    from chunkstore.kv.rope import RotaryConfig

KEY_BYTES = 16
_KEY_VERSION = b"chunkstore.key.v1"


class Isolation(StrEnum):
    SYS = "sys"  # chunks see the sys segment and their own earlier tokens
    NONE = "none"  # chunks see only their own earlier tokens


def length_prefixed(data: bytes) -> bytes:
    return struct.pack("<Q", len(data)) + data


def _digest(tag: bytes, fields: Iterable[bytes]) -> bytes:
    h = xxhash.xxh3_128()
    h.update(length_prefixed(tag))
    for f in fields:
        h.update(length_prefixed(f))
    return h.digest()


def model_fingerprint(weights_id: str, kv_dtype: str, rotary: RotaryConfig) -> bytes:
    """What makes two models' KV interchangeable: weights, KV dtype, rotary configuration."""
    rotary_json = json.dumps(asdict(rotary), sort_keys=True, default=str)
    return _digest(b"model", [weights_id.encode(), kv_dtype.encode(), rotary_json.encode()])


def layered_model_fingerprint(weights_id: str, kv_dtype: str, layers_json: str) -> bytes:
    """A model whose layers differ in rotary or window: every layer's, in order."""
    return _digest(b"model.layers", [weights_id.encode(), kv_dtype.encode(), layers_json.encode()])


def unremappable_fingerprint(
    weights_id: str, kv_dtype: str, raw_rotary: dict[str, object]
) -> bytes:
    """A model whose rotary cannot be remapped: its config's rotary settings as they are
    (tagged apart, so never equal to ``model_fingerprint`` of a remappable model)."""
    raw_json = json.dumps(raw_rotary, sort_keys=True, default=str)
    return _digest(
        b"model.unremappable", [weights_id.encode(), kv_dtype.encode(), raw_json.encode()]
    )


@dataclass(frozen=True)
class KVLayout:
    """The shape of an entry's KV, independent of how a serving engine shards it.

    Entries hold every KV head of every layer, so any tensor- or context-parallel rank can read
    its own slice. ``kind`` is "kv" (separate K and V per head) or "mla" (one latent vector
    per token holding the compressed KV and the decoupled rotary key ``k_pe``).
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    kind: str = "kv"

    def fingerprint(self) -> bytes:
        fields = [self.kind, self.num_layers, self.num_kv_heads, self.head_dim]
        return _digest(b"layout", [str(f).encode() for f in fields])


def segment_key(
    model_fp: bytes, layout_fp: bytes, context_key: bytes, token_ids: Sequence[int]
) -> bytes:
    """The key of one segment's KV, given the key of the context it attended to."""
    if token_ids and (min(token_ids) < 0 or max(token_ids) >= 1 << 32):
        raise ValueError("token IDs must fit in 32 unsigned bits")
    tokens = struct.pack(f"<{len(token_ids)}I", *token_ids)
    return _digest(_KEY_VERSION, [model_fp, layout_fp, context_key, tokens])


def chunk_context_key(sys_key: bytes, virtual_gap: int) -> bytes:
    """What a chunk in ``isolation: sys`` attended to: the sys segment, seen from
    ``virtual_gap`` tokens past its end (0: right after it, the key of sys itself)."""
    if virtual_gap == 0:
        return sys_key
    return _digest(b"gap", [sys_key, str(virtual_gap).encode()])


def summary_key(entry_key: bytes, block: int) -> bytes:
    """The key of an entry's block summary in blocks of ``block`` tokens (``kv.sparse``):
    stored beside the entry, read without reading it."""
    return _digest(b"summary", [entry_key, str(block).encode()])


def digests_key(entry_key: bytes, block: int, checksum: int) -> bytes:
    """The key of the digests of an entry's blocks of ``block`` tokens (``kv.sparse``'s
    ``EntryBlocks``): what a read of some of its blocks checks them against. ``checksum``:
    the entry's, as committed, so the digests of an entry stored again with other bytes
    (evicted, then computed elsewhere) are never taken for this one's."""
    return _digest(b"block-digests", [entry_key, str(block).encode(), str(checksum).encode()])


def salt_context(salt: str) -> bytes:
    """The context key of what attends to nothing before it (sys; a chunk in ``isolation:
    none``): empty, the shared namespace, without a salt; a key of the salt with one
    (vLLM's per-request ``cache_salt``: requests with different salts never share)."""
    return _digest(b"salt", [salt.encode()]) if salt else b""


def segment_keys(
    segments: Sequence[Segment],
    model_fp: bytes,
    layout_fp: bytes,
    isolation: Isolation,
    virtual_gap: int = 0,
    salt: str = "",
) -> list[bytes | None]:
    """Keys of a prompt's segments, in order; None for the question, which is never cached.

    The sys segment attends to nothing before it. A chunk's context is the sys segment in
    ``isolation: sys`` (a chunk computed under one system prompt, or at another distance from
    it, is never served under another) and nothing in ``isolation: none``. ``salt`` is part
    of every key (through sys's, or a chunk's own in ``isolation: none``); "" keys as before
    salts existed.
    """
    root = salt_context(salt)
    sys_key = b""
    keys: list[bytes | None] = []
    for seg in segments:
        if seg.kind is SegmentKind.QUESTION:
            keys.append(None)
            continue
        if seg.kind is SegmentKind.SYS:
            context = root
        elif isolation is Isolation.SYS:
            context = chunk_context_key(sys_key, virtual_gap)
        else:
            context = root
        key = segment_key(model_fp, layout_fp, context, seg.token_ids)
        if seg.kind is SegmentKind.SYS:
            sys_key = key
        keys.append(key)
    return keys


def _prefix_root(salt: str) -> bytes:
    """What the first prefix block chains: the salt, under a tag no segment key has."""
    return _digest(b"prefix", [salt.encode()])


def prefix_keys(
    model_fp: bytes,
    layout_fp: bytes,
    token_ids: Sequence[int],
    block_tokens: int,
    salt: str = "",
) -> list[bytes]:
    """Keys of a prompt's exact prefix KV, one per whole block of ``block_tokens`` tokens.

    Block i's KV depends on every token before its end, so its key chains the key of block
    i - 1 (the first chains a root of the salt: requests with different ``salt``s, vLLM's
    per-request ``cache_salt``, never share a block). The root's tag keeps a block apart
    from a sys segment of the same tokens. A trailing part block has no key
    (``prefix_tail_key``)."""
    if block_tokens < 1:
        raise ValueError(f"block_tokens must be >= 1, not {block_tokens}")
    context = _prefix_root(salt)
    keys: list[bytes] = []
    for start in range(0, len(token_ids) - block_tokens + 1, block_tokens):
        context = segment_key(model_fp, layout_fp, context, token_ids[start : start + block_tokens])
        keys.append(context)
    return keys


def prefix_tail_key(
    model_fp: bytes,
    layout_fp: bytes,
    token_ids: Sequence[int],
    block_tokens: int,
    salt: str = "",
) -> bytes | None:
    """The key of the part block after a prompt's whole ones (None if there is none),
    chained as a block's: a prefill instance stores it so that a decode instance loads the
    whole prompt (its tokens are counted in the key, so it is never a whole block's)."""
    whole = len(token_ids) // block_tokens * block_tokens
    if whole == len(token_ids):
        return None
    keys = prefix_keys(model_fp, layout_fp, token_ids[:whole], block_tokens, salt)
    context = keys[-1] if keys else _prefix_root(salt)
    return segment_key(model_fp, layout_fp, context, token_ids[whole:])
