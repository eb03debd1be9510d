"""The simulator's cost model: per-layer times and bytes, transfer costs.

Everything is per *microbatch* and in seconds or bytes; a "layer" is one unit of the
sequence the plan partitions (docs/design.md#simulator).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

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

    def scaled(self, factor: float) -> LayerCosts:
        """These costs with every time multiplied by ``factor`` (bytes unchanged)."""
        if factor == 1:
            return self
        return replace(
            self,
            forward=tuple(t * factor for t in self.forward),
            backward=tuple(t * factor for t in self.backward),
            recompute=tuple(t * factor for t in self.recompute),
        )

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
    device_layers: tuple[LayerCosts, ...] = ()
    """Where the devices differ (a mixed pool): each device's own layer costs, profiled
    per device class; ``()``: every device runs at ``layers``. Only the times are read
    from these; bytes are ``layers``' (docs/design.md#mixed-pools)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "device_layers", tuple(self.device_layers))
        for costs in self.device_layers:
            if costs.num_layers != self.layers.num_layers:
                raise ValueError(
                    f"a device's layer costs cover {costs.num_layers} layers, but the model "
                    f"has {self.layers.num_layers}"
                )
        first = self.device_layers[0] if self.device_layers else None
        if first is not None and all(_same_times(c, first) for c in self.device_layers):
            # devices alike: today's model, at their times
            object.__setattr__(self, "layers", self._timed_as(first))
            object.__setattr__(self, "device_layers", ())

    @property
    def mixed(self) -> bool:
        """Whether the devices differ (the planner then also tries placed plans:
        :attr:`roundpipe.core.plan.Plan.placed`)."""
        return bool(self.device_layers)

    def layers_on(self, device: int) -> LayerCosts:
        """The layer costs of ``device`` (``layers`` where the devices are equal)."""
        return self.device_layers[device] if self.device_layers else self.layers

    def on_device(self, device: int) -> CostModel:
        """This model as ``device`` sees it: its layer times, the devices alike."""
        if not self.device_layers:
            return self
        return replace(self, layers=self._timed_as(self.device_layers[device]), device_layers=())

    def _timed_as(self, costs: LayerCosts) -> LayerCosts:
        """``layers`` (its bytes) at the times of ``costs``."""
        return replace(
            self.layers, forward=costs.forward, backward=costs.backward, recompute=costs.recompute
        )

    def with_speeds(self, speeds: Sequence[float]) -> CostModel:
        """This model on devices of relative ``speeds`` (one per device): device ``d``'s
        compute times are ``layers``' divided by ``speeds[d]``; equal speeds of 1 give
        this model unchanged."""
        if any(not (math.isfinite(s) and s > 0) for s in speeds):
            raise ValueError(f"device speeds must be finite and > 0, got {list(speeds)}")
        scaled = {s: self.layers.scaled(1 / s) for s in set(speeds)}
        return replace(self, device_layers=tuple(scaled[s] for s in speeds))

    def fastest(self) -> CostModel:
        """Every layer at the fastest device's times, the devices equal: what lower
        bounds on a mixed pool are computed from (never above the true time)."""
        if not self.device_layers:
            return self
        pick = self.device_layers
        layers = replace(
            self.layers,
            forward=tuple(map(min, zip(*(c.forward for c in pick), strict=True))),
            backward=tuple(map(min, zip(*(c.backward for c in pick), strict=True))),
            recompute=tuple(map(min, zip(*(c.recompute for c in pick), strict=True))),
        )
        return replace(self, layers=layers, device_layers=())

    def upload_time(self, num_bytes: float) -> float:
        return num_bytes / self.h2d_bandwidth

    def download_time(self, num_bytes: float) -> float:
        return num_bytes / self.d2h_bandwidth


def _same_times(a: LayerCosts, b: LayerCosts) -> bool:
    return (a.forward, a.backward, a.recompute) == (b.forward, b.backward, b.recompute)


def _or_default(values: Sequence, n: int, default, cast) -> tuple:
    if values:
        return tuple(cast(v) for v in values)
    return () if default is None else (default,) * n
