"""Execution plans: how the layer sequence is cut into forward and backward stages.

A plan is pure data: two partitions of the same layers, forward stages holding more
layers than backward stages (which also recompute), the deepest backward stage fused
with the loss (docs/design.md#plans).
"""

from __future__ import annotations

import operator
from collections.abc import Iterable, Sequence
from dataclasses import dataclass


class PlanError(ValueError):
    """A plan does not describe a valid partition of the model's layers."""


PLACED = "@0"
"""How a placed plan's string ends (:attr:`Plan.placed`)."""


@dataclass(frozen=True)
class Plan:
    """Forward and backward stage sizes, in layers.

    ``forward[i]`` is the number of layers of forward stage ``i`` (shallowest
    first). ``backward[i]`` is the number of layers of backward stage ``i`` in
    execution order, i.e. deepest first: ``backward[0]`` is the fused stage.

    ``placed``: every call starts at device 0, so job ``j`` always runs on device
    ``j mod N`` and each stage can be sized for the device that runs it (a mixed pool's
    plans, docs/design.md#mixed-pools); otherwise the round-robin cursor carries over
    from call to call. Written with a trailing ``@0``: ``"6,3|2,1,1,2,1,1,2@0"``.
    """

    forward: tuple[int, ...]
    backward: tuple[int, ...]
    placed: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "forward", _layer_counts("forward", self.forward))
        object.__setattr__(self, "backward", _layer_counts("backward", self.backward))
        if not isinstance(self.placed, bool):
            raise PlanError(f"placed is True or False, got {self.placed!r}")

    @property
    def num_layers(self) -> int:
        return sum(self.backward)

    @property
    def fused_layers(self) -> int:
        return self.backward[0] if self.backward else 0

    def forward_ranges(self) -> list[range]:
        """Layer ranges of the forward stages, shallowest first."""
        return stage_ranges(self.forward)

    def fused_range(self) -> range:
        return range(self.num_layers - self.fused_layers, self.num_layers)

    def backward_ranges(self) -> list[range]:
        """Layer ranges of the backward stages in execution order (fused first)."""
        ranges, stop = [], self.num_layers
        for size in self.backward:
            ranges.append(range(stop - size, stop))
            stop -= size
        return ranges

    def validate(self, num_layers: int) -> Plan:
        """Raise :class:`PlanError` unless this plan covers ``num_layers`` layers exactly."""
        if num_layers < 1:
            raise PlanError(f"the model has {num_layers} layers; it needs at least one")
        if not self.backward:
            raise PlanError("the plan has no backward stages; it needs at least the fused stage")
        for side, sizes in (("forward", self.forward), ("backward", self.backward)):
            bad = [n for n in sizes if n < 1]
            if bad:
                raise PlanError(
                    f"every {side} stage needs at least one layer, got {side} sizes {list(sizes)}"
                )
        if sum(self.backward) != num_layers:
            raise PlanError(
                f"backward stages cover {sum(self.backward)} layers "
                f"({list(self.backward)}), but the model has {num_layers}: every layer must "
                "be in exactly one backward stage"
            )
        expected_forward = num_layers - self.fused_layers
        if sum(self.forward) != expected_forward:
            raise PlanError(
                f"forward stages cover {sum(self.forward)} layers ({list(self.forward)}), but "
                f"the forward partition must end where the fused stage (the last "
                f"{self.fused_layers} layers) begins, i.e. cover {expected_forward} layers"
            )
        return self

    def __str__(self) -> str:
        sizes = f"{','.join(map(str, self.forward))}|{','.join(map(str, self.backward))}"
        return sizes + (PLACED if self.placed else "")

    def with_sizes(self, forward: Sequence[int], backward: Sequence[int]) -> Plan:
        """A plan of these stage sizes, placed as this one."""
        return Plan(tuple(forward), tuple(backward), self.placed)

    @classmethod
    def parse(cls, text: str) -> Plan:
        """Parse ``"3,3|2,1,1,1,1,1,1"`` (forward sizes | backward sizes, fused first),
        ``"...@0"`` placed (every call from device 0)."""
        if text.count("|") != 1:
            raise PlanError(f"a plan reads 'fwd,fwd,...|bwd,bwd,...[@0]', got {text!r}")
        placed = text.rstrip().endswith(PLACED)
        fwd, bwd = text.rstrip().removesuffix(PLACED).split("|")
        try:
            return cls(_parse_sizes(fwd), _parse_sizes(bwd), placed)
        except ValueError as exc:
            raise PlanError(f"could not read plan {text!r}: {exc}") from None

    @classmethod
    def from_ranges(cls, forward: Sequence[range], backward: Sequence[range]) -> Plan:
        """Build a plan from explicit layer ranges, checking they are contiguous."""
        for side, ranges, descending in (("forward", forward, False), ("backward", backward, True)):
            for a, b in zip(ranges, ranges[1:], strict=False):
                touching = (b.stop == a.start) if descending else (b.start == a.stop)
                if not touching:
                    raise PlanError(f"{side} stages {a} and {b} are not contiguous and in order")
        return cls(tuple(len(r) for r in forward), tuple(len(r) for r in backward))


def _layer_counts(side: str, sizes: Iterable[int]) -> tuple[int, ...]:
    """``sizes`` as a tuple of ints; anything but a whole, non-negative count is refused.

    (Empty stages are refused by :meth:`Plan.validate`: a plan is data, and the CLI
    spells a fused stage holding only the head as ``0``.)
    """
    try:
        if isinstance(sizes, (str, bytes)):
            raise TypeError
        sizes = list(sizes)
    except TypeError:
        raise PlanError(
            f"{side} stage sizes must be a sequence of layer counts, got {sizes!r}"
        ) from None
    counts = []
    for size in sizes:
        try:
            if isinstance(size, bool):
                raise TypeError
            count = operator.index(size)
        except TypeError:
            raise PlanError(
                f"{side} stage sizes are layer counts (whole numbers), got {size!r} in {sizes!r}"
            ) from None
        if count < 0:
            raise PlanError(f"{side} stage sizes cannot be negative, got {count} in {sizes}")
        counts.append(count)
    return tuple(counts)


def _parse_sizes(text: str) -> tuple[int, ...]:
    text = text.strip()
    return tuple(int(part) for part in text.split(",")) if text else ()


def stage_ranges(sizes: Sequence[int], start: int = 0) -> list[range]:
    """Consecutive layer ranges of stages with the given sizes, the first at ``start``."""
    ranges = []
    for size in sizes:
        ranges.append(range(start, start + size))
        start += size
    return ranges
