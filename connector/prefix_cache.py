"""vLLM's prefix cache under in-band isolation (scheduler process).

vLLM reuses a cached block when the tokens up to its end are the same, which assumes a
token's KV depends only on the tokens before it. Under the isolation mask it also depends on
the token's role, and the role of a prompt's last segment is decided by what follows it: in
``sys##c1##X`` X is the question (it sees c1), in ``sys##c1##X##Y`` X is a chunk (it must
not). Every other role is decided by the past: tokens before the first separator are sys,
tokens followed by a separator in the same prompt are chunk tokens.

The rule: a block holding any token after the prompt's last separator (a question token, or
a generated one) is cached under its own hash: vLLM's, salted with the question role (the
chain under it stays vLLM's, so a block's hash depends only on the tokens up to its end and
on whether it holds question tokens).
So such a block is shared only with prompts that have the same tokens in the same role (the
same question, or a later turn of a chat that appends to it), and a block of chunk tokens
only with prompts that have them as chunk tokens too. Blocks before the last separator keep
vLLM's hashes, so sys and chunk blocks are shared across questions. vLLM computes a
request's block hashes with a per-request hasher as the request grows; it is wrapped once,
when the request arrives, before any lookup.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable
from typing import Any

log = logging.getLogger("chunkstore.connector")

QUESTION_ROLE = b"chunkstore.role.question\0"


def question_role_hash(block_hash: bytes) -> bytes:
    return hashlib.sha256(QUESTION_ROLE + bytes(block_hash)).digest()


def keep_roles_apart(request: Any, question_start: int, block_size: int) -> bool:
    """Salt the hashes of ``request``'s blocks that hold positions from ``question_start``
    on, now and as it grows. False (nothing changed) if vLLM's request has no hasher to
    wrap, or hashes blocks of another size than ``block_size``."""
    hasher: Callable[[Any], list[bytes]] | None = getattr(request, "_block_hasher", None)
    hashes = getattr(request, "block_hashes", None)
    if hasher is None or hashes is None:
        return False
    if len(hashes) != request.num_tokens // block_size:
        return False

    plain: list[bytes] = []  # vLLM's own chain, which each new block's hash continues

    def role_aware(req: Any) -> list[bytes]:
        served = req.block_hashes
        req.block_hashes = plain  # vLLM's hasher reads the chain from here
        try:
            new = hasher(req)
        finally:
            req.block_hashes = served
        first = len(plain)
        plain.extend(new)
        return [
            question_role_hash(h) if (first + i + 1) * block_size > question_start else h
            for i, h in enumerate(new)
        ]

    request._block_hasher = role_aware
    del hashes[:]  # the prompt's hashes were computed on arrival: again, role-aware
    request.update_block_hashes()
    return True
