"""Every CUDA event the backend creates is a blocking one, checked without a GPU.

A host thread waiting on a non-blocking CUDA event spins a core at 100%, competing with
the host optimizer and the issue threads (``docs/design.md``, the CUDA backend).
``torch.cuda.Event`` is replaced by a recorder, so the backend's event-making code runs
on this machine too.
"""

from __future__ import annotations

import pytest
import torch

from roundpipe.devices import OpInfo
from roundpipe.devices import cuda as cuda_backend
from roundpipe.devices.cuda_timeline import CudaTimeline


class RecordedEvent:
    made: list[dict] = []

    def __init__(self, **kwargs) -> None:
        RecordedEvent.made.append(kwargs)

    def record(self, stream=None) -> None:
        pass


@pytest.fixture
def recorded(monkeypatch) -> list[dict]:
    RecordedEvent.made = []
    monkeypatch.setattr(torch.cuda, "Event", RecordedEvent)
    return RecordedEvent.made


def test_timer_events_are_blocking(recorded):
    timer = cuda_backend._CudaTimer()
    timer.start()
    timer.stop()
    assert len(recorded) == 2
    assert all(kwargs.get("blocking") and kwargs.get("enable_timing") for kwargs in recorded)


def test_timeline_events_are_blocking(recorded):
    timeline = CudaTimeline()  # no GPU: only the span bookkeeping
    timeline.recording = True
    start = timeline.op_start(stream=None)
    timeline.op_end(0, "compute", OpInfo("forward"), start, stream=None)
    assert len(recorded) == 2
    assert all(kwargs.get("blocking") for kwargs in recorded)


def test_stream_events_are_blocking(recorded):
    stream = object.__new__(cuda_backend._CudaStream)  # no GPU: only the event it makes
    stream.stream, stream.error = None, None
    stream.record()
    assert recorded == [{"blocking": True}]
