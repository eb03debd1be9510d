"""The broadcast that gives every rank rank 0's parameters and buffers at construction
(``roundpipe.cluster.same_model``), in one process: a stand-in ``Comm`` records what
rank 0 sends and replays it to rank 1. The oracle is rank 0's tensors themselves."""

from __future__ import annotations

import pytest
import torch

from roundpipe.cluster.same_model import broadcast_rank0_values


class Recorded:
    """Rank 0's side records each chunk it broadcasts; rank 1's side receives them."""

    def __init__(self, rank: int, sent: list[torch.Tensor]) -> None:
        self.rank = rank
        self.sent = sent
        self.received = 0

    def broadcast(self, flat: torch.Tensor, owner: int, what: str) -> None:
        assert owner == 0
        if self.rank == 0:
            self.sent.append(flat.clone())
        else:
            flat.copy_(self.sent[self.received])
            self.received += 1


def tensors(seed: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    wide = torch.randn(6, 5, generator=generator, dtype=torch.float64)
    return [
        torch.randn(3, 4, generator=generator),
        torch.randn(7, generator=generator).to(torch.bfloat16),
        torch.randint(0, 9, (5,), generator=generator),
        torch.rand(4, generator=generator) > 0.5,
        torch.empty(0),
        wide.t(),  # not contiguous
    ]


@pytest.mark.parametrize("chunk_bytes", [1, 7, 64, 2**20])
def test_every_rank_gets_rank_0s_values_whatever_the_chunk_size(chunk_bytes):
    sent: list[torch.Tensor] = []
    rank0, rank1 = tensors(seed=0), tensors(seed=1)
    broadcast_rank0_values(Recorded(0, sent), rank0, chunk_bytes)
    broadcast_rank0_values(Recorded(1, sent), rank1, chunk_bytes)
    assert all(len(chunk) <= chunk_bytes for chunk in sent)
    for mine, want in zip(rank1, tensors(seed=0), strict=True):
        assert torch.equal(mine, want)
    for mine, want in zip(rank0, tensors(seed=0), strict=True):
        assert torch.equal(mine, want)  # the sender is left as it was


def test_a_tensor_already_equal_to_rank_0s_is_not_written():
    sent: list[torch.Tensor] = []
    broadcast_rank0_values(Recorded(0, sent), tensors(seed=0), 16)
    rank1 = tensors(seed=0)
    rank1[0] = torch.randn(3, 4)  # only this one differs
    versions = [t._version for t in rank1]
    broadcast_rank0_values(Recorded(1, sent), rank1, 16)
    assert rank1[0]._version > versions[0]
    assert [t._version for t in rank1[1:]] == versions[1:]
