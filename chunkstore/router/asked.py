"""A request as the router read it, and the rule for work on it that leaves the event loop."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from chunkstore.kv.keyspace import Plan
from chunkstore.policy.selection import TransferParams

from . import order

HEAVY = 1 << 16  # bytes of a body past which its parsing and planning leave the event loop

Prompt = tuple[list[int], Plan]  # a prompt's token IDs, and its pieces and keys


@dataclass(frozen=True)
class Asked:
    """A request as read: its bytes, its body, and who sent it."""

    raw: bytes
    body: dict[str, Any]
    endpoint: str
    chat: bool
    headers: dict[str, str]  # those passed on (the API key)
    client: str  # its share of cold chunks (``limits.client_of``)
    heavy: bool  # big enough that reading it leaves the event loop
    params: TransferParams = field(init=False)  # its kv_transfer_params, parsed once

    def __post_init__(self) -> None:
        object.__setattr__(self, "params", order.params_of(self.body))


async def off_loop(heavy: bool, work: Any, *args: Any) -> Any:
    """``work(*args)``, off the event loop where the body is big enough to matter."""
    return await asyncio.to_thread(work, *args) if heavy else work(*args)
