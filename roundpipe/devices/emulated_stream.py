"""The emulated backend's streams and events (DESIGN.md §9).

Each stream is a FIFO of ops run by its own thread (started on first use). Events are
completed by the recording stream once everything submitted before them has run, and
awaited by other streams, as on CUDA. Two things keep the per-op cost of the threads
low without changing what a stream does:

- an event is not a queue item: it is attached to the last op queued (or running) and
  completed right after that op, or completed at once on an idle stream;
- a wait on an event that has already completed without error orders nothing (as
  ``cudaStreamWaitEvent`` on a completed event) and is not queued.
"""

from __future__ import annotations

import collections
import random
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from .base import Event, OpInfo, Stream, Timer

if TYPE_CHECKING:
    from .emulated import EmulatedDevice


class _RunningOp(threading.local):
    """Per stream thread: the stream it runs and the ticket of the op running now."""

    stream: EmulatedStream | None = None
    ticket: int = -1


RUNNING = _RunningOp()


class ModelledTime(threading.local):
    """Per stream thread: modelled kernel seconds owed (slept after the op) and in total."""

    pending = 0.0
    total = 0.0


class WallClockTimer(Timer):
    """Wall time of the real work plus the modelled kernel time charged in between."""

    def __init__(self, modelled: ModelledTime) -> None:
        self._modelled = modelled
        self._start = self._stop = 0.0

    def start(self) -> None:
        self._start = time.perf_counter() + self._modelled.total

    def stop(self) -> None:
        self._stop = time.perf_counter() + self._modelled.total

    def seconds(self) -> float:
        return self._stop - self._start


class EmulatedEvent(Event):
    def __init__(self) -> None:
        self._done = threading.Event()
        self.error: BaseException | None = None

    def _complete(self, error: BaseException | None) -> None:
        self.error = error
        self._done.set()

    def wait_done(self) -> None:
        self._done.wait()

    def synchronize(self) -> None:
        self._done.wait()
        if self.error is not None:
            raise self.error

    def query(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout: float | None) -> bool:
        return self._done.wait(timeout)


_STOP = object()
RUN, WAIT = 0, 1
# A queued item is a list [kind, payload, (info, ticket) or None, events to complete
# after it or None]: a list, so that an event recorded later can be attached to it.


class EmulatedStream(Stream):
    def __init__(self, device: EmulatedDevice, name: str, seed: int) -> None:
        self.device = device
        self.name = name
        self.error: BaseException | None = None
        self.engine = None  # the copy engine (emulated_link.CopyEngine) its ops use, if any
        self._items: collections.deque = collections.deque()
        # reentrant: a tensor freed while the lock is held may record an event here
        self._cond = threading.Condition(threading.RLock())
        self._thread: threading.Thread | None = None
        self._current: list | None = None  # the item the thread is handling
        self._start_lock = threading.Lock()
        self._rng = random.Random(seed)

    def _ensure_thread(self) -> None:
        if self._thread is None:
            with self._start_lock:
                if self._thread is None:
                    self._thread = threading.Thread(
                        target=self._run,
                        name=f"roundpipe-emu{self.device.index}-{self.name}",
                        daemon=True,
                    )
                    self._thread.start()

    def _put(self, item) -> None:
        self._ensure_thread()
        with self._cond:
            if self.engine is not None and item is not _STOP and item[0] == RUN and self._idle():
                # nothing stands before it: its copies are ready now, as on a GPU
                self.engine.op_started(item[2][1])
            self._items.append(item)
            self._cond.notify()

    def _idle(self) -> bool:
        """Under the lock: no item queued and none being run."""
        return not self._items and self._current is None

    def _take(self):
        with self._cond:
            while not self._items:
                self._cond.wait()
            self._current = self._items.popleft()
            return self._current

    def _next_ready_ticket(self) -> int | None:
        """The ticket of the next op if nothing unfinished stands before it."""
        with self._cond:
            for item in self._items:
                if item is _STOP:
                    return None
                if item[0] == RUN:
                    return item[2][1]
                if not item[1].query():
                    return None
        return None

    def submit(self, fn: Callable[[], None], info: OpInfo) -> None:
        self._put([RUN, fn, (info, self.device.pool.tickets.next()), None])
        if info.pageable:  # as CUDA does: the host waits until the copy has been staged
            self.record().wait(None)

    def record(self) -> Event:
        event = EmulatedEvent()
        with self._cond:
            last = self._items[-1] if self._items else self._current
            if last is None or last is _STOP:
                if last is None:  # idle: everything submitted has run
                    event._complete(self.error)
                return event
            if last[3] is None:
                last[3] = [event]
            else:
                last[3].append(event)
        return event

    def wait(self, event: Event) -> None:
        if not isinstance(event, EmulatedEvent):
            raise TypeError(f"an emulated stream cannot wait on {type(event).__name__}")
        if event.query() and event.error is None:
            return  # it has completed: there is nothing to order
        self._put([WAIT, event, None, None])

    def stop(self) -> None:
        if self._thread is not None:
            self._put(_STOP)
            self._thread.join()
            self._thread = None

    def _run(self) -> None:
        RUNNING.stream = self
        while True:
            item = self._take()
            if item is _STOP:
                return
            kind, payload, issued, _ = item
            if kind == WAIT:
                payload.wait_done()
                if payload.error is not None and self.error is None:
                    self.error = payload.error
            else:
                if self.engine is not None:
                    self.engine.op_started(issued[1])
                if self.error is None:
                    self._run_op(payload, issued[0], issued[1])
                if self.engine is not None:
                    self.engine.op_finished(issued[1], self._next_ready_ticket())
            # What the op referenced (its device tensors) dies now, not when the next
            # op arrives: an op that ran holds nothing on a GPU either.
            payload = item[1] = None
            with self._cond:
                events, self._current = item[3], None
            if events is not None:
                for event in events:
                    event._complete(self.error)
            item = events = None

    def _run_op(self, fn: Callable[[], None], info: OpInfo, ticket: int) -> None:
        RUNNING.ticket = ticket
        options = self.device.options
        if options.jitter_s:
            time.sleep(self._rng.uniform(0.0, options.jitter_s))
        start = time.perf_counter()
        try:
            fn()
        except BaseException as exc:  # noqa: BLE001 - sticky, reported through events
            self.error = exc
        finally:
            RUNNING.ticket = -1
        # The op lasts as long as its modelled kernels, slept here after it released any
        # lock it held. The host work of running it counts towards that time, as a GPU
        # kernel runs while the host launches the next: only what is left is slept.
        modelled = self.device.modelled
        owed, modelled.pending = modelled.pending, 0.0
        left = owed - (time.perf_counter() - start)
        if left > 0:
            time.sleep(left)
        self.device.pool.record_span(self.device.index, self.name, info, start)
