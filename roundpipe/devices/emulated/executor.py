"""One thread per emulated device that runs the ops of all its streams in modelled time.

A GPU runs its streams' work side by side, kernels while the copy engines move data;
the executor emulates that with one thread (see ``docs/design.md``, "Emulated
backend"). It is built from plain values (device index, jitter, a :class:`SpanSink`),
not the device, so of this package it depends on the streams alone.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Sequence
from time import perf_counter, thread_time

from ..base import SpanRecord
from .stream import RUNNING, EmulatedEvent, EmulatedStream, QueuedOp

# What one look at the streams found to do: ops that ended (with their stream and its
# error then), events of satisfied waits (with their error and time), an op to start.
_Finished = list[tuple[EmulatedStream, QueuedOp, BaseException | None]]
_Released = list[tuple[list[EmulatedEvent], BaseException | None, float]]


class SpanSink:
    """Where the executors of a pool record the spans of their ops while ``recording``."""

    def __init__(self) -> None:
        self.recording = False
        self._spans: list[SpanRecord] = []
        self._lock = threading.Lock()

    def start(self) -> None:
        """Drop what was recorded and record from now on."""
        with self._lock:
            self._spans = []
            self.recording = True

    def spans(self) -> list[SpanRecord]:
        with self._lock:
            return list(self._spans)

    def record(self, span: SpanRecord) -> None:
        with self._lock:
            self._spans.append(span)


class DeviceExecutor:
    """Runs the ops of one emulated device's streams on one thread, in *modelled time*
    on the ``time.perf_counter`` clock:

    - it runs an op's closure (its real work) at once when it starts the op, and gives
      the op a modelled end, ``max(real end, start + modelled)``, where *modelled* is
      the kernel time charged during the closure or the copy time of the copies it
      made. The op stays in flight until that time has come; meanwhile the executor
      starts ops of the device's other streams, so compute and copies overlap;
    - an op starts when it is at its stream's head, the stream has no op in flight and
      every wait before it is satisfied; its modelled start is the moment that became
      true (the end of the op before it, the time the awaited events' work ended, its
      issue), plus the jitter drawn for it, and for an op of a copy stream no earlier
      than its copy engine is free: such an op starts only while no other op of its
      engine is in flight. Among the ops that can start, the lowest ticket goes first;
    - when nothing can start it sleeps until the earliest modelled end or start, a new
      submission, or the completion of an event a stream waits on (events call
      :meth:`wake`, whatever thread completes them).

    ``lock`` guards the streams' queues; no closure runs and no event is completed
    while it is held, and nothing sleeps holding it. The thread (named
    ``roundpipe-emu<index>``) starts on first use and stops at :meth:`stop` once
    everything queued has run. ``streams`` is set by the device once it has built them.
    """

    def __init__(self, index: int, jitter_s: float, spans: SpanSink) -> None:
        self._index = index
        self._spans = spans
        self.lock = threading.RLock()  # reentrant: a tensor dying under it records events
        self._cond = threading.Condition(self.lock)
        self.streams: Sequence[EmulatedStream] = ()
        self._thread: threading.Thread | None = None
        self._start_lock = threading.Lock()
        self._sleeping = False
        self._stopping = False
        self._jitter_s = jitter_s

    # -- the host side ---------------------------------------------------------------

    def put(self, stream: EmulatedStream, item) -> None:
        """Queue ``item`` on ``stream`` (starting the thread on first use)."""
        if self._thread is None:
            self._start()
        with self.lock:
            stream.queue.append(item)
            if self._sleeping:
                self._cond.notify()

    def wake(self) -> None:
        """Look at the streams again (an event a stream waits on has completed)."""
        with self.lock:
            if self._sleeping:
                self._cond.notify()

    def stop(self) -> None:
        """Run what is queued, then end the thread (a later submission restarts it)."""
        thread = self._thread
        if thread is None:
            return
        with self.lock:
            self._stopping = True
            self._cond.notify()
        thread.join()
        with self._start_lock:
            self._thread = None
            self._stopping = False

    def _start(self) -> None:
        with self._start_lock:
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name=f"roundpipe-emu{self._index}", daemon=True
                )
                self._thread.start()

    # -- the executor thread ---------------------------------------------------------

    def _run(self) -> None:
        while True:
            with self.lock:
                found = self._look()
            if found is None:
                return
            finished, released, start = found
            for stream, op, error in finished:
                self._finish(stream, op, error)
            for events, error, time in released:
                for event in events:
                    event.complete(error, time)
            if start is not None:
                self._run_op(*start[:2])
            del found, finished, released, start

    def _look(self) -> tuple[_Finished, _Released, tuple | None] | None:
        """Under the lock: what there is to do, sleeping until there is something;
        ``None`` once stopping and every stream is idle."""
        while True:
            now = perf_counter()
            wake_at = math.inf
            finished: _Finished = []
            released: _Released = []
            best: tuple | None = None
            idle = True
            for stream in self.streams:
                op = stream.inflight
                if op is not None:
                    if op.end > now:
                        wake_at = min(wake_at, op.end)
                        idle = False
                        continue
                    stream.inflight = None
                    stream.floor = max(stream.floor, op.end)
                    if stream.engine is not None:
                        stream.engine.busy = False
                    finished.append((stream, op, stream.error))
                head = self._head(stream, released)
                if head is None:
                    idle = idle and not stream.queue
                    continue
                idle = False
                start = head.start
                if stream.engine is not None:
                    if stream.engine.busy:
                        continue
                    start = max(start, stream.engine.free_at)
                if start > now:
                    wake_at = min(wake_at, start)
                elif best is None or head.ticket < best[1].ticket:
                    best = (stream, head, start)
            if best is not None:
                stream, op, start = best
                op.start = start
                stream.queue.popleft()
                stream.inflight = op
                if stream.engine is not None:
                    stream.engine.busy = True
            if finished or released or best is not None:
                return finished, released, best
            if idle and self._stopping:
                return None
            self._sleeping = True
            self._cond.wait(None if wake_at == math.inf else wake_at - now)
            self._sleeping = False

    def _head(self, stream: EmulatedStream, released: _Released) -> QueuedOp | None:
        """Under the lock: drop the satisfied waits at the head of an idle ``stream``;
        the op then at its head (its ready and start times set), or None."""
        queue = stream.queue
        while queue:
            head = queue[0]
            if isinstance(head, QueuedOp):
                if head.ready < 0:
                    head.ready = max(stream.floor, head.issued)
                    head.start = head.ready
                    if self._jitter_s:
                        head.start += stream.rng.uniform(0.0, self._jitter_s)
                return head
            event = head.event
            if not event.done:
                if stream.waiting_on is not event:
                    stream.waiting_on = event
                    if event.add_waiter(self.wake):
                        return None
                    continue  # it completed meanwhile: look again
                return None
            queue.popleft()
            stream.waiting_on = None
            if event.error is not None and stream.error is None:
                stream.error = event.error  # waiting on a failed event poisons the stream
            stream.floor = max(stream.floor, event.time)
            if head.events is not None:
                released.append((head.events, stream.error, stream.floor))
        return None

    def _run_op(self, stream: EmulatedStream, op: QueuedOp) -> None:
        """Run ``op``'s closure (skipped after an error) and set its modelled end."""
        op.cursor = op.start
        measured = self._spans.recording
        if measured:
            began, cpu = perf_counter(), thread_time()
        RUNNING.stream, RUNNING.op = stream, op
        try:
            if stream.error is None:
                assert op.fn is not None
                try:
                    op.fn()
                except BaseException as exc:  # noqa: BLE001 - sticky, reported through events
                    stream.error = exc
            # What the op referenced (its device tensors) dies now, freed by its stream:
            # on a GPU too the host frees what it launched kernels on at once.
            op.fn = None
        finally:
            RUNNING.stream = RUNNING.op = None
        now = perf_counter()
        if measured:
            op.ran, op.cpu = now - began, thread_time() - cpu
        op.end = max(now, op.cursor)

    def _finish(self, stream: EmulatedStream, op: QueuedOp, error: BaseException | None) -> None:
        events, op.events = op.events, None
        if events is not None:
            for event in events:
                event.complete(error, op.end)
        spans = self._spans
        if spans.recording:
            spans.record(
                SpanRecord(self._index, stream.name, op.info, op.ready, op.end, op.ran, op.cpu)
            )
