"""What a job's code may use, handed down frozen by its device worker (no back-pointers).

The prefetch, issue and compute code of a job get a :class:`JobContext`: the job, its
call, and the :class:`WorkerContext` of the device it runs on.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from ..core.schedule import Job, JobKind
from ..devices.base import Device, Event
from .call import Call
from .layers import LayerBinding
from .params import ParameterStore
from .sync import VersionGate
from .versions import WeightVersions

FollowUp = Callable[[list[Event], Callable[[], None], Callable[[BaseException], None]], None]
"""``after(events, fn, on_error)``: run ``fn`` on the completer thread once ``events``
completed, ``on_error(error)`` instead if they or ``fn`` failed."""


@dataclass(frozen=True)
class GradientReports:
    """How a device worker tells the session about a call's gradients (the session is
    the ledger's only writer, so the worker reports instead of writing)."""

    accumulated: Callable[[Call], None]
    """Some gradient of a call reaches the masters (reported before the first is
    added, so that a failure half-way counts it)."""
    gradients_in: Callable[[Call, Job, frozenset[int]], None]
    """A job's gradients (of the given masters) were added."""


@dataclass(frozen=True)
class WorkerContext:
    """One device worker's share of the model: the same for every job it runs."""

    device: Device
    layers: tuple[LayerBinding, ...]
    store: ParameterStore
    versions: WeightVersions
    buffer_gates: Mapping[int, VersionGate]
    """Per layer with buffers: the seq of the first call that may read them."""
    after: FollowUp
    reports: GradientReports
    gradient_room: threading.Semaphore
    """Held from a job's gradient download until they reached the masters: at most one
    job's gradients per device wait in host memory (docs/design.md#gradients)."""

    def open_buffer_gates(self, call: Call, job: Job) -> None:
        """Let later calls read the buffers of ``job``'s layers (it will not write them)."""
        if job.kind is not JobKind.BACKWARD:
            for index in job.layers:
                if index in self.buffer_gates:
                    self.buffer_gates[index].advance_to(call.seq + 1)

    def writes_back(self, job: Job) -> bool:
        """Whether ``job`` writes its layers' buffers back to the host."""
        return job.kind is not JobKind.BACKWARD and any(i in self.buffer_gates for i in job.layers)


@dataclass(frozen=True)
class JobContext:
    """One job on one device."""

    worker: WorkerContext
    call: Call
    job: Job
    loss_scale: float | None
    """The GradScaler scale the job's losses were multiplied by (None: unscaled)."""

    @property
    def device(self) -> Device:
        return self.worker.device

    @property
    def name(self) -> str:
        return self.job.description
