"""Which KV heads a tensor-parallel rank holds, and how a save puts them back together.

vLLM splits the KV heads across the tensor-parallel group in rank order: with ``total`` heads
and ``size`` ranks each holds ``total / size`` contiguous heads, or, when there are fewer heads
than ranks, one head replicated on ``size / total`` consecutive ranks (QKVParallelLinear).
Entries always hold every head, so a store written at one tensor-parallel size loads at any.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class RankHeads:
    rank: int
    size: int
    total: int  # KV heads of the model
    local: int  # KV heads in this rank's cache

    def __post_init__(self) -> None:
        if not self.supported:
            raise ValueError(
                f"{self.local} KV heads on each of {self.size} ranks do not split "
                f"{self.total} heads the way vLLM does"
            )

    @property
    def supported(self) -> bool:
        if self.local * self.size == self.total:
            return True
        return self.local == 1 and self.size % self.total == 0

    @property
    def whole(self) -> bool:
        """Every rank holds every head (an MLA latent, replicated): nothing to gather."""
        return self.local == self.total

    @property
    def replicas(self) -> int:
        """Ranks holding each head (1 unless there are fewer heads than ranks)."""
        return max(1, self.size // self.total)

    def local_slice(self) -> slice:
        first = (self.rank // self.replicas) * self.local
        return slice(first, first + self.local)

    def gather(self, local: torch.Tensor, dim: int, group: Any) -> torch.Tensor:
        """Every head, from each rank's ``local`` part (a collective: every rank calls it)."""
        if self.size == 1:
            return local
        gathered = group.all_gather(local.contiguous(), dim=dim)
        if self.replicas > 1:  # one copy of each head
            index = torch.arange(0, self.size, self.replicas)
            gathered = gathered.index_select(dim, index)
        return gathered
