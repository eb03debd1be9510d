"""Layer timings kept per device class, and each class's costs derived from them.

On a mixed pool a layer's time depends on the kind of card that ran it, so the
profiler keeps one smoothed series per device class (:attr:`Device.device_class`). A
class's time for a layer it has run is its own measurement; for one it has not (yet)
run, the reference class's time (device 0's) times the class's *relative time*: the
median of its time over the reference's on the layers both have measured, so a class's
speed is measured, never assumed (docs/design.md#mixed-pools). A mixed pool places
every call's jobs alike, so two classes may share no measured layer at all; then
layers of one size (a model's identical decoder layers) stand in for each other.
Not thread-safe: the :class:`~.profiler.LayerProfiler` that owns it holds its lock
around every use.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from typing import cast

KINDS = ("forward", "recompute", "backward")
"""The kinds of compute timed per layer."""

Times = dict[str, tuple[float, ...]]
"""Per kind, one time per layer."""


def smoothed(old: float | None, value: float, smoothing: float) -> float:
    """The exponentially smoothed series ``old`` after ``value`` (the first value as is)."""
    return value if old is None else old + smoothing * (value - old)


class ClassProfiles:
    """Per device class, exponentially smoothed seconds per kind and layer."""

    def __init__(
        self, layer_sizes: Sequence[int], device_classes: Sequence[str], smoothing: float
    ) -> None:
        """``layer_sizes``: each layer's parameter count (layers of one size are taken
        to be alike); ``device_classes``: the class of each pool device, by position
        (empty: one class, every measurement alike, as on a pool of equal devices)."""
        self.layer_sizes = tuple(layer_sizes)
        num_layers = len(self.layer_sizes)
        self.device_classes = tuple(device_classes)
        self.classes = tuple(dict.fromkeys(self.device_classes)) or ("",)
        """The distinct classes, in pool order; the first is the reference."""
        self.smoothing = smoothing
        self._seconds: dict[str, dict[str, list[float | None]]] = {
            name: {kind: [None] * num_layers for kind in KINDS} for name in self.classes
        }

    @property
    def reference(self) -> str:
        return self.classes[0]

    def class_of(self, device: int | None) -> str:
        """The class of the pool device at position ``device`` (None: the reference)."""
        if device is None or not self.device_classes:
            return self.reference
        if not 0 <= device < len(self.device_classes):
            raise ValueError(
                f"a measurement names device {device}, but the profiler knows the classes "
                f"of {len(self.device_classes)} devices: pass the device's position in "
                "pool.devices (0 to the pool's size - 1)"
            )
        return self.device_classes[device]

    def add(self, kind: str, layer: int, name: str, seconds: float) -> None:
        """Smooth one measurement into class ``name``'s series (the first as is)."""
        series = self._seconds[name][kind]
        series[layer] = smoothed(series[layer], seconds, self.smoothing)

    def measured(self, kind: str) -> list[bool]:
        """Per layer, whether some class has measured its ``kind``."""
        columns = zip(*(self._seconds[name][kind] for name in self.classes), strict=True)
        return [any(v is not None for v in column) for column in columns]

    def relative_time(self, name: str) -> float:
        """Class ``name``'s time over the reference's: the median of their ratios over
        what both have measured, taken from the first of these that has any: forwards
        and recomputes of one layer, of layers of one size (the medians of each size's
        layers; layers without parameters left out), then backwards likewise. Forwards
        and recomputes come first: they are timed layer by layer, while a backward is
        timed per stage and split by forward share. 1.0 when they share nothing."""
        mine, theirs = self._seconds[name], self._seconds[self.reference]
        for kinds in (("forward", "recompute"), ("backward",)):
            for view in (list, self._by_size):
                ratios = [
                    a / b
                    for kind in kinds
                    for a, b in zip(view(mine[kind]), view(theirs[kind]), strict=True)
                    if a is not None and b is not None and a > 0 and b > 0
                ]
                if ratios:
                    return statistics.median(ratios)
        return 1.0

    def _by_size(self, series: Sequence[float | None]) -> list[float | None]:
        """Per distinct nonzero layer size (ascending), the median of ``series`` over
        the layers of that size it has measured (None: none)."""
        sizes = sorted({size for size in self.layer_sizes if size > 0})
        found: list[float | None] = []
        for size in sizes:
            values = [
                t
                for t, layer_size in zip(series, self.layer_sizes, strict=True)
                if t is not None and layer_size == size
            ]
            found.append(statistics.median(values) if values else None)
        return found

    def reference_times(self, estimates: Sequence[float]) -> Times:
        """The reference class's times: its measurements; where it has none, the other
        classes' measurements over their relative time; else ``estimates`` for a
        forward, the forward for a recompute and twice it for a backward."""
        relative = {name: self.relative_time(name) for name in self.classes[1:]}

        def known(kind: str) -> list[float | None]:
            found = list(self._seconds[self.reference][kind])
            for layer, own in enumerate(found):
                others = [
                    seconds / ratio
                    for name, ratio in relative.items()
                    if (seconds := self._seconds[name][kind][layer]) is not None
                ]
                if own is None and others:
                    found[layer] = statistics.median(others)
            return found

        forward = _filled(known("forward"), estimates)
        recompute = _filled(known("recompute"), forward)
        backward = _filled(known("backward"), [2 * f for f in forward])
        return {"forward": forward, "recompute": recompute, "backward": backward}

    def class_times(self, name: str, reference: Times) -> Times:
        """Class ``name``'s times: its measurements, and the ``reference`` times times its
        relative time where it has none."""
        if name == self.reference:
            return reference
        ratio = self.relative_time(name)
        own = self._seconds[name]
        return {kind: _filled(own[kind], [r * ratio for r in reference[kind]]) for kind in KINDS}

    def forward_times(
        self, name: str, layers: Sequence[int], estimate: Callable[[int], float]
    ) -> list[float]:
        """Class ``name``'s forward seconds of ``layers``, as :meth:`class_times` of
        :meth:`reference_times` (``estimate(layer)`` for what nothing measured) gives
        them, found for these layers only: every measurement of several layers is split
        by them, so this runs once per such op."""
        own = self._seconds[name]["forward"]
        if all(own[i] is not None for i in layers):
            return [cast(float, own[i]) for i in layers]
        ratio = 1.0 if name == self.reference else self.relative_time(name)
        reference = self._seconds[self.reference]["forward"]
        relative: dict[str, float] | None = None  # the other classes', if needed
        times = []
        for i in layers:
            seconds = own[i]
            if seconds is None:
                base = reference[i]
                if base is None:
                    if relative is None:
                        relative = {other: self.relative_time(other) for other in self.classes[1:]}
                    others = [
                        measured / other_ratio
                        for other, other_ratio in relative.items()
                        if (measured := self._seconds[other]["forward"][i]) is not None
                    ]
                    base = statistics.median(others) if others else estimate(i)
                seconds = base * ratio
            times.append(seconds)
        return times

    def relative_speeds(self) -> dict[str, float]:
        """Each class's speed relative to the fastest (1.0: the fastest), measured."""
        speeds = {name: 1 / self.relative_time(name) for name in self.classes}
        fastest = max(speeds.values())
        return {name: speed / fastest for name, speed in speeds.items()}


def _filled(times: Sequence[float | None], defaults: Sequence[float]) -> tuple[float, ...]:
    return tuple(d if t is None else t for t, d in zip(times, defaults, strict=True))
