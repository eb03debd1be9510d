"""Host-side synchronization between device workers, the optimizer thread and callers.

Device-side ordering is done with stream events; these objects only order the
*issuing* of work on the host: a consumer learns which event to wait on once the
producer has issued its work (:class:`Mailbox`), a worker learns a layer's weights
were published (:class:`VersionGate`), a caller learns every job of a call is done
(:class:`Latch`). Every wait can be failed, so an error never becomes a hang.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable, Iterable
from concurrent import futures
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from ..devices.base import Event, Slot
from . import interrupts


@dataclass
class Handoff:
    """A value produced by one job for another: read ``slot.value`` after ``event``."""

    slot: Slot
    event: Event | None  # None: the value is already complete in host memory
    meta: Any = None


class Mailbox:
    """Keyed handoffs between jobs. Each key is read by a known number of readers."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._items: dict[Hashable, Handoff | BaseException] = {}
        self._readers: dict[Hashable, int] = {}

    def expect(self, key: Hashable, readers: int) -> None:
        with self._cond:
            self._readers[key] = self._readers.get(key, 0) + readers

    def post(self, key: Hashable, handoff: Handoff) -> None:
        with self._cond:
            self._items.setdefault(key, handoff)
            self._cond.notify_all()

    def fail(self, key: Hashable, error: BaseException) -> None:
        """Make readers of ``key`` raise ``error`` (unless it was already posted)."""
        with self._cond:
            self._items.setdefault(key, error)
            self._cond.notify_all()

    def get(self, key: Hashable) -> Handoff:
        host_wait(lambda timeout: self._has(key, timeout))
        with self._cond:
            item = self._items[key]
            remaining = self._readers.get(key, 1) - 1
            if remaining <= 0:
                self._items.pop(key)
                self._readers.pop(key, None)
            else:
                self._readers[key] = remaining
        if isinstance(item, BaseException):
            raise item
        return item

    def _has(self, key: Hashable, timeout: float | None) -> bool:
        with self._cond:
            return self._cond.wait_for(lambda: key in self._items, timeout)


class VersionGate:
    """A counter that threads wait to reach, e.g. 'weights version 3 published'.

    :meth:`fail` makes every present and future wait raise instead (a publish that
    failed must not leave workers waiting forever); :meth:`reset` clears that.
    """

    def __init__(self, value: int = 0) -> None:
        self._cond = threading.Condition()
        self._value = value
        self._error: BaseException | None = None

    @property
    def value(self) -> int:
        return self._value

    @property
    def failed(self) -> bool:
        return self._error is not None

    def wait_for(self, value: int) -> None:
        with self._cond:
            while self._value < value and self._error is None:
                self._cond.wait()
            if self._value < value:
                raise RuntimeError(
                    f"weights version {value} will not be published: {self._error}"
                ) from self._error

    def advance_to(self, value: int) -> None:
        with self._cond:
            self._value = max(self._value, value)
            self._cond.notify_all()

    def fail(self, error: BaseException) -> None:
        with self._cond:
            self._error = error
            self._cond.notify_all()

    def reset(self) -> None:
        with self._cond:
            self._error = None


class Latch:
    """Tracks the jobs of a call (named by their schedule index) until each has
    finished, and their errors.

    Finishing a job twice — a worker and a cancellation racing for it — counts once.
    :attr:`error` is the error of the earliest job in schedule order that failed, not
    of whichever failed first in time: the root cause, and the same in every run.
    """

    def __init__(self, jobs: Iterable[int] = ()) -> None:
        self._cond = threading.Condition()
        self._pending: set[int] = set(jobs)
        self._finished: set[int] = set()
        self._errors: dict[int, BaseException] = {}

    @property
    def error(self) -> BaseException | None:
        with self._cond:
            return self._errors[min(self._errors)] if self._errors else None

    def finish(self, job: int, error: BaseException | None = None) -> None:
        with self._cond:
            if job in self._finished:
                return
            self._finished.add(job)
            if error is not None:
                self._errors.setdefault(job, error)
            self._pending.discard(job)
            self._cond.notify_all()

    def fail(self, job: int, error: BaseException) -> None:
        """Record an error of ``job``'s host-side follow-up work (the job may be done)."""
        with self._cond:
            self._errors.setdefault(job, error)

    def add(self, jobs: Iterable[int]) -> None:
        """Expect more jobs (dispatched after the call started); finished ones count as done."""
        with self._cond:
            self._pending.update(set(jobs) - self._finished)

    def wait(self) -> BaseException | None:
        host_wait(self._finished_within)
        return self.error

    def wait_jobs(self, jobs: Iterable[int]) -> None:
        """Wait until none of ``jobs`` is pending (a job never dispatched is not)."""
        wanted = set(jobs)

        def finished_within(timeout: float | None) -> bool:
            with self._cond:
                return self._cond.wait_for(lambda: not wanted & self._pending, timeout)

        host_wait(finished_within)

    def _finished_within(self, timeout: float | None) -> bool:
        with self._cond:
            return self._cond.wait_for(lambda: not self._pending, timeout)

    @property
    def done(self) -> bool:
        return not self._pending


def host_wait(wait: Callable[[float | None], bool]) -> None:
    """Call ``wait(timeout)`` until it says done. On a thread deferring Ctrl-C, wait in
    short slices and deliver a noted Ctrl-C between them, outside any lock."""
    if not interrupts.deferring():
        wait(None)
        return
    while not wait(interrupts.POLL_S):
        interrupts.interrupt_point()


def wait_future(future: Future) -> Any:
    """``future.result()``, answering Ctrl-C while it waits."""
    host_wait(lambda timeout: bool(futures.wait([future], timeout).done))
    return future.result()


def wait_event(event: Event) -> None:
    """``event.synchronize()``, answering Ctrl-C while it waits."""
    host_wait(event.wait)
    event.synchronize()
