"""The simulator's cost model: per-layer times and bytes, transfer costs.

Everything is per *microbatch* and in seconds or bytes; a "layer" is one unit of the
sequence the plan partitions (docs/design.md#simulator).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["CostModel", "LayerCosts"]


@dataclass(frozen=True)
class LayerCosts:
    """Per-layer, per-microbatch costs.

    ``backward`` excludes recompute; ``recompute`` defaults to ``forward``.
    ``activation_bytes`` is what one microbatch of a layer keeps alive for its
    backward; ``boundary_bytes`` is one microbatch's activation at a stage boundary.
    """

    forward: tuple[float, ...]
    backward: tuple[float, ...]
    param_bytes: tuple[int, ...] = ()
    activation_bytes: tuple[int, ...] = ()
    recompute: tuple[float, ...] = ()
    boundary_bytes: int = 0

    def __post_init__(self) -> None:
        n = len(self.forward)
        if n == 0:
            raise ValueError("LayerCosts needs at least one layer")
        set_ = object.__setattr__
        set_(self, "forward", tuple(float(x) for x in self.forward))
        set_(self, "backward", tuple(float(x) for x in self.backward))
        set_(self, "param_bytes", _or_default(self.param_bytes, n, 0, int))
        set_(self, "activation_bytes", _or_default(self.activation_bytes, n, 0, int))
        set_(
            self,
            "recompute",
            _or_default(self.recompute, n, None, float) or self.forward,
        )
        for name in ("backward", "param_bytes", "activation_bytes", "recompute"):
            if len(getattr(self, name)) != n:
                raise ValueError(
                    f"LayerCosts.{name} has {len(getattr(self, name))} entries but forward has {n}"
                )
        negative = [
            name
            for name in (
                "forward",
                "backward",
                "recompute",
                "param_bytes",
                "activation_bytes",
            )
            if any(x < 0 for x in getattr(self, name))
        ]
        if negative:
            raise ValueError(f"LayerCosts.{negative[0]} has a negative entry")

    @property
    def num_layers(self) -> int:
        return len(self.forward)

    @classmethod
    def from_lists(
        cls,
        forward: Sequence[float],
        backward: Sequence[float],
        param_bytes: Sequence[int] | None = None,
    ) -> LayerCosts:
        """Build from the runtime's plain per-layer measurements."""
        return cls(tuple(forward), tuple(backward), tuple(param_bytes or ()))

    @classmethod
    def uniform(
        cls,
        num_layers: int,
        forward: float,
        backward: float,
        head_forward: float | None = None,
        head_backward: float | None = None,
        *,
        layer_bytes: int = 0,
        head_bytes: int = 0,
    ) -> LayerCosts:
        """``num_layers`` identical transformer layers, plus a head layer if its costs are given."""
        fwd, bwd, size = (
            [forward] * num_layers,
            [backward] * num_layers,
            [layer_bytes] * num_layers,
        )
        if head_forward is not None or head_backward is not None:
            fwd.append(head_forward or 0.0)
            bwd.append(head_backward or 0.0)
            size.append(head_bytes)
        return cls(tuple(fwd), tuple(bwd), tuple(size))

    def stage_forward(self, layers: range) -> float:
        return sum(self.forward[i] for i in layers)

    def stage_backward(self, layers: range) -> float:
        return sum(self.backward[i] for i in layers)

    def stage_recompute(self, layers: range) -> float:
        return sum(self.recompute[i] for i in layers)

    def stage_param_bytes(self, layers: range) -> int:
        return sum(self.param_bytes[i] for i in layers)

    def stage_activation_bytes(self, layers: range) -> int:
        return sum(self.activation_bytes[i] for i in layers)


@dataclass(frozen=True)
class CostModel:
    """Layer costs plus the transfer and host costs of one configuration.

    ``comm`` is the time one microbatch's activation (or gradient) takes to cross a
    stage boundary (for RoundPipe: device -> host -> device). Bandwidths are in
    bytes/s per device and direction. ``optimizer_time`` is the host optimizer's
    time for one full step. ``device_optimizer_ratio`` is the optimizer-state bytes
    per weight byte that a weight-bound baseline keeps on its GPU (0: offloaded).
    """

    layers: LayerCosts
    comm: float = 0.0
    h2d_bandwidth: float = math.inf
    d2h_bandwidth: float = math.inf
    optimizer_time: float = 0.0
    grad_bytes_ratio: float = 1.0
    device_optimizer_ratio: float = 0.0
    weight_chunk_bytes: int | None = 256 * 2**20
    """Weight uploads are cut into chunks of at most this size, as the runtime does."""

    def upload_time(self, num_bytes: float) -> float:
        return num_bytes / self.h2d_bandwidth

    def download_time(self, num_bytes: float) -> float:
        return num_bytes / self.d2h_bandwidth


def _or_default(values: Sequence, n: int, default, cast) -> tuple:
    if values:
        return tuple(cast(v) for v in values)
    return () if default is None else (default,) * n
