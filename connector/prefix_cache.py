"""vLLM's prefix cache under in-band isolation (scheduler process).

vLLM reuses a cached block when the tokens up to its end are the same, which assumes a
token's KV depends only on the tokens before it. Under the isolation mask it also depends on
the token's role, and the role of a prompt's last segments is decided by what follows them:
in ``sys##c1##X`` X is the question (it sees c1), in ``sys##c1##X##Y`` X is a chunk (it
must not). A chunked prompt's tokens are sys tokens (before the first separator), chunk
tokens under the mask, and, from its causal start on, tokens that attend causally to
everything (the question, what is generated).

The rule: a block that ends after the prompt's causal start is cached under its own hash:
vLLM's, salted with that causal start (the chain under it stays vLLM's, so the hash depends
only on the tokens up to the block's end and on where, among them, causal tokens begin).
Two prompts share such a block only when their tokens up to its end have the same roles:
the same question again, or a later turn of a chat that appends to it. Blocks that end
before it keep vLLM's hashes (their tokens' roles follow from the tokens), so sys and chunk
blocks are shared across questions. vLLM computes a request's block hashes with a
per-request hasher as the request grows; it is wrapped once, when the request arrives,
before any lookup.

With ``recompute_tokens`` or ``recompute_chunks`` the cache's chunk blocks hold a mix:
after the question's first step, the selected tokens' recomputed KV, the rest isolated. A
request that computes the rest of a chunk needs its isolated KV, and the store must never
get the mix, so blocks from the first recomputed token on are private to their request
(salted with a nonce): chunks come back from the store instead, and the blocks before it
(sys, chunks before the first recomputed one) are still shared.
"""

from __future__ import annotations

import hashlib
import logging
import os
from collections.abc import Callable
from typing import Any

log = logging.getLogger("chunkstore.connector")

CAUSAL_ROLE = b"chunkstore.role.causal-from\0"
PRIVATE = b"chunkstore.role.private\0"


def causal_role_hash(block_hash: bytes, causal_start: int) -> bytes:
    return hashlib.sha256(CAUSAL_ROLE + causal_start.to_bytes(8, "little") + block_hash).digest()


def keep_roles_apart(
    request: Any, causal_start: int, block_size: int, private_from: int | None = None
) -> bool:
    """Salt the hashes of ``request``'s blocks that hold positions from ``causal_start``
    on, now and as it grows; with ``private_from``, those that hold positions from there
    on with a nonce of this request's. False (nothing changed) if vLLM's request has no
    hasher to wrap, or hashes blocks of another size than ``block_size``."""
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
        return [salted(h, (first + i + 1) * block_size) for i, h in enumerate(new)]

    nonce = os.urandom(16)

    def salted(block_hash: bytes, block_end: int) -> bytes:
        if private_from is not None and block_end > private_from:
            return hashlib.sha256(PRIVATE + nonce + block_hash).digest()
        if block_end > causal_start:
            return causal_role_hash(block_hash, causal_start)
        return block_hash

    request._block_hasher = role_aware
    del hashes[:]  # the prompt's hashes were computed on arrival: again, role-aware
    request.update_block_hashes()
    return True
