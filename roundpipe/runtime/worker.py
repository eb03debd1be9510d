"""A device worker: the host threads that issue stage jobs to one device.

Every job passes the *prefetch* thread (its claim, the memory bound, its weight upload)
and then the *issue* thread (a :class:`~.issuer.JobIssuer`), so job *j*'s weights
upload while job *j* − 1 computes; the *completer* thread does the host work that must
follow device work. The threads survive every error, hold the worker, never the
``RoundPipe``, and fail a job through one path (docs/design.md#device-workers; the
picture: docs/design.md#threads-and-streams-of-a-call).
"""

from __future__ import annotations

import collections
import contextlib
import queue
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from ..core.config import MAX_PREFETCH_STAGES
from ..core.program import JobProgram
from ..core.schedule import Job
from ..devices.base import Device, Event
from ..errors import locate, release_frames
from .call import Call
from .context import GradientReports, JobContext, WorkerContext
from .issuer import JobIssuer
from .layers import LayerBinding
from .op_table import issue_job, upload_stage_weights
from .params import ParameterStore
from .prefetch import StageWeights
from .profiler import LayerProfiler
from .sync import VersionGate
from .versions import WeightVersions

_STOP = object()


@dataclass(eq=False)
class DeviceJob:
    """One job on this device, handed from the prefetch thread to the issue thread."""

    ctx: JobContext
    claimed: bool = False
    program: JobProgram | None = None
    weights: StageWeights | None = None
    error: BaseException | None = None
    """Why the weights could not be issued (the issue thread fails the job with it)."""
    end: Event | None = None
    """Recorded on the compute stream after the job's last op (None: nothing issued,
    or the job has finished)."""
    issuer: JobIssuer | None = None
    """What issued the job's compute, until it has finished."""
    prefetched: threading.Event = field(default_factory=threading.Event)
    issued: threading.Event = field(default_factory=threading.Event)

    def wait_until_finished(self) -> None:
        """On the host: until the device has run every op of this job."""
        self.issued.wait()
        end = self.end
        if end is not None:
            end.wait(None)

    def let_go(self, error: BaseException | None) -> None:
        """Once every op of the job has run: drop what could keep its device memory
        alive, as its ``error`` may be kept long after (docs/design.md#errors). After an
        error the ops that would have emptied the slots were skipped (the release of
        the weights, the consumers of uploads), and the error's traceback keeps the
        closures of the ops that raised it, which reach the issuer's slots. The end
        event goes too: waiting on it again would re-raise its error, adding frames."""
        if self.weights is not None:
            self.weights.tensors.take()
        if self.issuer is not None:
            for slot in self.issuer.results.values():
                slot.take()
        self.issuer = self.end = None
        release_frames(error)


