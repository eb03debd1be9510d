"""Per-layer timings measured while training, smoothed, for the partitioner (DESIGN.md §6).

Forward and recompute times are measured layer by layer (device timers around each
layer's kernels). A backward stage's backward is one autograd call, so its time is
shared among its layers in proportion to their forward times. Before a layer has
been measured its times are estimated from its parameter count (backward = 2x
forward).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

from torch import nn

from ..sim.costs import LayerCosts

_ESTIMATE_SECONDS_PER_PARAM = 1e-9
_ESTIMATE_FLOOR_SECONDS = 1e-6


class LayerProfiler:
    """Exponentially smoothed per-layer forward, recompute and backward seconds."""

    def __init__(
        self, param_counts: Sequence[int], param_bytes: Sequence[int], smoothing: float = 0.3
    ):
        if not 0 < smoothing <= 1:
            raise ValueError(f"smoothing must be in (0, 1], got {smoothing}")
        self.param_counts = list(param_counts)
        self.param_bytes = list(param_bytes)
        self.smoothing = smoothing
        self._lock = threading.Lock()
        self._seconds: dict[str, list[float | None]] = {
            kind: [None] * len(param_counts) for kind in ("forward", "recompute", "backward")
        }

    @classmethod
    def for_modules(cls, modules: Sequence[nn.Module]) -> LayerProfiler:
        """A profiler whose size-based estimates come from each layer's parameters."""
        counts = [sum(p.numel() for p in m.parameters()) for m in modules]
        sizes = [sum(p.numel() * p.element_size() for p in m.parameters()) for m in modules]
        return cls(counts, sizes)

    @property
    def num_layers(self) -> int:
        return len(self.param_counts)

    def measured(self) -> bool:
        """Whether every layer has a forward and a backward measurement."""
        with self._lock:
            return all(v is not None for v in self._seconds["forward"]) and all(
                v is not None for v in self._seconds["backward"]
            )

    def record(self, kind: str, layers: Sequence[int], seconds: float) -> None:
        """Add one measurement of ``kind`` covering ``layers`` (split by forward share)."""
        if kind not in self._seconds or not layers:
            return
        shares = self._forward_shares(layers)
        with self._lock:
            series = self._seconds[kind]
            for layer, share in zip(layers, shares, strict=True):
                value = seconds * share
                old = series[layer]
                series[layer] = value if old is None else old + self.smoothing * (value - old)

    def _forward_shares(self, layers: Sequence[int]) -> list[float]:
        forward = self.forward_seconds()
        weights = [forward[i] for i in layers]
        total = sum(weights)
        return [w / total for w in weights] if total > 0 else [1 / len(layers)] * len(layers)

    def forward_seconds(self) -> list[float]:
        with self._lock:
            return [
                measured if measured is not None else self._estimate(i)
                for i, measured in enumerate(self._seconds["forward"])
            ]

    def _estimate(self, layer: int) -> float:
        return max(self.param_counts[layer] * _ESTIMATE_SECONDS_PER_PARAM, _ESTIMATE_FLOOR_SECONDS)

    def costs(self) -> LayerCosts:
        """Current per-layer costs: measurements where available, estimates elsewhere."""
        forward = self.forward_seconds()
        with self._lock:
            backward = [
                b if b is not None else 2 * forward[i]
                for i, b in enumerate(self._seconds["backward"])
            ]
            recompute = [
                r if r is not None else forward[i] for i, r in enumerate(self._seconds["recompute"])
            ]
        return LayerCosts(
            forward=tuple(forward),
            backward=tuple(backward),
            param_bytes=tuple(self.param_bytes),
            recompute=tuple(recompute),
        )
