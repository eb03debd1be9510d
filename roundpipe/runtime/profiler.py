"""Per-layer timings and link costs measured while training, smoothed, for the planner.

:class:`LayerProfiler` records each layer's forward and recompute and each stage's
backward as timed on the device (per device class on a mixed pool:
:mod:`.class_profiles`), the link bandwidths from the transfers the runtime already
does, and the activation bytes at stage boundaries; :meth:`LayerProfiler.cost_model`
hands them to the partitioner (docs/design.md#automatic-planning).
"""

from __future__ import annotations

import contextlib
import math
import threading
from collections.abc import Iterator, Sequence

from torch import nn

from ..devices.base import Device, Timer
from ..planning.sim.costs import CostModel, LayerCosts
from .class_profiles import KINDS, ClassProfiles, Times, smoothed

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
    """Exponentially smoothed per-layer forward, recompute and backward seconds, kept per
    device class."""

    def __init__(
        self,
        param_counts: Sequence[int],
        param_bytes: Sequence[int],
        smoothing: float = 0.3,
        device_classes: Sequence[str] | None = None,
    ):
        """``device_classes``: the :attr:`~roundpipe.devices.Device.device_class` of each
        pool device, by position (None: every device alike)."""
        if not 0 < smoothing <= 1:
            raise ValueError(f"smoothing must be in (0, 1], got {smoothing}")
        self.param_counts = list(param_counts)
        self.param_bytes = list(param_bytes)
        self.smoothing = smoothing
        self.device_classes = tuple(device_classes or ())
        self._lock = threading.Lock()
        self._profiles = ClassProfiles(self.param_counts, self.device_classes, smoothing)
        self._bandwidth: dict[str, float | None] = dict.fromkeys(LINKS)
        self._boundary_total = 0
        self._boundary_count = 0
        self._boundary_max = 0
        self._layer_inputs: list[int | None] = [None] * len(param_counts)

    @classmethod
    def for_modules(
        cls, modules: Sequence[nn.Module], device_classes: Sequence[str] | None = None
    ) -> LayerProfiler:
        """A profiler whose size-based estimates come from each layer's parameters, for a
        pool whose devices are of ``device_classes`` (None: every device alike)."""
        counts = [sum(p.numel() for p in m.parameters()) for m in modules]
        sizes = [sum(p.numel() * p.element_size() for p in m.parameters()) for m in modules]
        return cls(counts, sizes, device_classes=device_classes)

    @property
    def num_layers(self) -> int:
        return len(self.param_counts)

    def measured(self) -> bool:
        """Whether every layer has a forward and a backward measurement (on some class)."""
        with self._lock:
            return all(self._profiles.measured("forward")) and all(
                self._profiles.measured("backward")
            )

    def record(
        self, kind: str, layers: Sequence[int], seconds: float, device: int | None = None
    ) -> None:
        """Add one measurement of ``kind`` covering ``layers`` (split by forward share),
        timed on the pool device at position ``device`` (None: device 0)."""
        if kind not in KINDS or not layers:
            return
        with self._lock:
            name = self._profiles.class_of(device)
            for layer, share in zip(layers, self._forward_shares(name, layers), strict=True):
                self._profiles.add(kind, layer, name, seconds * share)

    def _forward_shares(self, name: str, layers: Sequence[int]) -> list[float]:
        """Each layer's share of the forward time of ``layers`` on class ``name``; the
        caller holds the lock."""
        if len(layers) == 1:  # most measurements: one layer's, nothing to split
            return [1.0]
        weights = self._profiles.forward_times(name, layers, self._estimate)
        total = sum(weights)
        return [w / total for w in weights] if total > 0 else [1 / len(layers)] * len(layers)

    def record_transfer(self, link: str, nbytes: int, seconds: float) -> None:
        """Add one timed transfer of ``nbytes`` over ``link`` ("h2d" or "d2h")."""
        if link not in self._bandwidth or nbytes < MIN_TIMED_BYTES or seconds <= 0:
            return
        with self._lock:
            self._bandwidth[link] = self._smooth(self._bandwidth[link], nbytes / seconds)

    def _smooth(self, old: float | None, value: float) -> float:
        return smoothed(old, value, self.smoothing)

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

    def forward_seconds(self) -> list[float]:
        """The reference class's forward seconds per layer (measured, else estimated)."""
        with self._lock:
            return list(self._times(self._profiles.reference)["forward"])

    def _times(self, name: str) -> Times:
        """Class ``name``'s times per kind; the caller holds the lock."""
        estimates = [self._estimate(i) for i in range(self.num_layers)]
        reference = self._profiles.reference_times(estimates)
        return self._profiles.class_times(name, reference)

    def _estimate(self, layer: int) -> float:
        return max(self.param_counts[layer] * _ESTIMATE_SECONDS_PER_PARAM, _ESTIMATE_FLOOR_SECONDS)

    def costs(self) -> LayerCosts:
        """Current per-layer costs of the reference class (device 0's): measurements where
        available, estimates elsewhere."""
        with self._lock:
            times = self._times(self._profiles.reference)
        return self._layer_costs(times)

    def class_costs(self) -> dict[str, LayerCosts]:
        """Each device class's current per-layer costs: its own measurements, the
        reference's times its measured relative time elsewhere (:mod:`.class_profiles`)."""
        with self._lock:
            times = {name: self._times(name) for name in self._profiles.classes}
        return {name: self._layer_costs(t) for name, t in times.items()}

    def relative_speeds(self) -> dict[str, float]:
        """Each device class's measured speed relative to the fastest class (1.0: the
        fastest; every class is at 1.0 until it and the reference class have measured
        comparable layers: :meth:`.ClassProfiles.relative_time`); empty when the profiler
        was built without device classes."""
        if not self.device_classes:
            return {}
        with self._lock:
            return self._profiles.relative_speeds()

    def _layer_costs(self, times: Times) -> LayerCosts:
        return LayerCosts(
            forward=times["forward"],
            backward=times["backward"],
            param_bytes=tuple(self.param_bytes),
            activation_bytes=self.activation_bytes(),
            recompute=times["recompute"],
            boundary_bytes=self.boundary_bytes(),
        )

    def cost_model(self, weight_chunk_bytes: int | None) -> CostModel:
        """:meth:`costs` with the measured link: an activation hop (device → host →
        device) costs its download plus its upload; weights upload at the measured
        host→device bandwidth in chunks of ``weight_chunk_bytes``. On a pool of several
        device classes, each device runs at its class's :meth:`class_costs`."""
        h2d, d2h = self.bandwidth("h2d"), self.bandwidth("d2h")
        boundary = self.boundary_bytes()
        by_class = self.class_costs()
        mixed = len(by_class) > 1
        return CostModel(
            by_class[self._profiles.reference],
            comm=boundary / d2h + boundary / h2d,
            h2d_bandwidth=h2d,
            d2h_bandwidth=d2h,
            weight_chunk_bytes=weight_chunk_bytes,
            device_layers=tuple(by_class[c] for c in self.device_classes) if mixed else (),
        )
