"""Driving the emulated device pool directly, below the runtime, for the emulator tests.

:class:`Harness` (the ``harness`` fixture in ``conftest.py``) makes pools that record
spans and host-completed gates that hold a stream; :func:`drain` waits for streams and
:func:`spans` reads what ran. Every wait has a timeout so that a broken model fails
instead of hanging.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import pytest
import torch

from roundpipe.devices import EmulatedDevicePool, EmulatedOptions, OpInfo
from roundpipe.devices.emulated.stream import HostEvent

TIMEOUT_S = 10.0
MB = 1_000_000  # bandwidths are in GB/s = 1e9 bytes per second


def floats(nbytes: int) -> torch.Tensor:
    """A host tensor of ``nbytes`` bytes of float32 ones."""
    return torch.ones(nbytes // 4)


class Harness:
    """Pools and host-completed gates for one test; everything is released at teardown.

    Every pool records spans from its creation: an op's span starts when the op was
    ready (at its stream's head, waits satisfied; for a copy, before any wait for its
    engine) and ends when its modelled time is over. ``submit`` numbers the ops it
    submits in issue order, which is the ticket the pool gives them, as long as every
    op of the pool is submitted through it."""

    def __init__(self) -> None:
        self.pools: list[EmulatedDevicePool] = []
        self.gates: list[HostEvent] = []
        self.issued: dict[int, int] = {}  # id(pool) -> ops submitted so far

    def pool(self, n: int = 1, **options) -> EmulatedDevicePool:
        pool = EmulatedDevicePool(n, EmulatedOptions(**options))
        pool.start_recording()
        self.pools.append(pool)
        self.issued[id(pool)] = 0
        return pool

    def submit(self, stream, fn: Callable[[], None], label: str = "") -> int:
        """Submit ``fn`` on ``stream``; its ticket."""
        pool = stream.device.pool
        ticket = self.issued[id(pool)]
        self.issued[id(pool)] += 1
        stream.submit(fn, OpInfo("upload", label))
        return ticket

    def block(self, stream, release: HostEvent | None = None) -> HostEvent:
        """Hold ``stream`` (not its device) until the returned event is ``set()``."""
        release = release or stream.device.pool.host_event()
        self.gates.append(release)
        stream.wait(release)
        return release

    def copy(self, stream, nbytes: int, name: str = "", started=None) -> int:
        """Submit an op copying ``nbytes`` host→device on ``stream``, labelled ``name``;
        its ticket. The destination is allocated now, on the host, so the op does
        nothing but copy; ``started`` (a ``threading.Event``) is set when it starts."""
        device = stream.device
        src = floats(nbytes)
        dst = device.allocate(src, stream)

        def op() -> None:
            if started is not None:
                started.set()
            device.copy_in(dst, src, stream)

        return self.submit(stream, op, name)

    def close(self) -> None:
        for gate in self.gates:
            gate.set()
        # An executor stuck on a copy engine would hang ``close`` (it joins them).
        closer = threading.Thread(target=lambda: [pool.close() for pool in self.pools])
        closer.daemon = True
        closer.start()
        closer.join(TIMEOUT_S)
        if closer.is_alive():
            pytest.fail("an executor thread did not stop: stuck waiting for a copy engine?")


def spans(pool: EmulatedDevicePool) -> dict[str, tuple[float, float]]:
    """(start, end) of the ops run so far, by label."""
    return {span.info.label: (span.start, span.end) for span in pool.spans()}


def drain(*streams) -> None:
    """Wait (with a timeout) until everything issued on ``streams`` has run."""
    for stream in streams:
        assert stream.record().wait(TIMEOUT_S), f"stream {stream.name} did not drain"
