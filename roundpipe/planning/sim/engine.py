"""The discrete-event core: ordered streams of ops with dependencies.

Every schedule (RoundPipe and the baselines) is a set of in-order queues of :class:`Op`
values, one per ``(device, stream)``, some sharing a resource (a copy engine); the engine
replays them in time order, so a schedule that could deadlock is reported instead of
mis-timed (docs/design.md#simulator).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from heapq import heappop, heappush
from typing import NamedTuple

from ...core.timeline import Span

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


@dataclass
class OpArrays:
    """Ops as parallel lists, the form :func:`replay_arrays` runs: per op its queue
    (one number per in-order stream), duration, priority, shared resource (-1: none)
    and the indices of the ops it waits for, with a lag for each (``None``: no lags)."""

    queue: list[int] = field(default_factory=list)
    duration: list[float] = field(default_factory=list)
    priority: list[int] = field(default_factory=list)
    resource: list[int] = field(default_factory=list)
    deps: list[list[int]] = field(default_factory=list)
    lags: list[list[float] | None] = field(default_factory=list)

    def add(self, queue: int, duration: float, priority: int, resource: int, deps, lags=None):
        self.queue.append(queue)
        self.duration.append(duration)
        self.priority.append(priority)
        self.resource.append(resource)
        self.deps.append(deps)
        self.lags.append(lags)
        return len(self.queue) - 1


def replay(ops: Sequence[Op]) -> Times:
    """The start time of every op, in op order (the core of :func:`run`)."""
    position = {op.key: i for i, op in enumerate(ops)}
    if len(position) != len(ops):
        raise SimulationError("two ops share a key")
    arrays = OpArrays()
    queues: dict[tuple[int, str], int] = {}
    resources: dict[Hashable, int] = {}
    for op in ops:
        deps = []
        for dep in op.deps:
            j = position.get(dep.key)
            if j is None:
                raise SimulationError(f"{op.label} depends on {dep.key!r}, which is no op")
            deps.append(j)
        resource = -1 if op.resource is None else resources.setdefault(op.resource, len(resources))
        lags = [dep.lag for dep in op.deps] if any(dep.lag for dep in op.deps) else None
        queue = queues.setdefault((op.device, op.stream), len(queues))
        arrays.add(queue, op.duration, op.priority, resource, deps, lags)
    return replay_arrays(
        arrays, lambda i: f"{ops[i].label} on device {ops[i].device}/{ops[i].stream}"
    )


def replay_arrays(ops: OpArrays, describe=str) -> Times:
    """Start times of ``ops`` (see :class:`OpArrays`); ops of a queue run in list order.

    An event loop over the queue heads whose dependencies have all ended, kept in a
    heap by ``(start, priority, order)``. A head waiting for a shared resource may
    see its start move later when another queue's op takes the resource; its heap
    entry is then stale (too early) and is re-keyed when it surfaces, so the op that
    starts is always the one with the smallest current key.
    """
    queue_of, durations, priorities = ops.queue, ops.duration, ops.priority
    resource_of, all_deps, all_lags = ops.resource, ops.deps, ops.lags
    n = len(queue_of)
    num_queues = max(queue_of, default=-1) + 1
    queues: list[list[int]] = [[] for _ in range(num_queues)]
    dependents: list[list[int]] = [[] for _ in range(n)]
    missing = [0] * n
    for i in range(n):
        queues[queue_of[i]].append(i)
        deps = all_deps[i]
        missing[i] = len(deps)
        for j in deps:
            dependents[j].append(i)
    heads = [0] * num_queues
    free = [0.0] * num_queues
    busy = [0.0] * (max(resource_of, default=-1) + 1)
    end = [0.0] * n
    ready = [0.0] * n
    start = [0.0] * n
    available = [0.0] * n
    order: list[int] = []
    heap: list[tuple[float, int, int]] = []

    def offer(i: int) -> None:
        lags = all_lags[i]
        op_ready = 0.0
        if lags is None:
            for j in all_deps[i]:
                if end[j] > op_ready:
                    op_ready = end[j]
        else:
            for j, lag in zip(all_deps[i], lags, strict=True):
                op_ready = max(op_ready, end[j] + lag)
        ready[i] = op_ready
        r = resource_of[i]
        avail = free[queue_of[i]]
        if r >= 0 and busy[r] > avail:
            avail = busy[r]
        heappush(heap, (avail if avail > op_ready else op_ready, priorities[i], i))

    for queue in queues:
        if queue and missing[queue[0]] == 0:
            offer(queue[0])
    for _ in range(n):
        while True:
            if not heap:
                raise SimulationError(_deadlock_message(queues, heads, missing, describe))
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


def _deadlock_message(queues, heads, missing, describe) -> str:
    blocked = []
    for q, queue in enumerate(queues):
        if heads[q] < len(queue):
            head = queue[heads[q]]
            blocked.append(f"{describe(head)} waits for {missing[head]} ops")
    return "the schedule deadlocks: " + "; ".join(blocked[:6])
