"""The emulated backend's transfer model: copy engines and the host memory bus.

What a GPU does, and what this models (DESIGN.md §5):

- Each device has one copy engine per direction (host→device, device→host). An engine
  moves one copy at a time, and among the copies that are *ready* (their stream has
  reached them) it takes the one issued first. Stream priorities do not exist here:
  on CUDA they order kernels, not copies, so any priority between activation uploads
  and weight prefetch must come from the order in which the runtime issues them.
- All devices' copies go through host DRAM, whose bandwidth is shared: with eight
  GPUs on PCIe the sum of the links exceeds what memory delivers. A copy therefore
  ends no earlier than its link allows and no earlier than the shared host bus
  (served in the order copies start) allows.

Every op gets a *ticket* from the pool when it is issued; a copy inside the op
carries its op's ticket.
"""

from __future__ import annotations

import heapq
import itertools
import threading
import time


class Tickets:
    """Issue order across a pool: one increasing number per submitted op."""

    def __init__(self) -> None:
        self._counter = itertools.count()
        self._lock = threading.Lock()

    def next(self) -> int:
        with self._lock:
            return next(self._counter)


class HostBus:
    """Host-memory bandwidth shared by every copy of every device (``None``: unlimited)."""

    def __init__(self, gbps: float | None) -> None:
        self._seconds_per_byte = 1.0 / (gbps * 1e9) if gbps else 0.0
        self._lock = threading.Lock()
        self._free_at = 0.0

    @property
    def modelled(self) -> bool:
        return bool(self._seconds_per_byte)

    def reserve(self, nbytes: int, now: float) -> float:
        """Book ``nbytes`` on the bus from ``now`` on; when that share of it is done."""
        if not self._seconds_per_byte:
            return now
        with self._lock:
            start = max(now, self._free_at)
            self._free_at = start + nbytes * self._seconds_per_byte
            return self._free_at


class CopyEngine:
    """One direction of one device's link: one copy at a time, earliest-issued ready first.

    A copy is *ready* when its stream has reached it. An op holds its ticket in the
    ready set from its first copy until it ends (it may copy several tensors), and a
    stream whose op ends puts the ticket of its next op in the set at once if that op
    is already issued and nothing stands before it: on a GPU that copy is ready the
    moment the one before it finished, and wins over any later-issued copy.
    """

    def __init__(self, gbps: float | None, bus: HostBus) -> None:
        self._seconds_per_byte = 1.0 / (gbps * 1e9) if gbps else 0.0
        self._bus = bus
        self._cond = threading.Condition()
        self._busy = False
        self._ready: list[int] = []  # tickets of ready copies (a heap)
        self._held: set[int] = set()
        self.served: list[int] = []  # tickets in the order they were served (for tests)
        self.record_order = False

    @property
    def modelled(self) -> bool:
        return bool(self._seconds_per_byte) or self._bus.modelled

    def transfer(self, nbytes: int, ticket: int, held: bool) -> None:
        """Block the calling thread for the copy's modelled duration.

        ``held``: ``ticket`` belongs to an op of a stream using this engine, which holds
        it from the moment the stream reached the op until the op ends. Any other copy
        (from a compute op, or outside any op) gets a fresh ``ticket`` and is ready
        only while it waits."""
        if not self.modelled:
            return
        with self._cond:
            self._hold(ticket)
            while self._busy or self._ready[0] != ticket:
                self._cond.wait()
            self._busy = True
            if self.record_order:
                self.served.append(ticket)
        try:
            now = time.perf_counter()
            end = max(now + nbytes * self._seconds_per_byte, self._bus.reserve(nbytes, now))
            _sleep_until(end)
        finally:
            with self._cond:
                self._busy = False
                if not held:
                    self._drop(ticket)
                self._cond.notify_all()

    def op_started(self, ticket: int) -> None:
        """A stream using this engine reached the op of ``ticket``: its copies are ready."""
        if self.modelled:
            with self._cond:
                self._hold(ticket)

    def op_finished(self, ticket: int, next_ticket: int | None) -> None:
        """The op of ``ticket`` ended; ``next_ticket`` is its stream's next op if ready."""
        if not self.modelled:
            return
        with self._cond:
            self._drop(ticket)
            if next_ticket is not None:
                self._hold(next_ticket)
            self._cond.notify_all()

    def _hold(self, ticket: int) -> None:
        if ticket not in self._held:
            self._held.add(ticket)
            heapq.heappush(self._ready, ticket)

    def _drop(self, ticket: int) -> None:
        if ticket in self._held:
            self._held.discard(ticket)
            self._ready.remove(ticket)
            heapq.heapify(self._ready)


def _sleep_until(deadline: float) -> None:
    while (left := deadline - time.perf_counter()) > 0:
        time.sleep(left)
