"""Which node owns which parameter, and the buckets gradients and weights travel in.

Pure: the same inputs give the same layout on every rank, which is what lets every
rank issue the same collectives in the same order. Ownership is by whole tensor, so
any optimizer that treats tensors one at a time runs unchanged on a node's share
(docs/design.md#several-nodes).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TensorSpec:
    """One trainable parameter, as the layout sees it."""

    index: int
    """Its position among the model's trainable parameters (the same on every rank;
    ``id()`` of a tensor is not)."""
    numel: int
    grad_dtype: torch.dtype
    """The dtype of its master and gradient (``optim_dtype``)."""
    weight_dtype: torch.dtype
    """The dtype devices upload (the model's)."""
    layers: tuple[int, ...]
    """The layers that use it (several for a tied parameter)."""


@dataclass(frozen=True)
class Bucket:
    """Tensors reduced (and gathered) together, one segment per node."""

    shares: tuple[tuple[int, ...], ...]
    """For each rank, the indices it owns in this bucket, in packing order."""
    share_numel: tuple[int, ...]
    layers: frozenset[int]
    """Every layer whose backward must have run before the gradients are final."""
    grad_dtype: torch.dtype
    weight_dtype: torch.dtype

    @property
    def segment(self) -> int:
        return max(self.share_numel)

    @property
    def single_owner(self) -> int | None:
        """The rank owning everything in the bucket, if one does: then the bucket is
        reduced to it and broadcast from it (no padded segments for the others)."""
        owners = [rank for rank, numel in enumerate(self.share_numel) if numel]
        return owners[0] if len(owners) == 1 else None


@dataclass(frozen=True)
class ShardLayout:
    world: int
    buckets: tuple[Bucket, ...]
    """In the order gradients become final: from the last layers to the first."""
    owner: dict[int, int]

    def owned_by(self, rank: int) -> frozenset[int]:
        return frozenset(index for index, r in self.owner.items() if r == rank)


def shard_layout(specs: list[TensorSpec], world: int, bucket_numel: int) -> ShardLayout:
    """Buckets and owners for ``specs`` on ``world`` nodes (docs/design.md#several-nodes)."""
    if world < 1:
        raise ValueError(f"world must be >= 1, got {world}")
    if bucket_numel < 1:
        raise ValueError(f"bucket_numel must be >= 1, got {bucket_numel}")
    load = [0] * world
    owner: dict[int, int] = {}
    buckets: list[Bucket] = []
    # A tensor's gradient is final once the lowest layer using it ran its backward.
    by_kind: dict[tuple[torch.dtype, torch.dtype], list[TensorSpec]] = {}
    for spec in sorted(specs, key=lambda s: (-min(s.layers), s.index)):
        if spec.numel >= bucket_numel and world > 1:
            buckets.append(_bucket([spec], world, load, owner))
            continue
        kind = (spec.grad_dtype, spec.weight_dtype)
        pending = by_kind.setdefault(kind, [])
        # Close the bucket at a layer boundary once it is big enough.
        boundary = pending and min(spec.layers) != min(pending[-1].layers)
        if boundary and sum(s.numel for s in pending) >= bucket_numel:
            buckets.append(_bucket(pending, world, load, owner))
            pending.clear()
        pending.append(spec)
    for pending in by_kind.values():
        if pending:
            buckets.append(_bucket(pending, world, load, owner))
    buckets.sort(key=lambda b: -min(b.layers))
    return ShardLayout(world, tuple(buckets), owner)


def _bucket(specs: list[TensorSpec], world: int, load: list[int], owner: dict[int, int]) -> Bucket:
    shares: list[list[int]] = [[] for _ in range(world)]
    numel = [0] * world
    for spec in sorted(specs, key=lambda s: (-s.numel, s.index)):
        rank = min(range(world), key=lambda r: (numel[r], load[r], r))
        shares[rank].append(spec.index)
        numel[rank] += spec.numel
        load[rank] += spec.numel
        owner[spec.index] = rank
    return Bucket(
        shares=tuple(tuple(s) for s in shares),
        share_numel=tuple(numel),
        layers=frozenset(layer for spec in specs for layer in spec.layers),
        grad_dtype=specs[0].grad_dtype,
        weight_dtype=specs[0].weight_dtype,
    )
