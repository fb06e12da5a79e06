"""KV heads across tensor-parallel ranks, as vLLM splits them: each rank's slice, and a save
gathering every head back in order (the collective replaced by a concatenation of what each
rank would hold)."""

from __future__ import annotations

import pytest
import torch

from chunkstore_vllm.heads import RankHeads


class Concatenate:
    """What all_gather returns: every rank's part, in rank order, along ``dim``."""

    def __init__(self, parts: list[torch.Tensor]) -> None:
        self.parts = parts

    def all_gather(self, tensor: torch.Tensor, dim: int) -> torch.Tensor:
        return torch.cat(self.parts, dim=dim)


@pytest.mark.parametrize(("total", "size"), [(8, 1), (8, 2), (8, 8), (2, 4), (1, 4), (4, 8)])
def test_each_rank_holds_its_heads_and_a_gather_restores_them_all(total: int, size: int) -> None:
    full = torch.randn(3, 5, total, 4)  # [layers, tokens, heads, head_dim]
    local = max(1, total // size)
    ranks = [RankHeads(rank, size, total, local) for rank in range(size)]
    parts = [full[:, :, r.local_slice()] for r in ranks]
    for rank in ranks:
        assert parts[rank.rank].shape[2] == local
    for rank in ranks:
        assert torch.equal(rank.gather(parts[rank.rank], 2, Concatenate(parts)), full)


def test_replicated_heads_go_to_consecutive_ranks() -> None:
    # 2 heads on 4 ranks: ranks 0, 1 hold head 0; ranks 2, 3 hold head 1 (QKVParallelLinear).
    assert [RankHeads(r, 4, 2, 1).local_slice() for r in range(4)] == [
        slice(0, 1),
        slice(0, 1),
        slice(1, 2),
        slice(1, 2),
    ]


@pytest.mark.parametrize(("total", "size", "local"), [(6, 4, 1), (8, 2, 3), (3, 2, 2)])
def test_splits_vllm_does_not_make_are_refused(total: int, size: int, local: int) -> None:
    with pytest.raises(ValueError, match="do not split"):
        RankHeads(0, size, total, local)
