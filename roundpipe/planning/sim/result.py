"""What a simulation reports: makespan, bubbles split by cause, memory, timeline.

Bubbles are idle time of each device's compute stream, split into fill, switch, drain
and steady parts that sum to the total (docs/design.md#simulator).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from ...core.timeline import Span, Timeline

COMPUTE_KINDS = frozenset({"forward", "recompute", "backward", "fused"})
_STARTS_FORWARD = frozenset({"forward", "fused"})
_ENDS_FORWARD = frozenset({"forward"})


@dataclass(frozen=True)
class Bubbles:
    """Idle fractions of ``makespan x devices``; ``total == fill + switch + drain + steady``."""

    fill: float
    switch: float
    drain: float
    steady: float

    @property
    def total(self) -> float:
        return self.fill + self.switch + self.drain + self.steady


@dataclass(frozen=True)
class SimResult:
    """One simulated iteration of one schedule."""

    schedule: str
    num_devices: int
    makespan: float
    busy: float
    """Total compute seconds over all devices."""
    bubbles: Bubbles
    exposed_comm: float
    """Device-seconds compute waited only because data or weights were in flight."""
    peak_memory: tuple[int, ...]
    """Peak bytes resident on each device."""
    timeline: Timeline = field(repr=False, compare=False)
    iteration_time: float | None = None
    """Steady-state seconds per iteration (RoundPipe with the async optimizer)."""
    steady_bubble_ratio: float | None = None
    detail: str = ""

    @property
    def bubble_ratio(self) -> float:
        return self.bubbles.total

    def to_dict(self) -> dict:
        return {
            "schedule": self.schedule,
            "detail": self.detail,
            "devices": self.num_devices,
            "makespan": self.makespan,
            "bubble_ratio": self.bubble_ratio,
            "fill": self.bubbles.fill,
            "switch": self.bubbles.switch,
            "drain": self.bubbles.drain,
            "steady": self.bubbles.steady,
            "steady_bubble_ratio": self.steady_bubble_ratio,
            "iteration_time": self.iteration_time,
            "exposed_comm": self.exposed_comm,
            "peak_memory": list(self.peak_memory),
        }


def bubbles(spans: Sequence[Span], num_devices: int, makespan: float) -> Bubbles:
    """Split the compute idle time of ``spans`` into fill/switch/drain/steady fractions."""
    parts = {"fill": 0.0, "switch": 0.0, "drain": 0.0, "steady": 0.0}
    for device in range(num_devices):
        ops = sorted(
            (s for s in spans if s.device == device and s.kind in COMPUTE_KINDS),
            key=lambda s: s.start,
        )
        if not ops:
            parts["fill"] += makespan
            continue
        parts["fill"] += ops[0].start
        parts["drain"] += makespan - ops[-1].end
        for before, after in zip(ops, ops[1:], strict=False):
            gap = after.start - before.end
            switching = before.kind in _ENDS_FORWARD and after.kind not in _STARTS_FORWARD
            parts["switch" if switching else "steady"] += gap
    scale = 1.0 / (makespan * num_devices) if makespan > 0 else 0.0
    return Bubbles(**{name: max(0.0, value) * scale for name, value in parts.items()})


def compute_makespan(spans: Sequence[Span]) -> float:
    return max((s.end for s in spans if s.kind in COMPUTE_KINDS), default=0.0)


def busy_time(spans: Sequence[Span]) -> float:
    return sum(s.duration for s in spans if s.kind in COMPUTE_KINDS)


def peak_memory(intervals: Sequence[tuple[int, float, float, int]], num_devices: int) -> list[int]:
    """Peak of ``(device, start, end, bytes)`` allocations per device (freed at ``end``)."""
    peaks = []
    for device in range(num_devices):
        events = []
        for dev, start, end, size in intervals:
            if dev == device and size:
                events += [
                    (start, 1, size),
                    (end, 0, -size),
                ]  # frees sort before allocs
        level = peak = 0
        for _, _, delta in sorted(events):
            level += delta
            peak = max(peak, level)
        peaks.append(peak)
    return peaks
