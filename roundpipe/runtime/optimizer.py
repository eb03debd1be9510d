"""The host optimizer thread (DESIGN.md §5): runs ``step_fn`` once a step's gradients are in.

Steps are queued in order. A step waits for every call since the previous step
to finish (all gradients accumulated into the master copies), runs the user's
``step_fn`` on the masters, then publishes the new weights for uploads.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future

from ..errors import RoundPipeError, failure_site
from .call import Call
from .params import ParameterStore

_STOP = object()


class OptimizerThread:
    def __init__(self, store: ParameterStore, grad_scaler=None) -> None:
        self.store = store
        self.grad_scaler = grad_scaler
        self._tasks: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    def _ensure_started(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._loop, name="roundpipe-optimizer", daemon=True
            )
            self._thread.start()

    def step(self, step_fn: Callable[[], object], calls: list[Call], version: int) -> Future:
        """Queue the step that produces weights ``version``; the future holds its error."""
        self._ensure_started()
        done: Future = Future()
        self._tasks.put((step_fn, calls, version, done))
        return done

    def stop(self) -> None:
        if self._thread is not None:
            self._tasks.put(_STOP)
            self._thread.join()
            self._thread = None

    def _loop(self) -> None:
        while True:
            task = self._tasks.get()
            if task is _STOP:
                return
            step_fn, calls, version, done = task
            errors = [error for call in calls if (error := call.latch.wait()) is not None]
            if errors:
                self.store.republish_unchanged(version)
                done.set_result(
                    RoundPipeError(
                        f"optimizer step {version} was skipped because a call before it failed"
                    )
                )
                continue
            try:
                with failure_site(f"optimizer step {version} (step_fn)"):
                    if self.grad_scaler is not None:
                        # Gradients are kept unscaled (each call may have used another
                        # scale); scale them by the scaler's current value so its
                        # unscale_ and inf checks inside step_fn see what they expect.
                        self.store.scale_grads(float(self.grad_scaler.get_scale()))
                    step_fn()
            except BaseException as exc:  # noqa: BLE001 - reported to the caller
                self.store.republish_unchanged(version)
                done.set_result(exc)
                continue
            self.store.publish(version)
            done.set_result(None)
