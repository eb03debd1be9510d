"""A CUDA pool's timeline: timing events recorded around each stream op once
``start_recording`` was called, turned into spans on the host clock."""

from __future__ import annotations

import time

import torch

from .base import OpInfo, SpanRecord


class CudaTimeline:
    """The timing events of the ops run since :meth:`start`, by worker (timeline row)."""

    def __init__(self) -> None:
        self.recording = False
        self._pending: list[tuple[int, str, OpInfo, torch.cuda.Event, torch.cuda.Event]] = []
        self._origin: dict[int, tuple[torch.cuda.Event, float]] = {}

    def start(self, workers: list[tuple[int, int]]) -> None:
        """Record from now on; ``workers``: each worker's row and GPU."""
        self._pending = []
        self._origin = {}
        for row, index in workers:
            with torch.cuda.device(index):
                origin = torch.cuda.Event(enable_timing=True, blocking=True)
                origin.record()
            self._origin[row] = (origin, time.perf_counter())
        self.recording = True

    def op_start(self, stream: torch.cuda.Stream) -> torch.cuda.Event | None:
        if not self.recording:
            return None
        event = torch.cuda.Event(enable_timing=True, blocking=True)
        event.record(stream)
        return event

    def op_end(
        self, row: int, name: str, info: OpInfo, start: torch.cuda.Event | None, stream
    ) -> None:
        if start is None:
            return
        end = torch.cuda.Event(enable_timing=True, blocking=True)
        end.record(stream)
        self._pending.append((row, name, info, start, end))

    def spans(self) -> list[SpanRecord]:
        """The recorded ops as spans (the GPUs synchronized by the caller first)."""
        spans = []
        for row, name, info, start, end in self._pending:
            origin, origin_wall = self._origin[row]
            begin = origin_wall + origin.elapsed_time(start) / 1e3
            spans.append(SpanRecord(row, name, info, begin, begin + start.elapsed_time(end) / 1e3))
        return spans
