"""A neutral timeline of a run: the simulator and the runtime both produce one.

A :class:`Timeline` is a flat list of :class:`Span` values: what ran on which
device and stream, from when to when (seconds). It exports to Chrome trace JSON
(open it in https://ui.perfetto.dev: one process per device, one thread per
stream) and to a Gantt chart PNG (one row per device/stream, coloured by kind).
Device ``-1`` is the host (e.g. the optimizer thread).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

HOST = -1
"""Device id used for spans that run on the host (optimizer thread, host copies)."""

KIND_COLORS: dict[str, str] = {
    "forward": "#4c78a8",
    "recompute": "#9ecae9",
    "backward": "#f58518",
    "fused": "#54a24b",
    "upload": "#b279a2",
    "download": "#e45756",
    "optimizer": "#72b7b2",
    "loss": "#eeca3b",
    "comm": "#79706e",
}
_OTHER_COLOR = "#bab0ac"


@dataclass(frozen=True)
class Span:
    """One interval of work on one stream of one device (times in seconds)."""

    device: int
    stream: str
    kind: str
    label: str
    start: float
    end: float

    def __post_init__(self) -> None:
        if self.end < self.start:
            raise ValueError(
                f"span {self.label!r} ends ({self.end}) before it starts ({self.start})"
            )

    @property
    def duration(self) -> float:
        return self.end - self.start


@dataclass
class Timeline:
    """The spans of one run, in any order."""

    spans: list[Span] = field(default_factory=list)

    @classmethod
    def from_records(cls, records: Iterable, origin: float) -> Timeline:
        """The spans of executed-op records (``devices.SpanRecord``), timed from ``origin``."""
        return cls(
            [
                Span(
                    device=r.device,
                    stream=r.stream,
                    kind=r.info.kind,
                    label=r.info.label,
                    start=max(r.start - origin, 0.0),
                    end=max(r.end - origin, 0.0),
                )
                for r in records
            ]
        )

    def add(self, span: Span) -> None:
        self.spans.append(span)

    def extend(self, spans: Iterable[Span]) -> None:
        self.spans.extend(spans)

    @property
    def end(self) -> float:
        return max((s.end for s in self.spans), default=0.0)

    def rows(self) -> list[tuple[int, str]]:
        """``(device, stream)`` pairs in display order: devices ascending, host last."""
        pairs = {(s.device, s.stream) for s in self.spans}
        return sorted(pairs, key=lambda p: (p[0] == HOST, p[0], p[1]))

    def to_chrome_trace(self) -> dict:
        """Chrome trace events (``ph: "X"``, microseconds), with process/thread names."""
        events: list[dict] = []
        thread_ids: dict[tuple[int, str], int] = {}
        for device, stream in self.rows():
            pid = _pid(device)
            if not any(e["pid"] == pid for e in events):
                events.append(_metadata("process_name", pid, 0, _device_name(device)))
                events.append(
                    {
                        "ph": "M",
                        "name": "process_sort_index",
                        "pid": pid,
                        "args": {"sort_index": pid},
                    }
                )
            tid = thread_ids[(device, stream)] = len(thread_ids) + 1
            events.append(_metadata("thread_name", pid, tid, stream))
        for span in sorted(self.spans, key=lambda s: (s.start, s.device)):
            events.append(
                {
                    "ph": "X",
                    "name": span.label,
                    "cat": span.kind,
                    "pid": _pid(span.device),
                    "tid": thread_ids[(span.device, span.stream)],
                    "ts": span.start * 1e6,
                    "dur": span.duration * 1e6,
                }
            )
        return {"traceEvents": events, "displayTimeUnit": "ms"}

    def save_chrome_trace(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_chrome_trace()))

    def save_gantt(self, path: str | Path, title: str | None = None) -> None:
        """Draw one row per device/stream, coloured by kind, to a PNG (needs matplotlib)."""
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.patches import Patch

        rows = self.rows()
        row_of = {row: i for i, row in enumerate(rows)}
        fig, ax = plt.subplots(figsize=(12, 0.4 * len(rows) + 1.5))
        scale, unit = _time_unit(self.end)
        for span in self.spans:
            ax.barh(
                row_of[(span.device, span.stream)],
                span.duration * scale,
                left=span.start * scale,
                height=0.8,
                color=KIND_COLORS.get(span.kind, _OTHER_COLOR),
                edgecolor="black",
                linewidth=0.2,
            )
        ax.set_yticks(range(len(rows)))
        ax.set_yticklabels([f"{_device_name(d)} {s}" for d, s in rows])
        ax.invert_yaxis()
        ax.set_xlabel(f"time ({unit})")
        kinds = sorted({s.kind for s in self.spans})
        ax.legend(
            handles=[Patch(color=KIND_COLORS.get(k, _OTHER_COLOR), label=k) for k in kinds],
            loc="upper center",
            bbox_to_anchor=(0.5, -0.12 - 0.2 / max(len(rows), 1)),
            ncol=len(kinds),
            fontsize="small",
        )
        if title:
            ax.set_title(title)
        fig.tight_layout()
        fig.savefig(path, dpi=100)
        plt.close(fig)


def _pid(device: int) -> int:
    # Perfetto sorts processes by pid; keep the host after every device.
    return 10_000 if device == HOST else device


def _device_name(device: int) -> str:
    return "host" if device == HOST else f"device {device}"


def _metadata(name: str, pid: int, tid: int, value: str) -> dict:
    return {"ph": "M", "name": name, "pid": pid, "tid": tid, "args": {"name": value}}


def _time_unit(end: float) -> tuple[float, str]:
    return (1.0, "s") if end >= 10 else (1e3, "ms")
