"""A device worker: the host threads that issue stage jobs to one device.

Jobs arrive in schedule order on the *issue* thread, which hands each to a
:class:`~.issuer.JobIssuer` (the job's stream ops, issued without waiting on the
device). Host-side work that must follow device work (accumulating downloaded
gradients, writing back buffers, noting a job finished) goes to the *completer*
thread, which waits on the events first. Both threads survive every error: an
error is handed to the call it belongs to.

The threads hold the worker, never the ``RoundPipe`` that owns it, so an unclosed
model can still be collected (its session then stops them).
"""

from __future__ import annotations

import collections
import contextlib
import queue
import threading
from collections.abc import Callable

from ..devices import Device, Event
from ..errors import locate
from ..schedule import Job, JobKind
from .call import Call
from .issuer import JobIssuer, job_name
from .layers import LayerBinding
from .params import ParameterStore
from .profiler import LayerProfiler
from .sync import VersionGate
from .versions import WeightVersions

_STOP = object()
MAX_PREFETCH = 4


class DeviceWorker:
    """Issues jobs to one device; owns a completer thread for host-side follow-ups."""

    def __init__(
        self,
        device: Device,
        layers: list[LayerBinding],
        store: ParameterStore,
        versions: WeightVersions,
        buffer_gates: dict[int, VersionGate],
        profiler: LayerProfiler,
    ) -> None:
        self.device = device
        self.layers = layers
        self.store = store
        self.versions = versions
        self.profiler = profiler
        self.buffer_gates = buffer_gates
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._followups: queue.SimpleQueue = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []
        self._start_lock = threading.Lock()
        # Events marking the end of this device's last jobs and compute ops, used to
        # bound prefetch: weights one stage ahead, activations one microbatch ahead.
        self.job_ends: collections.deque[Event] = collections.deque(maxlen=MAX_PREFETCH + 1)
        self.compute_marks: collections.deque[Event] = collections.deque(maxlen=2)

    # -- threads ---------------------------------------------------------------------

    def start(self) -> None:
        with self._start_lock:
            if self._threads:
                return
            _preload_lazy_imports()
            loops = ((_issue_loop, self._jobs, "issue"), (_followup_loop, self._followups, "done"))
            for loop, tasks, role in loops:
                thread = threading.Thread(
                    target=loop, args=(tasks, self), name=f"roundpipe-{self.device!r}-{role}"
                )
                thread.daemon = True
                thread.start()
                self._threads.append(thread)

    def stop(self) -> None:
        """Stop both threads once their queued work is done (safe to call again)."""
        with self._start_lock:
            threads = list(self._threads)
            for thread, tasks in zip(threads, (self._jobs, self._followups), strict=False):
                tasks.put(_STOP)
                thread.join()
            self._threads = []

    def forget_events(self) -> None:
        """After a failure: drop remembered events, which may carry the error."""
        self.job_ends.clear()
        self.compute_marks.clear()

    def submit(self, call: Call, job: Job) -> None:
        self.start()
        self._jobs.put((call, job))

    def after(
        self,
        events: list[Event],
        fn: Callable[[], None],
        on_error: Callable[[BaseException], None],
    ) -> None:
        """Run ``fn`` on the completer thread once ``events`` completed; on an error
        (of the events or of ``fn``) run ``on_error(error)`` instead."""
        self._followups.put((events, fn, on_error))

    def open_buffer_gates(self, call: Call, job: Job) -> None:
        """Let later calls read the buffers of ``job``'s layers (it will not write them)."""
        if job.kind is not JobKind.BACKWARD:
            for index in job.layers:
                if index in self.buffer_gates:
                    self.buffer_gates[index].advance_to(call.seq + 1)

    def issue(self, call: Call, job: Job) -> None:
        if not call.claim(job):
            return  # cancelled after an interrupt, or already run
        error: BaseException | None = None
        issuer = JobIssuer(self, call, job)
        try:
            issuer.issue()
        except BaseException as exc:  # noqa: BLE001 - handed to the call
            error = locate(exc, f"{job_name(job)} on device {self.device!r}")
            call.fail_outputs(job, error)
            self.open_buffer_gates(call, job)
        self._finish(call, job, error, issuer.timings)

    def _finish(self, call: Call, job: Job, error: BaseException | None, timings: list) -> None:
        ends = [stream.record() for stream in self.device.streams.values()]
        self.job_ends.append(ends[0])

        def done() -> None:
            if error is None:
                for kind, layers, timer in timings:
                    self.profiler.record(kind, layers, timer.seconds())
            call.latch.finish(job.index, error)

        self.after(ends, done, on_error=lambda exc: call.latch.finish(job.index, error or exc))


def _issue_loop(jobs: queue.SimpleQueue, worker: DeviceWorker) -> None:
    while True:
        item = jobs.get()
        if item is _STOP:
            return
        call, job = item
        try:
            worker.issue(call, job)
        except BaseException as exc:  # noqa: BLE001 - the thread must outlive any job
            call.fail_outputs(job, exc)
            call.latch.finish(job.index, exc)


def _followup_loop(followups: queue.SimpleQueue, worker: DeviceWorker) -> None:
    while True:
        item = followups.get()
        if item is _STOP:
            return
        events, fn, on_error = item
        try:
            for event in events:
                event.synchronize()
            fn()
        except BaseException as exc:  # noqa: BLE001 - handed to the call
            with contextlib.suppress(BaseException):  # the thread outlives any handler
                on_error(exc)


def _preload_lazy_imports() -> None:
    """``torch.autograd.backward(tensors, grad_tensors)`` imports sympy-heavy modules the
    first time it runs (~0.5 s); import them here, on the caller's thread, rather than
    inside the first backward stage's compute op where they would stall the pipeline."""
    import torch.fx.experimental.symbolic_shapes  # noqa: F401
