"""The host optimizer thread: runs ``step_fn`` once a step's gradients are in.

Steps run in the order they were queued. A step waits for every call since the
previous step, runs the user's ``step_fn`` on the master copies, then publishes the
masters as the step's weight version — whatever happened: a step whose calls
failed is skipped (:mod:`.failures` decides what becomes of the gradients), a
failing ``step_fn`` leaves the masters as it left them. The thread survives every error;
each step's outcome is reported through its :class:`StepTask`.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Sequence
from typing import Protocol

import torch
from torch.amp.grad_scaler import OptState

from ..errors import failure_site, locate
from . import failures
from .call import Call
from .ledger import CallState, StepTask
from .operation import OPERATION
from .params import ParameterStore
from .versions import WeightVersions

_STOP = object()


class NodeSteps(Protocol):
    """How steps go across nodes (implemented by :class:`roundpipe.cluster.NodeSync`)."""

    def step(
        self,
        calls: tuple[Call, ...],
        step_fn: Callable[[], BaseException | None],
        discard: Callable[..., None],
    ) -> BaseException | None:
        """Reduce the gradients, agree, run ``step_fn`` (its error is returned); on a
        failure anywhere ``discard(calls, reduced=True)`` instead."""

    def gather(self, buffer_of: Callable[[int], torch.Tensor]) -> None:
        """Fill the weights other nodes own into ``buffer_of(uid)`` (a collective)."""


class OptimizerThread:
    def __init__(
        self,
        store: ParameterStore,
        versions: WeightVersions,
        grad_scaler,
        node: NodeSteps | None,
        state_of: Callable[[Call], CallState],
        discarded: Callable[[Sequence[Call]], None],
    ) -> None:
        """``node``: on several nodes, what a step goes through; ``state_of`` and
        ``discarded`` read and report call states to the session."""
        self.store = store
        self.versions = versions
        self.grad_scaler = grad_scaler
        self.node = node
        self._state_of = state_of
        self._discarded = discarded
        self._tasks: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._start_lock = threading.Lock()

    def is_current(self) -> bool:
        """Whether the calling thread is this optimizer thread (i.e. inside ``step_fn``)."""
        return self._thread is not None and threading.current_thread() is self._thread

    def submit(self, task: StepTask) -> None:
        with self._start_lock:
            if self._thread is None:
                self._thread = threading.Thread(
                    target=_loop, args=(self._tasks, self._run), name="roundpipe-optimizer"
                )
                self._thread.daemon = True
                self._thread.start()
        self._tasks.put(task)
        task.submitted = True

    def stop(self) -> None:
        thread = self._thread
        if thread is not None:
            self._tasks.put(_STOP)
            thread.join()
            self._thread = None

    def _run(self, task: StepTask) -> None:
        error: BaseException | None = None
        try:
            error = self._apply(task)
        finally:
            try:
                self.versions.publish(task.version, task.buffer)
            except BaseException as exc:  # noqa: BLE001 - reported through the task
                self.versions.published.fail(exc)
                error = error or locate(exc, f"publishing weights version {task.version}")
            task.done.set_result(error)

    def _apply(self, task: StepTask) -> BaseException | None:
        """Run the step unless a call before it failed; return ``step_fn``'s error."""
        if self.node is not None:
            try:
                return self.node.step(task.calls, lambda: self._run_step_fn(task), self._discard)
            except BaseException as exc:  # noqa: BLE001 - a collective failed: reported
                return exc
        failed = [call for call in task.calls if call.latch.wait() is not None]
        if failed:
            # The failed calls' errors reach the caller through the calls themselves.
            self._discard(failed)
            return None
        return self._run_step_fn(task)

    def _discard(self, calls: Sequence[Call], reduced: bool = False) -> None:
        discarded = failures.discard_gradients(self.store, calls, self._state_of, reduced)
        if discarded:
            self._discarded(discarded)

    def _run_step_fn(self, task: StepTask) -> BaseException | None:
        try:  # the masters that are weights move to the buffer the step writes
            self.versions.prepare(task.buffer)
        except BaseException as exc:  # noqa: BLE001 - reported as step_fn's error would be
            return locate(exc, f"preparing weights version {task.version}")
        scale = None
        try:
            with failure_site(f"optimizer step {task.version} (step_fn)"):
                if self.grad_scaler is not None:
                    # Gradients are kept unscaled (each call may have used another
                    # scale); scale them by the scaler's current value so its
                    # unscale_ and inf checks inside step_fn see what they expect.
                    scale = float(self.grad_scaler.get_scale())
                    self.store.scale_grads(scale)
                task.step_fn()
        except BaseException as exc:  # noqa: BLE001 - reported to the caller
            if scale is not None and not _unscaled_by(self.grad_scaler):
                self.store.scale_grads(1.0 / scale)  # the kept gradients stay unscaled
            return exc
        return None


def _unscaled_by(grad_scaler) -> bool:
    """Whether a failed ``step_fn`` got as far as the scaler's ``unscale_`` (then the
    gradients are unscaled already). Reads the scaler's per-optimizer stage."""
    states = getattr(grad_scaler, "_per_optimizer_states", {})
    return any(state.get("stage", OptState.READY) != OptState.READY for state in states.values())


def _loop(tasks: queue.SimpleQueue, run: Callable[[StepTask], None]) -> None:
    OPERATION.set("step")  # this thread's own context
    while True:
        task = tasks.get()
        if task is _STOP:
            return
        if task.claim():
            run(task)
