"""A context-parallel rank's part of a stored entry (worker process; issue 75).

Under context parallelism a rank's cache holds only the positions it owns
(``kv.paging.cp_owner``), so from a device pool it reads only those rows of an entry: the
rows whose positions it owns, of the rows loaded and of the others alike (row r of an
entry loaded at ``actual_start`` from row ``entry_offset`` stands at actual_start -
entry_offset + r), so that the ranks of a group hold every byte of the entry once between
them. Each rank adds up its bytes' two keyed sums (``keyed_digest``: secret weights, the
key the scheduler's summed lease carries); the group adds them up (an all-reduce of three
integers a load), and each rank checks the total against the sums the daemon vouched for
when it granted the lease, of bytes that passed the committed checksum then: 1/cp of the
bytes read per rank, with the whole entry's check.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from chunkstore.kv.entry import EntryLayout, torch_dtype
from chunkstore.kv.paging import cp_owner

from .common import LoadItem
from .registered_cache import CpRank


@dataclass
class HeldPart:
    """The rows of an entry one rank holds (ascending) and their bytes: every layer's keys,
    then every layer's values, [parts, layers, rows, a row's bytes], flat, as read (parts:
    2, keys and values; 1 for an MLA entry's latent)."""

    rows: torch.Tensor
    data: torch.Tensor

    def tensors(self, layout: EntryLayout) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Keys and values of the rows, [layers, rows, heads, head_dim] each (views; values
        None for an MLA latent)."""
        shape = (parts(layout), layout.num_layers, len(self.rows))
        typed = self.data.view(torch_dtype(layout.dtype))
        both = typed.view(*shape, layout.num_kv_heads, layout.head_dim)
        return both[0], None if len(both) == 1 else both[1]

    def loaded(self, item: LoadItem) -> torch.Tensor:
        """Which of the rows the load writes (the others were read for the check)."""
        rows = self.rows.to(self.data.device)
        return (rows >= item.entry_offset) & (rows < item.entry_offset + item.num_tokens)


def held_rows(item: LoadItem, cp: CpRank, block_size: int) -> torch.Tensor:
    """The entry's rows whose positions this rank owns, ascending."""
    shift = item.actual_start - item.entry_offset
    positions = torch.arange(item.lease.layout.num_tokens) + shift
    owners = cp_owner(positions, cp.size, cp.interleave, block_size)
    return (owners == cp.rank).nonzero().flatten()


def row_starts(layout: EntryLayout, rows: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Where ``rows``' keys and values start in the entry, each layer's (a row of a layer's
    keys or values: ``row_bytes``), in ``HeldPart``'s order."""
    row = row_bytes(layout)
    layers = torch.arange(parts(layout) * layout.num_layers, device=device)
    return (layers[:, None] * (layout.num_tokens * row) + rows.to(device)[None, :] * row).flatten()


def row_bytes(layout: EntryLayout) -> int:
    """The bytes of one token's keys (or values, or latent) in one layer of an entry."""
    return layout.nbytes // (parts(layout) * layout.num_layers * layout.num_tokens)


def parts(layout: EntryLayout) -> int:
    """Keys and values (2), or an MLA model's latent alone (1)."""
    return 2 if layout.kind == "kv" else 1
