"""Per-layer timings and link costs measured while training, smoothed, for the planner.

:class:`LayerProfiler` records each layer's forward and recompute and each stage's
backward as timed on the device, the link bandwidths from the transfers the runtime
already does, and the activation bytes at stage boundaries;
:meth:`LayerProfiler.cost_model` hands them to the partitioner
(docs/design.md#automatic-planning).
"""

from __future__ import annotations

import contextlib
import math
import threading
from collections.abc import Iterator, Sequence

from torch import nn

from ..devices.base import Device, Timer
from ..planning.sim.costs import CostModel, LayerCosts

_ESTIMATE_SECONDS_PER_PARAM = 1e-9
_ESTIMATE_FLOOR_SECONDS = 1e-6
MIN_TIMED_BYTES = 64 * 2**10
"""Transfers smaller than this are not timed for bandwidth: latency would pass for it."""
LINKS = ("h2d", "d2h")


class TransferTiming:
    """One transfer op's device time and bytes. :meth:`measure` runs inside the op (which
    also sets ``nbytes``); the profiler reads the timer only after the op completed."""

    def __init__(
        self, device: Device, link: str, boundary: bool = False, layer: int | None = None
    ) -> None:
        self.link = link
        self.boundary = boundary
        """The transfer is one microbatch's activation at a stage boundary."""
        self.layer = layer
        """For a boundary: the layer whose input it is (None: not known)."""
        self.nbytes = 0
        self._device = device
        self._timer: Timer | None = None

    @property
    def timed(self) -> bool:
        """Whether :meth:`measure` times the copy (small ones are not: two events saved)."""
        return self.nbytes >= MIN_TIMED_BYTES

    @contextlib.contextmanager
    def measure(self) -> Iterator[None]:
        if not self.timed:
            yield
            return
        timer = self._timer = self._device.timer()
        timer.start()
        yield
        timer.stop()

    def seconds(self) -> float:
        return self._timer.seconds() if self._timer is not None else 0.0


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
        self._bandwidth: dict[str, float | None] = dict.fromkeys(LINKS)
        self._boundary_total = 0
        self._boundary_count = 0
        self._boundary_max = 0
        self._layer_inputs: list[int | None] = [None] * len(param_counts)

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
                series[layer] = self._smooth(series[layer], seconds * share)

    def record_transfer(self, link: str, nbytes: int, seconds: float) -> None:
        """Add one timed transfer of ``nbytes`` over ``link`` ("h2d" or "d2h")."""
        if link not in self._bandwidth or nbytes < MIN_TIMED_BYTES or seconds <= 0:
            return
        with self._lock:
            self._bandwidth[link] = self._smooth(self._bandwidth[link], nbytes / seconds)

    def _smooth(self, old: float | None, value: float) -> float:
        """The exponentially smoothed series after ``value`` (the first value as is)."""
        return value if old is None else old + self.smoothing * (value - old)

    def record_boundary(self, nbytes: int, layer: int | None = None) -> None:
        """Add one microbatch's activation size seen at a stage boundary (the input of
        ``layer``, when known)."""
        with self._lock:
            self._boundary_total += nbytes
            self._boundary_count += 1
            self._boundary_max = max(self._boundary_max, nbytes)
            if layer is not None and 0 <= layer < len(self._layer_inputs):
                seen = self._layer_inputs[layer]
                self._layer_inputs[layer] = nbytes if seen is None else max(seen, nbytes)

    def record_timing(self, timing: TransferTiming) -> None:
        """Add a completed transfer op's measurements."""
        if timing.boundary:
            self.record_boundary(timing.nbytes, timing.layer)
        self.record_transfer(timing.link, timing.nbytes, timing.seconds())

    def bandwidth(self, link: str) -> float:
        """Measured bytes/s of ``link`` ("h2d" or "d2h"); infinite until measured."""
        with self._lock:
            measured = self._bandwidth[link]
        return measured if measured is not None else math.inf

    def boundary_bytes(self) -> int:
        """Mean bytes of one microbatch's activation at a stage boundary (0: none seen)."""
        with self._lock:
            if not self._boundary_count:
                return 0
            return round(self._boundary_total / self._boundary_count)

    def activation_bytes(self) -> tuple[int, ...]:
        """Per layer, one microbatch's activation at its input: what a stage holds per
        microbatch for each of its layers (a recompute keeps every layer's input). The
        largest size seen at that boundary; for a layer whose input was never seen, the
        largest seen at any boundary (0 before any)."""
        with self._lock:
            largest = self._boundary_max
            return tuple(largest if b is None else b for b in self._layer_inputs)

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
            activation_bytes=self.activation_bytes(),
            recompute=tuple(recompute),
            boundary_bytes=self.boundary_bytes(),
        )

    def cost_model(self, weight_chunk_bytes: int | None) -> CostModel:
        """:meth:`costs` with the measured link: an activation hop (device → host →
        device) costs its download plus its upload; weights upload at the measured
        host→device bandwidth in chunks of ``weight_chunk_bytes``."""
        h2d, d2h = self.bandwidth("h2d"), self.bandwidth("d2h")
        boundary = self.boundary_bytes()
        return CostModel(
            self.costs(),
            comm=boundary / d2h + boundary / h2d,
            h2d_bandwidth=h2d,
            d2h_bandwidth=d2h,
            weight_chunk_bytes=weight_chunk_bytes,
        )
