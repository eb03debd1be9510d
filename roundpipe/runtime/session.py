"""The caller's side of a RoundPipe model: calls and steps in flight, failures, lifetime.

Everything a public method changes lives in one immutable :class:`_Ledger` that is
replaced by a single assignment *before* the work it announces is handed to a
thread, and every public method first :meth:`Session.repair` s the background to
match it (jobs of a call whose issuing was cut short are cancelled, a step that
was recorded but not queued is queued). So an interrupt at any line leaves a
model that the next call, ``synchronize()`` or ``close()`` can use: nothing ever
waits for work that was never issued.

Failure rules (one place, wherever an error surfaces):

- the gradients of a failed call never reach a step: a queued step whose calls
  include a failed one is skipped (the optimizer thread discards the gradients);
  a failed call since the last step makes :meth:`recover` discard them — in both
  cases only if the failed call accumulated any;
- a call interrupted before it returned counts as failed, silently;
- a failing ``step_fn`` keeps the gradients (retry the step, as in PyTorch).
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, NoReturn

import torch
from torch import nn

from ..core.schedule import Job
from ..devices import DevicePool
from ..errors import RoundPipeError
from . import interrupts, lifetime
from .call import Call
from .inputs import HostBufferPool
from .layers import LayerBinding
from .optimizer import OptimizerThread, StepTask
from .params import ParameterStore
from .profiler import LayerProfiler
from .sync import VersionGate, wait_future
from .versions import VersionState, WeightVersions
from .worker import DeviceWorker


class CallInterrupted(RoundPipeError):
    """Cancels the jobs of a call whose issuing was interrupted."""


@dataclass(frozen=True)
class _Ledger:
    in_flight: tuple[Call, ...] = ()
    since_step: tuple[Call, ...] = ()
    """Calls whose gradients the next step applies (finished good ones are dropped)."""
    steps: tuple[StepTask, ...] = ()
    versions: VersionState = VersionState()
    next_seq: int = 0
    rewrites: int = 0
    """How often the user's tensors were rewritten with nothing in flight (adoption,
    ``make_current``): a deferred backward must recompute with what its forward read."""


class Session:
    """Owns the threads of one model and the bookkeeping of its calls and steps."""

    def __init__(
        self,
        pool: DevicePool,
        owns_pool: bool,
        store: ParameterStore,
        versions: WeightVersions,
        workers: list[DeviceWorker],
        optimizer: OptimizerThread,
        inputs: HostBufferPool,
    ) -> None:
        self.pool = pool
        self.owns_pool = owns_pool
        self.store = store
        self.versions = versions
        self.workers = workers
        self.optimizer = optimizer
        self.inputs = inputs
        self.ledger = _Ledger()
        self.closed = False
        self.driver: dict[str, Any] = {}
        """The thread inside a public method (``"thread"``) and how deeply (``"depth"``)."""
        lifetime.live_sessions().add(self)

    @classmethod
    def build(
        cls,
        model: nn.Module,
        layers: list[LayerBinding],
        pool: DevicePool,
        owns_pool: bool,
        optim_dtype: torch.dtype | None,
        pin_model: str,
        grad_scaler,
        profiler: LayerProfiler,
        names_from: torch.nn.Module | None = None,
    ) -> Session:
        """The host state and threads (not started yet) of a model wrapped on ``pool``;
        parameters are named as ``names_from`` (default: ``model``) names them."""
        names: dict[int, str] = {}
        for name, param in (names_from or model).named_parameters(remove_duplicate=False):
            names.setdefault(id(param), name)
        pin = functools.partial(pool.pin, mode=pin_model)
        store = ParameterStore(layers, names, optim_dtype, pin=pin)
        versions = WeightVersions(store, pin)
        buffer_gates = {layer.index: VersionGate(0) for layer in layers if layer.buffer_uids}
        workers = [
            DeviceWorker(device, layers, store, versions, buffer_gates, profiler) for device in pool
        ]
        input_pin = functools.partial(pool.pin, mode="off" if pin_model == "off" else "alloc")
        optimizer = OptimizerThread(store, versions, grad_scaler)
        inputs = HostBufferPool(input_pin)
        return cls(pool, owns_pool, store, versions, workers, optimizer, inputs)

    # -- who may drive the model ---------------------------------------------------------

    def enter(self, what: str) -> _Driving:
        """Context for a public method: one driving thread, never from inside ``step_fn``."""
        return _Driving(self, what)

    def check_open(self) -> None:
        if self.closed:
            raise RuntimeError("this RoundPipe model was closed")

    # -- keeping the background in step with the ledger ----------------------------------

    def repair(self) -> None:
        """Cancel jobs of calls whose issuing was cut short; queue recorded steps."""
        ledger = self.ledger
        for call in ledger.in_flight:
            if not call.issued:
                error = CallInterrupted("the call was interrupted while its jobs were issued")
                call.cancel_unclaimed(error, self._open_gates_of(call))
        for task in ledger.steps:
            if not task.submitted:
                self.optimizer.submit(task)

    def _open_gates_of(self, call: Call):
        return lambda job: self.workers[job.device].open_buffer_gates(call, job)

    def settle(self) -> None:
        """Before new work: clean up after interrupted calls, raise finished failures,
        and forget finished calls and steps (O(1) per call: they finish in order)."""
        self.repair()
        ledger = self.ledger
        if any(not call.returned for call in ledger.in_flight):
            self.fail_if(self.recover(None))  # an interrupted call: discard, silently
            return
        in_flight, steps = list(ledger.in_flight), list(ledger.steps)
        finished: list[Call] = []
        while in_flight and in_flight[0].latch.done and in_flight[0].returned:
            if in_flight[0].latch.error is not None:
                self.fail(None)
            finished.append(in_flight.pop(0))
        while steps and steps[0].done.done():
            if steps[0].done.result() is not None:
                self.fail(None)
            steps.pop(0)
        since_step = tuple(
            c for c in ledger.since_step if not (c.latch.done and c.returned and not c.failed)
        )
        self.ledger = replace(
            ledger, in_flight=tuple(in_flight), steps=tuple(steps), since_step=since_step
        )
        self._recycle(finished)

    def _recycle(self, calls: list[Call]) -> None:
        for call in calls:
            buffers, call.owned_buffers = call.owned_buffers, []
            self.inputs.give_back(buffers)

    # -- calls and steps ---------------------------------------------------------------------

    def issue(self, call: Call) -> None:
        """Record ``call`` in flight, then hand its first jobs to the workers."""
        ledger = self.ledger
        since_step = ledger.since_step if call.forward_only else (*ledger.since_step, call)
        self.ledger = replace(
            ledger,
            in_flight=(*ledger.in_flight, call),
            since_step=since_step,
            next_seq=call.seq + 1,
        )
        for job in call.first_jobs:
            self.workers[job.device].submit(call, job)
        call.issued = True

    def issue_more(self, call: Call, jobs: tuple[Job, ...]) -> None:
        """Dispatch ``jobs`` of a call already started (a deferred backward)."""
        call.issued = False
        call.latch.add(job.index for job in jobs)
        ledger = self.ledger
        self.ledger = replace(
            ledger,
            in_flight=_with(ledger.in_flight, call),
            since_step=_with(ledger.since_step, call),
        )
        for job in jobs:
            self.workers[job.device].submit(call, job)
        call.issued = True

    def queue_step(self, step_fn, is_async: bool) -> StepTask:
        ledger = self.ledger
        versions = ledger.versions.after_step(is_async)
        task = StepTask(
            step_fn,
            ledger.since_step,
            version=versions.newest,
            buffer=versions.home_of(versions.newest),
        )
        self.ledger = replace(ledger, since_step=(), steps=(*ledger.steps, task), versions=versions)
        self.optimizer.submit(task)
        return task

    # -- failures ----------------------------------------------------------------------------

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
        self.repair()
        ledger = self.ledger
        for call in ledger.in_flight:
            call.latch.wait()
        outcomes = [wait_future(task.done) for task in ledger.steps]
        step_errors = [e for e in outcomes if e is not None]
        reportable = [error] if error is not None else []
        reportable += step_errors  # before calls' errors, which may be their consequence
        reportable += [c.latch.error for c in ledger.in_flight if c.returned and c.failed]
        failed = [c for c in ledger.since_step if c.failed or not c.returned]
        discard = any(c.accumulated for c in failed)
        self.pool.clear_errors()
        if self.versions.published.failed:
            self.versions.republish(ledger.versions)
        if discard:
            self.store.discard_grads()
        discarded = discard or any(c.discarded_grads for c in ledger.in_flight)
        self.ledger = replace(ledger, in_flight=(), since_step=(), steps=())
        self._recycle(list(ledger.in_flight))
        if not reportable:
            return None
        first = reportable[0]
        if discarded:
            _note(first, "the gradients accumulated since the last step were discarded")
        elif first in step_errors or step_error:
            _note(first, "the gradients were kept; step() again to retry")
        else:
            _note(first, "the gradients accumulated since the last step were kept")
        return first

    # -- lifetime ----------------------------------------------------------------------------

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
        self.ledger = replace(ledger, versions=state, rewrites=ledger.rewrites + rewritten)

    def close(self) -> BaseException | None:
        """Drain, stop every thread, and return the first unreported failure."""
        if self.closed:
            return None
        error = None
        try:
            error = self.recover(None)
            self.make_current()  # the wrapped model keeps the newest weights
        except Exception as exc:  # noqa: BLE001 - the threads are stopped regardless
            error = exc
        self.stop_threads()
        return error

    def stop_threads(self) -> None:
        for worker in self.workers:
            worker.stop()
        self.optimizer.stop()
        if self.owns_pool:
            self.pool.close()
        self.closed = True
        lifetime.live_sessions().discard(self)


class _Driving:
    """Entered by every public method (re-entrant on the driving thread).

    Ownership is claimed with one atomic ``dict.setdefault`` rather than a lock, so an
    interrupt between entering and leaving can never leave a lock held; a driving
    thread that died without leaving is replaced. Inside, Ctrl-C is deferred to the
    waits and to the exit (:mod:`.interrupts`); one that arrives after the method's
    work was done still raises, and the calls it issued then count as interrupted.
    """

    def __init__(self, session: Session, what: str) -> None:
        self.session = session
        self.what = what
        self.deferring = False
        self.first_seq = 0

    def __enter__(self) -> Session:
        session = self.session
        if session.optimizer.is_current():
            raise RuntimeError(
                f"{self.what} was called from inside a step_fn (the optimizer thread), "
                "where it would wait for the step itself; call it after step() instead"
            )
        if threading.current_thread().name.startswith("roundpipe-"):
            raise RuntimeError(
                f"{self.what} was called from a roundpipe thread (inside a layer, loss_fn "
                "or hook that runs as part of a call), where it would wait for its own "
                "work; drive the model from your own thread"
            )
        self.deferring = interrupts.defer()  # first: no Ctrl-C between claim and release
        try:
            self._claim(session)
        except BaseException:
            self._undefer()
            raise
        self.first_seq = session.ledger.next_seq
        return session

    def _claim(self, session: Session) -> None:
        me = threading.current_thread()
        owner = session.driver.setdefault("thread", me)
        if owner is not me and not owner.is_alive():
            session.driver["thread"] = owner = me
        if owner is not me:
            raise RuntimeError(
                f"{self.what} was called from a second thread while another thread is "
                "driving this RoundPipe model; drive a model from one thread at a time"
            )
        session.driver["depth"] = session.driver.get("depth", 0) + 1

    def _undefer(self) -> Callable[[], None] | None:
        return interrupts.undefer() if self.deferring else None

    def __exit__(self, exc_type, exc, traceback) -> None:
        driver = self.session.driver
        driver["depth"] -= 1
        if driver["depth"] <= 0:
            driver.pop("thread", None)
        deliver = self._undefer()
        if deliver is not None and exc_type is None:
            for call in self.session.ledger.in_flight:
                if call.seq >= self.first_seq:
                    call.returned = False
            deliver()


def _with(calls: tuple[Call, ...], call: Call) -> tuple[Call, ...]:
    return calls if call in calls else (*calls, call)


def _note(error: BaseException, text: str) -> None:
    if getattr(error, "roundpipe_noted", False) or not hasattr(error, "add_note"):
        return
    error.add_note(f"roundpipe: the model is usable again ({text})")
    error.roundpipe_noted = True  # type: ignore[attr-defined]