class DeviceWorker:
    """Issues jobs to one device; owns a completer thread for host-side follow-ups."""

    def __init__(
        self,
        device: Device,
        layers: list[LayerBinding],
        store: ParameterStore,
        versions: WeightVersions,
        buffer_gates: Mapping[int, VersionGate],
        profiler: LayerProfiler,
        reports: GradientReports,
    ) -> None:
        self.device = device
        self.profiler = profiler
        self._prefetches: queue.SimpleQueue = queue.SimpleQueue()
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        followups: queue.SimpleQueue = queue.SimpleQueue()
        self._followups = followups
        self.context = WorkerContext(
            device=device,
            layers=tuple(layers),
            store=store,
            versions=versions,
            buffer_gates=buffer_gates,
            after=lambda events, fn, on_error: followups.put((events, fn, on_error)),
            reports=reports,
            gradient_room=threading.Semaphore(1),
        )
        self._threads: list[threading.Thread] = []
        self._start_lock = threading.Lock()
        # The last jobs prefetched: the memory bound waits on the one that far back.
        self._prefetched: collections.deque[DeviceJob] = collections.deque(
            maxlen=MAX_PREFETCH_STAGES + 1
        )

    # -- threads ---------------------------------------------------------------------

    def start(self) -> None:
        with self._start_lock:
            if self._threads:
                return
            _preload_lazy_imports()
            loops = (
                (_prefetch_loop, self._prefetches, "prefetch"),
                (_issue_loop, self._jobs, "issue"),
                (_completer_loop, self._followups, "completer"),
            )
            for loop, tasks, role in loops:
                thread = threading.Thread(
                    target=loop, args=(tasks, self), name=f"roundpipe-{self.device!r}-{role}"
                )
                thread.daemon = True
                thread.start()
                self._threads.append(thread)

    def stop(self) -> None:
        """Stop the threads once their queued work is done (safe to call again)."""
        with self._start_lock:
            threads = list(self._threads)
            queues = (self._prefetches, self._jobs, self._followups)
            for thread, tasks in zip(threads, queues, strict=False):
                tasks.put(_STOP)
                thread.join()
            self._threads = []

    def submit(self, call: Call, job: Job, loss_scale: float | None) -> None:
        """Queue ``job`` of ``call`` (its losses multiplied by ``loss_scale``)."""
        self.start()
        record = DeviceJob(JobContext(self.context, call, job, loss_scale))
        self._prefetches.put(record)
        self._jobs.put(record)

    # -- one job -------------------------------------------------------------------------

    def prefetch(self, record: DeviceJob) -> None:
        """On the prefetch thread: claim the job and issue its weights within the bound."""
        ctx = record.ctx
        try:
            if not ctx.call.claim(ctx.job):
                return  # cancelled after an interrupt, or already run
            record.claimed = True
            depth = ctx.call.config.prefetch_stages
            if len(self._prefetched) > depth:
                self._prefetched[-depth - 1].wait_until_finished()
            record.program, record.weights = upload_stage_weights(ctx)
        except BaseException as exc:  # noqa: BLE001 - handed to the issue thread
            record.error = locate(exc, f"{ctx.name} on device {self.device!r}")
        finally:
            self._prefetched.append(record)
            record.prefetched.set()

    def issue(self, record: DeviceJob) -> None:
        """On the issue thread: issue the job's compute behind its weights."""
        record.prefetched.wait()
        if not record.claimed:
            record.issued.set()
            return
        ctx = record.ctx
        error = record.error
        if error is None:
            try:
                program, weights = record.program, record.weights
                assert program is not None and weights is not None, "prefetched without error"
                issuer = record.issuer = JobIssuer(ctx, program, weights)
                issue_job(issuer)
            except BaseException as exc:  # noqa: BLE001 - handed to the call
                error = locate(exc, f"{ctx.name} on device {self.device!r}")
        try:
            ends = [stream.record() for stream in self.device.streams.values()]
            record.end = ends[0]
        finally:
            record.issued.set()
        if error is not None:
            self.fail_job(ctx.call, ctx.job, error, ends, record)
            return
        call, job, profiler = ctx.call, ctx.job, self.profiler

        def done() -> None:
            for kind, layers, timer in issuer.compute.timings:
                profiler.record(kind, layers, timer.seconds(), job.device)
            for transfer in issuer.transfers:
                profiler.record_timing(transfer)
            record.let_go(None)
            call.latch.finish(job.index)

        def failed(exc: BaseException) -> None:
            record.let_go(exc)
            call.latch.finish(job.index, exc)

        self.context.after(ends, done, failed)

    def fail_job(
        self,
        call: Call,
        job: Job,
        error: BaseException,
        ends: list[Event] | None = None,
        record: DeviceJob | None = None,
    ) -> None:
        """The one way a job fails: whoever waits on its outputs or on its layers'
        buffers is released now; the job finishes on the call's latch with ``error``
        once ``ends`` (events after the ops issued for it) have completed."""
        call.fail_outputs(job, error)
        self.context.open_buffer_gates(call, job)

        def finish(_: BaseException | None = None) -> None:
            if record is not None:
                record.let_go(error)
            call.latch.finish(job.index, error)

        if ends:
            self.context.after(ends, finish, finish)
        else:
            finish()


def _prefetch_loop(records: queue.SimpleQueue, worker: DeviceWorker) -> None:
    while True:
        record = records.get()
        if record is _STOP:
            return
        worker.prefetch(record)  # never raises: errors go to the record


def _issue_loop(records: queue.SimpleQueue, worker: DeviceWorker) -> None:
    while True:
        record = records.get()
        if record is _STOP:
            return
        try:
            worker.issue(record)
        except BaseException as exc:  # noqa: BLE001 - the thread must outlive any job
            record.issued.set()
            worker.fail_job(record.ctx.call, record.ctx.job, exc, record=record)


def _completer_loop(followups: queue.SimpleQueue, worker: DeviceWorker) -> None:
    while True:
        item = followups.get()
        if item is _STOP:
            return
        _follow_up(*item)


def _follow_up(
    events: list[Event], fn: Callable[[], None], on_error: Callable[[BaseException], None]
) -> None:
    """``fn()`` once every event has completed, else ``on_error`` with the first error,
    also once all of them completed (nothing issued before them still runs then)."""
    errors = []
    for event in events:
        try:
            event.synchronize()
        except BaseException as exc:  # noqa: BLE001 - handed to the call
            errors.append(exc)
    if not errors:
        try:
            fn()
            return
        except BaseException as exc:  # noqa: BLE001 - handed to the call
            errors.append(exc)
    for error in errors:
        release_frames(error)  # the work that raised them has finished
    with contextlib.suppress(BaseException):  # the thread outlives any handler
        on_error(errors[0])


def _preload_lazy_imports() -> None:
    """``torch.autograd.backward(tensors, grad_tensors)`` imports sympy-heavy modules the
    first time it runs (~0.5 s); import them here, on the caller's thread, rather than
    inside the first backward stage's compute op where they would stall the pipeline."""
    import torch.fx.experimental.symbolic_shapes  # noqa: F401
