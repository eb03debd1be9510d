"""The discrete-event core: ordered streams of ops with dependencies.

Every schedule (RoundPipe and the baselines) is expressed the same way: each
``(device, stream)`` pair is an in-order queue of :class:`Op` values, and an op
starts when its stream is free and every dependency has ended (plus a lag, e.g.
the activation's transfer time). Queues may share a *resource* (``Op.resource``):
two streams whose copies go through one copy engine. A resource runs one op at a
time; when several queues' heads wait for it, the one that can start first goes,
ties broken by ``Op.priority`` (lower first), then by order in the op list. The
engine replays the queues in time order, so a schedule that could deadlock is
reported instead of mis-timed.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from heapq import heappop, heappush
from typing import NamedTuple

from ..timeline import Span

COMPUTE = "compute"
H2D = "h2d"
ACT_H2D = "h2d_act"
D2H = "d2h"
OPTIMIZER = "optimizer"


class SimulationError(RuntimeError):
    """A schedule cannot be replayed (e.g. its per-stream orders deadlock)."""


class Dep(NamedTuple):
    """Wait for op ``key`` to end, plus ``lag`` seconds.

    The lag is data in flight (an activation hop), so waiting for it counts as
    exposed communication; ``transfer`` marks a dependency on a transfer op (a
    weight upload), whose whole wait counts as exposed communication.
    """

    key: Hashable
    lag: float = 0.0
    transfer: bool = False


class Op(NamedTuple):
    key: Hashable
    device: int
    stream: str
    kind: str
    label: str
    duration: float
    deps: tuple[Dep, ...] = ()
    resource: Hashable | None = None
    """Shared with other queues (e.g. a device's host-to-device copy engine); None: its own."""
    priority: int = 0


class Timing(NamedTuple):
    start: float
    end: float
    exposed_transfer: float
    """How much later the op started than it would have with free transfers."""
    ready: float = 0.0
    """When its dependencies were met (a transfer that took no time would end here)."""


def run(ops: Sequence[Op]) -> dict[Hashable, Timing]:
    """Time every op; ops on the same ``(device, stream)`` run in the given order."""
    times = replay(ops)
    timings: dict[Hashable, Timing] = {}
    for i in times.order:  # every op after those it waits for
        op, start = ops[i], times.start[i]
        ready, without_transfers = 0.0, times.available[i]
        for dep in op.deps:
            timing = timings[dep.key]
            ready = max(ready, timing.end + dep.lag)
            # a transfer that took no time would have ended when it was ready to start
            without_transfers = max(without_transfers, timing.ready if dep.transfer else timing.end)
        timings[op.key] = Timing(
            start, start + op.duration, max(0.0, start - without_transfers), ready
        )
    return timings


@dataclass(frozen=True)
class Times:
    """Start times of the ops of :func:`replay`, in op order, and when each op's stream
    (and shared resource) became free for it."""

    start: list[float]
    available: list[float]
    order: list[int]
    """Op indices in the order they started."""


def replay(ops: Sequence[Op]) -> Times:
    """The start time of every op, in op order (the core of :func:`run`).

    An event loop over the queue heads whose dependencies have all ended, kept in a
    heap by ``(start, priority, order)``. A head waiting for a shared resource may
    see its start move later when another queue's op takes the resource; its heap
    entry is then stale (too early) and is re-keyed when it surfaces, so the op that
    starts is always the one with the smallest current key.
    """
    n = len(ops)
    position = {op.key: i for i, op in enumerate(ops)}
    if len(position) != n:
        raise SimulationError("two ops share a key")
    queue_ids: dict[tuple[int, str], int] = {}
    queues: list[list[int]] = []
    queue_of = [0] * n
    dependents: list[list[int]] = [[] for _ in range(n)]
    missing = [0] * n
    resources: dict[Hashable, int] = {}
    resource_of = [-1] * n
    for i, op in enumerate(ops):
        q = queue_ids.setdefault((op.device, op.stream), len(queues))
        if q == len(queues):
            queues.append([])
        queues[q].append(i)
        queue_of[i] = q
        if op.resource is not None:
            resource_of[i] = resources.setdefault(op.resource, len(resources))
        for dep in op.deps:
            j = position.get(dep.key)
            if j is None:
                raise SimulationError(f"{op.label} depends on {dep.key!r}, which is no op")
            dependents[j].append(i)
            missing[i] += 1
    durations = [op.duration for op in ops]
    priorities = [op.priority for op in ops]
    heads = [0] * len(queues)
    free = [0.0] * len(queues)
    busy = [0.0] * len(resources)
    end = [0.0] * n
    ready = [0.0] * n
    start = [0.0] * n
    available = [0.0] * n
    order: list[int] = []
    heap: list[tuple[float, int, int]] = []

    def offer(i: int) -> None:
        op_ready = 0.0
        for dep in ops[i].deps:
            op_ready = max(op_ready, end[position[dep.key]] + dep.lag)
        ready[i] = op_ready
        r = resource_of[i]
        avail = free[queue_of[i]] if r < 0 else max(free[queue_of[i]], busy[r])
        heappush(heap, (max(avail, op_ready), priorities[i], i))

    for queue in queues:
        if missing[queue[0]] == 0:
            offer(queue[0])
    for _ in range(n):
        while True:
            if not heap:
                raise SimulationError(_deadlock_message(ops, queues, heads, missing))
            key_start, priority, i = heappop(heap)
            q, r = queue_of[i], resource_of[i]
            avail = free[q] if r < 0 else max(free[q], busy[r])
            op_start = max(avail, ready[i])
            if op_start <= key_start:
                break
            heappush(heap, (op_start, priority, i))  # the resource was taken meanwhile
        start[i], available[i] = op_start, avail
        order.append(i)
        end[i] = free[q] = op_start + durations[i]
        if r >= 0:
            busy[r] = end[i]
        heads[q] += 1
        queue = queues[q]
        if heads[q] < len(queue) and missing[queue[heads[q]]] == 0:
            offer(queue[heads[q]])
        for k in dependents[i]:
            missing[k] -= 1
            if missing[k] == 0 and queues[queue_of[k]][heads[queue_of[k]]] == k:
                offer(k)
    return Times(start, available, order)


def spans(ops: Sequence[Op], timings: dict[Hashable, Timing]) -> list[Span]:
    return [
        Span(
            op.device,
            op.stream,
            op.kind,
            op.label,
            timings[op.key].start,
            timings[op.key].end,
        )
        for op in ops
    ]


def _deadlock_message(ops, queues, heads, missing) -> str:
    blocked = []
    for q, queue in enumerate(queues):
        if heads[q] < len(queue):
            op = ops[queue[heads[q]]]
            waits = missing[queue[heads[q]]]
            blocked.append(f"{op.label} on device {op.device}/{op.stream} waits for {waits} ops")
    return "the schedule deadlocks: " + "; ".join(blocked[:6])
