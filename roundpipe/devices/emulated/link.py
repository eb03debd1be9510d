"""The emulated backend's transfer model: copy engines, the host memory bus, tickets.

A GPU has one copy engine per direction, serving ready copies in issue order (stream
priorities order kernels, not copies), and all devices' copies share host DRAM's
bandwidth. Time here is *modelled* time on the ``time.perf_counter`` clock: nothing
blocks (see ``docs/design.md``, "Emulated backend").
"""

from __future__ import annotations

import itertools
import threading
import time


class Tickets:
    """Issue order across a pool: one increasing number per submitted op."""

    def __init__(self) -> None:
        # ``next`` on an itertools counter is one C call, atomic under the GIL: no lock
        self.next = itertools.count().__next__


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

    The ordering between ops is the executor's: it starts an op of a stream using this
    engine only while ``busy`` is false (it sets it for the op's lifetime), no earlier
    than ``free_at``, the lowest ticket first among the ready ones. Each copy the op
    makes is :meth:`book`\\ ed from where the op has got to (chained for several
    copies); a copy inside an op of a copy stream carries its op's ticket, any other
    copy a fresh one. The engine itself keeps the time its booked copies end.
    """

    def __init__(self, gbps: float | None, bus: HostBus) -> None:
        self._seconds_per_byte = 1.0 / (gbps * 1e9) if gbps else 0.0
        self._bus = bus
        self._lock = threading.Lock()
        self.free_at = 0.0
        """When the last copy booked on the engine ends (perf_counter seconds)."""
        self.busy = False
        """An op of a stream using this engine is in flight (set by the executor)."""
        self.served: list[int] = []  # tickets in the order they were served (for tests)
        self.record_order = False

    @property
    def modelled(self) -> bool:
        return bool(self._seconds_per_byte) or self._bus.modelled

    def book(self, nbytes: int, ticket: int, not_before: float) -> float:
        """Book a copy of ``nbytes`` that can start at ``not_before``; when it ends.

        It starts once the engine has finished every copy booked before it and ends no
        earlier than the link's and the host bus's bandwidth allow."""
        if not self.modelled:
            return not_before
        with self._lock:
            start = max(not_before, self.free_at)
            end = start + nbytes * self._seconds_per_byte
            self.free_at = end = max(end, self._bus.reserve(nbytes, start))
            if self.record_order:
                self.served.append(ticket)
            return end


def sleep_until(deadline: float) -> None:
    while (left := deadline - time.perf_counter()) > 0:
        time.sleep(left)
