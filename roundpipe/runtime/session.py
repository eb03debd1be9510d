"""The caller's side of a RoundPipe model: calls and steps in flight, failures, lifetime.

:class:`Session` is the only writer of the caller's bookkeeping, one immutable
:class:`~.ledger.Ledger` replaced before the work it announces is handed to a thread,
and every public method first repairs the background to match it, so an interrupt at
any line leaves a model that the next call can use (docs/design.md#calls-and-sessions).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Sequence
from dataclasses import replace
from typing import NoReturn

from typing_extensions import Unpack

from ..core.schedule import Job
from ..devices.base import DevicePool
from ..errors import RoundPipeError
from . import failures, lifetime
from .backward_steps import BackwardSteps
from .call import Call, CallRequest
from .context import GradientReports
from .driving import Driving
from .inputs import HostBufferPool
from .layers import LayerBinding
from .ledger import (
    INTERRUPTED,
    ISSUING,
    RETURNED,
    RUNNING,
    CallState,
    CallStateChange,
    Ledger,
    LedgerCell,
    LedgerChange,
    StepTask,
    raise_second_backward,
)
from .optimizer import NodeSteps, OptimizerThread
from .params import ParameterStore
from .profiler import LayerProfiler
from .sync import VersionGate, wait_future
from .versions import WeightVersions
from .worker import DeviceWorker


class Session:
    """Owns the threads of one model and the bookkeeping of its calls and steps."""

    def __init__(
        self,
        pool: DevicePool,
        owns_pool: bool,
        store: ParameterStore,
        layers: list[LayerBinding],
        pin_model: str,
        grad_scaler,
        profiler: LayerProfiler,
        inputs: HostBufferPool,
        node: NodeSteps | None = None,
    ) -> None:
        """The host state and threads (started on first use) of a model wrapped on
        ``pool`` whose parameters ``store`` holds; ``inputs``: the buffers calls copy
        their inputs into; ``node``: on several nodes, what its steps go through."""
        self.pool = pool
        self.owns_pool = owns_pool
        self.store = store
        pin = functools.partial(pool.pin, mode=pin_model)
        self.versions = WeightVersions(
            store, pin, pool.unpin, node.gather if node is not None else None
        )
        buffer_gates = {layer.index: VersionGate(0) for layer in layers if layer.buffer_uids}
        self.workers = [
            DeviceWorker(
                device,
                layers,
                store,
                self.versions,
                buffer_gates,
                profiler,
                GradientReports(self._accumulated, self._gradients_in),
            )
            for device in pool
        ]
        self.backward_steps = BackwardSteps(store, layers)
        self.optimizer = OptimizerThread(
            store, self.versions, grad_scaler, node, self.state_of, self._discarded
        )
        self.inputs = inputs
        self._ledger = LedgerCell()
        self.closed = False
        self.driver: dict = {}
        """The thread inside a public method (``"thread"``) and how deeply (``"depth"``)."""
        lifetime.live_sessions().add(self)

    # -- the only writer of the ledger ---------------------------------------------------

    @property
    def ledger(self) -> Ledger:
        return self._ledger.value

    def _write(self, **changes: Unpack[LedgerChange]) -> None:
        self._ledger.change(lambda ledger: replace(ledger, **changes))

    def _set_state(self, call: Call, **changes: Unpack[CallStateChange]) -> None:
        def change(ledger: Ledger) -> Ledger:
            if call not in ledger.in_flight:
                return ledger
            return ledger.with_state(call, **changes)

        self._ledger.change(change)

    @property
    def next_seq(self) -> int:
        return self.ledger.next_seq

    def state_of(self, call: Call) -> CallState:
        return self.ledger.state(call)

    def _accumulated(self, call: Call) -> None:
        """From a completer thread: some gradient of ``call`` reaches the masters."""
        if not self.ledger.state(call).accumulated:
            self._set_state(call, accumulated=True)

    def _gradients_in(self, call: Call, job: Job, uids: frozenset[int]) -> None:
        """From a completer thread: ``job``'s gradients (of the masters ``uids``) were
        added; post-accumulate-grad hooks run for the masters whose last one this was."""
        if not call.failed:
            self.backward_steps.arrived(call, job, uids)

    def _discarded(self, calls: Sequence[Call]) -> None:
        """From the optimizer thread: the gradients ``calls`` accumulated were discarded."""
        for call in calls:
            self._set_state(call, discarded=True)

    def returned(self, call: Call) -> None:
        """The caller got ``call``'s result."""
        self._set_state(call, phase=RETURNED)

    def layers_changed(self) -> None:
        """With nothing in flight: the user changed modules; their shells are made anew."""
        self._write(layer_changes=self.ledger.layer_changes + 1)

    def interrupted_since(self, seq: int) -> None:
        """An interrupt reached the caller after the calls from ``seq`` on were issued."""
        for call in self.ledger.in_flight:
            if call.seq >= seq:
                self._set_state(call, phase=INTERRUPTED)

    # -- who may drive the model ---------------------------------------------------------

    def enter(self, what: str) -> Driving:
        """Context for a public method: one driving thread, never from inside ``step_fn``."""
        return Driving(self, self.driver, what)

    def in_step_fn(self) -> bool:
        """Whether this thread is the optimizer thread, inside a ``step_fn``."""
        return self.optimizer.is_current()

    def check_open(self) -> None:
        if self.closed:
            raise RuntimeError("this RoundPipe model was closed")

    # -- keeping the background in step with the ledger ----------------------------------

    def _repair(self) -> None:
        """Cancel jobs of calls whose issuing was cut short; queue recorded steps."""
        ledger = self.ledger
        for call in ledger.in_flight:
            if ledger.state(call).phase == ISSUING:
                error = failures.CallInterrupted(
                    "the call was interrupted while its jobs were issued"
                )
                call.cancel_unclaimed(self._fail_job_of(call, error), error)
        for task in ledger.steps:
            if not task.submitted:
                self.optimizer.submit(task)

    def _fail_job_of(self, call: Call, error: BaseException):
        return lambda job: self.workers[job.device].fail_job(call, job, error)

    def settle(self) -> None:
        """Before new work: clean up after interrupted calls, raise finished failures,
        and forget finished calls and steps (O(1) per call: they finish in order)."""
        self._repair()
        ledger = self.ledger
        if any(not ledger.state(call).returned for call in ledger.in_flight):
            self.fail_if(self.recover(None))  # an interrupted call: discard, silently
            return
        in_flight, steps = list(ledger.in_flight), list(ledger.steps)
        finished: list[Call] = []
        while in_flight and in_flight[0].latch.done:
            if in_flight[0].latch.error is not None:
                self.fail(None)
            finished.append(in_flight.pop(0))
        while steps and steps[0].done.done():
            if steps[0].done.result() is not None:
                self.fail(None)
            steps.pop(0)
        since_step = tuple(c for c in ledger.since_step if not (c.latch.done and not c.failed))
        buffers = [ledger.state(call).owned_buffers for call in finished]
        self._ledger.change(
            lambda now: replace(
                now, in_flight=tuple(in_flight), steps=tuple(steps), since_step=since_step
            ).pruned()
        )
        for owned in buffers:
            self.inputs.give_back(list(owned))

    # -- calls and steps -----------------------------------------------------------------

    def wait_for_gradient_room(self) -> None:
        """Back-pressure before a training call (docs/design.md#host-memory).

        A call's downloaded gradients wait in host memory until the step queued before it
        was applied. So that at most one call's gradients wait beyond those the step
        applies, a call starts only once the step before it is published, when a call
        since that step is unfinished (one call per step: no wait). A publish that failed
        is reported by the call itself.
        """
        ledger = self.ledger
        if ledger.since_step and self.versions.published.value < ledger.versions.newest:
            with contextlib.suppress(RuntimeError):
                self.versions.published.wait_for(ledger.versions.newest)

    def start(self, request: CallRequest, loss_scale: float | None, owned_buffers: list) -> Call:
        """Start the call ``request`` asks for, on the weights new calls read: record it
        in flight, then hand its first jobs to the workers."""
        ledger = self.ledger
        call = Call.start(
            request,
            ledger.versions,
            seq=ledger.next_seq,
            rewrites_before=ledger.rewrites,
            layer_changes_before=ledger.layer_changes,
        )
        stepping = not call.forward_only and self._steps_in_backward()  # refuses first
        self._ledger.change(
            lambda now: replace(
                now.with_state(call, phase=ISSUING, owned_buffers=tuple(owned_buffers)),
                in_flight=(*now.in_flight, call),
                since_step=now.since_step if call.forward_only else (*now.since_step, call),
                next_seq=call.seq + 1,
            )
        )
        self._dispatch(call, call.first_jobs, loss_scale, stepping and not call.deferred)
        return call

    def check_backward(self, call: Call, layers: list[LayerBinding]) -> None:
        """Refuse a backward PyTorch would refuse (:meth:`.Ledger.check_backward`)."""
        changed = any(layer.changed() for layer in layers)
        self.ledger.check_backward(call, self.store.externally_modified(), changed)

    def issue_backward(self, call: Call, loss_scale: float | None) -> None:
        """Dispatch the backward jobs of a deferred call (a ``model(x)`` output's
        ``.backward()``), once: a second one raises."""
        if not call.claim_backward():
            raise_second_backward()
        jobs = call.schedule.backward_jobs
        call.latch.add(job.index for job in jobs)
        stepping = self._steps_in_backward()  # refuses before anything is recorded
        self._ledger.change(
            lambda now: replace(
                now.with_state(call, phase=ISSUING),
                in_flight=_with(now.in_flight, call),
                since_step=_with(now.since_step, call),
            )
        )
        self._dispatch(call, jobs, loss_scale, stepping)

    def _steps_in_backward(self) -> bool:
        optimizer = self.optimizer
        return self.backward_steps.check(optimizer.node is not None, optimizer.grad_scaler)

    def _dispatch(
        self, call: Call, jobs: tuple[Job, ...], loss_scale: float | None, stepping: bool
    ) -> None:
        """Hand ``jobs`` of a call recorded as issuing to their workers, then record it
        running (cut short, :meth:`_repair` cancels the rest). ``stepping``: the jobs'
        masters step in the backward, and a synchronous publish follows them."""
        if stepping:
            self.backward_steps.begin(call)
        for job in jobs:
            self.workers[job.device].submit(call, job, loss_scale)
        self._set_state(call, phase=RUNNING)
        if stepping:
            self.queue_step(_published_only, is_async=False)

    def queue_step(self, step_fn, is_async: bool) -> StepTask:
        if is_async:
            self.backward_steps.refuse_async()
        ledger = self.ledger
        versions = ledger.versions.after_step(is_async)
        task = StepTask(
            step_fn,
            ledger.since_step,
            version=versions.newest,
            buffer=versions.home_of(versions.newest),
        )
        self._write(since_step=(), steps=(*ledger.steps, task), versions=versions)
        self.optimizer.submit(task)
        return task

    # -- failures ------------------------------------------------------------------------

    def fail(self, error: BaseException | None, step_error: bool = False) -> NoReturn:
        """Recover from a failure, then raise it (or the first one found)."""
        first = self.recover(error, step_error) or error or RoundPipeError("a call failed")
        raise first from first.__cause__

    def fail_if(self, error: BaseException | None) -> None:
        if error is not None:
            raise error from error.__cause__

    def recover(
        self, error: BaseException | None, step_error: bool = False
    ) -> BaseException | None:
        """Wait for everything in flight, apply the failure rules, and start afresh.

        Returns the error to report: ``error`` (a failure the caller is raising), else
        the first failure of background work nobody has seen. Safe to interrupt and
        to call again.
        """
        self._repair()
        ledger = self.ledger
        for call in ledger.in_flight:
            call.latch.wait()
        outcomes = [wait_future(task.done) for task in ledger.steps]
        ledger = self.ledger  # the states, now final
        step_errors = [e for e in outcomes if e is not None]
        reportable: list[BaseException] = [error] if error is not None else []
        reportable += step_errors  # before calls' errors, which may be their consequence
        reportable += [
            c.latch.error
            for c in ledger.in_flight
            if ledger.state(c).returned and c.latch.error is not None
        ]
        failed = [c for c in ledger.since_step if failures.failed(c, ledger.state(c))]
        discarded_now = failures.discard_gradients(self.store, failed, ledger.state)
        self.pool.clear_errors()
        if self.versions.published.failed:
            self.versions.republish(ledger.versions)
        discarded = bool(discarded_now) or any(ledger.state(c).discarded for c in ledger.in_flight)
        stepped = sum(self.backward_steps.forget(call) for call in ledger.in_flight)
        buffers = [ledger.state(call).owned_buffers for call in ledger.in_flight]
        self._write(in_flight=(), since_step=(), steps=(), states={})
        for owned in buffers:
            self.inputs.give_back(list(owned))
        if not reportable:
            return None
        first = reportable[0]
        kept_for_retry = first in step_errors or step_error
        failures.note_usable_again(first, discarded, kept_for_retry, stepped)
        return first

    # -- lifetime ------------------------------------------------------------------------

    def synchronize(self) -> None:
        """Drain everything, then :meth:`make_current`; raise a failure found meanwhile."""
        error = self.recover(None)
        self.make_current()
        self.fail_if(error)

    def make_current(self) -> None:
        """With everything drained: the user's tensors show the newest weights (writes
        the user made into them are adopted instead), and the next call reads them."""
        ledger = self.ledger
        state, rewritten = self.versions.make_current(ledger.versions)
        self._write(versions=state, rewrites=ledger.rewrites + rewritten)

    def close(self) -> BaseException | None:
        """Drain, stop every thread, and return the first unreported failure.
        Interrupted while draining, the threads keep running: close again."""
        if self.closed:
            return None
        try:
            error = self._drain()
        except Exception as exc:  # noqa: BLE001 - the threads are stopped regardless
            error = exc
        self._stop_threads()
        return error

    def shutdown(self) -> None:
        """Drain and stop, swallowing every error: nobody is left to report to (the
        interpreter exits, or the model was garbage-collected unclosed)."""
        if self.closed:
            return
        with contextlib.suppress(BaseException):
            self._drain()
        self._stop_threads()

    def _drain(self) -> BaseException | None:
        error = self.recover(None)
        self.make_current()  # the wrapped model keeps the newest weights
        return error

    def _stop_threads(self) -> None:
        for worker in self.workers:
            worker.stop()
        self.optimizer.stop()
        if self.owns_pool:
            self.pool.close()
        self.closed = True
        lifetime.live_sessions().discard(self)


def _published_only() -> None:
    """The step queued after a call whose masters stepped in its backward: nothing left
    to apply, the masters are published for the next call."""


def _with(calls: tuple[Call, ...], call: Call) -> tuple[Call, ...]:
    return calls if call in calls else (*calls, call)
