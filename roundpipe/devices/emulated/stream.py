"""The emulated backend's streams (FIFO queues of ops and event waits) and events.

A stream only queues; the device's executor runs the queues. A stream is built from
the plain values it needs (:class:`StreamContext`), so this module depends on neither
the device nor the executor. See ``docs/design.md``, "Emulated backend".
"""

from __future__ import annotations

import collections
import random
import threading
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from time import perf_counter as _now
from typing import TYPE_CHECKING

from ..base import Event, OpInfo, Stream, Timer

if TYPE_CHECKING:
    from .link import CopyEngine


class _RunningOp(threading.local):
    """Per thread: the op an executor runs now (``None`` outside ops) and the modelled
    seconds charged on this thread so far (what :class:`WallClockTimer` adds)."""

    stream: EmulatedStream | None = None
    op: QueuedOp | None = None
    charged: float = 0.0


RUNNING = _RunningOp()


class WallClockTimer(Timer):
    """Real time of the work plus the modelled time (kernels, copies) charged in between."""

    def __init__(self) -> None:
        self._start = self._stop = 0.0

    def start(self) -> None:
        self._start = _now() + RUNNING.charged

    def stop(self) -> None:
        self._stop = _now() + RUNNING.charged

    def seconds(self) -> float:
        return self._stop - self._start


# Guards the hand-over between completing an event and registering a waiter on it.
_EVENT_LOCK = threading.Lock()


class EmulatedEvent(Event):
    """Completed once (with the error of its stream, if any, and the modelled time its
    work ended), once everything submitted before it has run. Executors register
    callbacks to be woken; a host thread that blocks on it makes the one
    ``threading.Event`` it sleeps on.

    An event is not a queue item: it is attached to the last item queued (or the op in
    flight) and completed with it, or completed at once on an idle stream. A stream
    waiting on it starts no earlier than its ``time``."""

    __slots__ = ("_host", "_waiters", "done", "error", "time")

    def __init__(self) -> None:
        self.done = False
        self.error: BaseException | None = None
        self.time = 0.0
        self._waiters: list[Callable[[], None]] | None = None
        self._host: threading.Event | None = None

    def complete(self, error: BaseException | None, time: float) -> None:
        """Mark it done; run the registered callbacks and wake blocked host threads."""
        self.error, self.time = error, time
        with _EVENT_LOCK:
            self.done = True
            waiters, self._waiters = self._waiters, None
            host = self._host
        if waiters is not None:
            for waiter in waiters:
                waiter()
        if host is not None:
            host.set()

    def add_waiter(self, callback: Callable[[], None]) -> bool:
        """Call ``callback`` once the event completes; False (not registered) if it has."""
        with _EVENT_LOCK:
            if self.done:
                return False
            if self._waiters is None:
                self._waiters = [callback]
            else:
                self._waiters.append(callback)
            return True

    def synchronize(self) -> None:
        self.wait(None)
        if self.error is not None:
            raise self.error

    def query(self) -> bool:
        return self.done

    def wait(self, timeout: float | None) -> bool:
        if self.done:
            return True
        with _EVENT_LOCK:
            if self.done:
                return True
            if self._host is None:
                self._host = threading.Event()
            host = self._host
        return host.wait(timeout)


class HostEvent(EmulatedEvent):
    """An event the host completes with :meth:`set`: a stream waiting on it is held
    without blocking its device (tests use it to hold a stream at a chosen point)."""

    __slots__ = ()

    def set(self, error: BaseException | None = None) -> None:
        if not self.done:
            self.complete(error, _now())


class QueuedOp:
    """A submitted op: its closure, and its modelled times once the executor reached it."""

    __slots__ = (
        "cpu",
        "cursor",
        "end",
        "events",
        "fn",
        "info",
        "issued",
        "ran",
        "ready",
        "start",
        "ticket",
    )

    def __init__(self, fn: Callable[[], None], info: OpInfo, ticket: int, issued: float) -> None:
        self.fn: Callable[[], None] | None = fn
        self.info = info
        self.ticket = ticket
        self.issued = issued
        self.events: list[EmulatedEvent] | None = None  # to complete when it ends
        self.ready = -1.0  # when it reached its stream's head, waits satisfied (-1: not yet)
        self.start = 0.0  # its modelled start: ready + jitter, the engine free for a copy
        self.cursor = 0.0  # while it runs: start + the modelled time charged so far
        self.end = 0.0  # modelled end: max(real end, cursor)
        self.ran = self.cpu = 0.0  # while recording: its closure's wall and CPU seconds


class QueuedWait:
    """A queued wait on an event of another stream, device or the host."""

    __slots__ = ("event", "events")

    def __init__(self, event: EmulatedEvent) -> None:
        self.event = event
        self.events: list[EmulatedEvent] | None = None  # to complete when it is satisfied


@dataclass(frozen=True)
class StreamContext:
    """What the streams of one device share, as plain values."""

    device_index: int
    lock: AbstractContextManager[object]
    """The executor's lock: it guards every stream's ``queue``, ``inflight``, ``floor``."""
    put: Callable[[EmulatedStream, QueuedOp | QueuedWait], None]
    """Queue an item on a stream and wake the executor (starting it on first use)."""
    next_ticket: Callable[[], int]
    """The pool's issue order: one increasing number per submitted op."""


class EmulatedStream(Stream):
    """A FIFO of :class:`QueuedOp` and :class:`QueuedWait`, run by its device's executor
    one op in flight at a time; the executor's lock guards ``queue``, ``inflight`` and
    ``floor``.

    A wait on an event that has already completed without error orders nothing (as
    ``cudaStreamWaitEvent`` on a completed event) and is not queued. Errors are sticky:
    an op that raises sets ``error``, later ops are skipped and events complete with
    it. ``device`` (declared by the ``Stream`` interface) is set by the device that owns
    the stream; the stream itself never uses it."""

    def __init__(
        self, context: StreamContext, name: str, seed: int, engine: CopyEngine | None = None
    ) -> None:
        self.name = name
        self.error: BaseException | None = None
        self.engine = engine  # the copy engine its ops use, if any
        self.queue: collections.deque[QueuedOp | QueuedWait] = collections.deque()
        self.inflight: QueuedOp | None = None
        self.floor = 0.0  # modelled time before which its next item cannot start
        self.waiting_on: EmulatedEvent | None = None  # the event its head wait watches
        self.rng = random.Random(seed)
        self._index = context.device_index
        self._lock = context.lock
        self._put = context.put
        self._next_ticket = context.next_ticket

    def __repr__(self) -> str:
        return f"emulated:{self._index}/{self.name}"

    def submit(self, fn: Callable[[], None], info: OpInfo) -> None:
        self._put(self, QueuedOp(fn, info, self._next_ticket(), _now()))
        if info.pageable:  # as CUDA does: the host waits until the copy has been staged
            self.record().wait(None)

    def record(self) -> Event:
        event = EmulatedEvent()
        with self._lock:
            last = self.queue[-1] if self.queue else self.inflight
            if last is None:  # idle: everything submitted has run
                event.done, event.error, event.time = True, self.error, self.floor
            elif last.events is None:
                last.events = [event]
            else:
                last.events.append(event)
        return event

    def wait(self, event: Event) -> None:
        if not isinstance(event, EmulatedEvent):
            raise TypeError(f"an emulated stream cannot wait on {type(event).__name__}")
        if event.done and event.error is None:
            return  # it has completed: there is nothing to order
        self._put(self, QueuedWait(event))
