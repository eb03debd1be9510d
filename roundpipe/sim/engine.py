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

from ..timeline import Span

COMPUTE = "compute"
H2D = "h2d"
ACT_H2D = "h2d_act"
D2H = "d2h"
OPTIMIZER = "optimizer"


class SimulationError(RuntimeError):
    """A schedule cannot be replayed (e.g. its per-stream orders deadlock)."""


@dataclass(frozen=True)
class Dep:
    """Wait for op ``key`` to end, plus ``lag`` seconds.

    The lag is data in flight (an activation hop), so waiting for it counts as
    exposed communication; ``transfer`` marks a dependency on a transfer op (a
    weight upload), whose whole wait counts as exposed communication.
    """

    key: Hashable
    lag: float = 0.0
    transfer: bool = False


@dataclass(frozen=True)
class Op:
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


@dataclass(frozen=True)
class Timing:
    start: float
    end: float
    exposed_transfer: float
    """How much later the op started than it would have with free transfers."""
    ready: float = 0.0
    """When its dependencies were met (a transfer that took no time would end here)."""


def run(ops: Sequence[Op]) -> dict[Hashable, Timing]:
    """Time every op; ops on the same ``(device, stream)`` run in the given order."""
    queues: dict[tuple[int, str], list[tuple[int, Op]]] = {}
    for order, op in enumerate(ops):
        queues.setdefault((op.device, op.stream), []).append((order, op))
    heads = dict.fromkeys(queues, 0)
    free = dict.fromkeys(queues, 0.0)
    busy: dict[Hashable, float] = {}
    timings: dict[Hashable, Timing] = {}
    sharing: dict[Hashable, list[tuple[int, str]]] = {}
    for queue_key, queue in queues.items():
        for resource in {op.resource for _, op in queue if op.resource is not None}:
            sharing.setdefault(resource, []).append(queue_key)
    candidates: dict[tuple[int, str], tuple] = {}  # queue -> (rank, op, timing) of its head
    blocked: dict[Hashable, list[tuple[int, str]]] = {}  # missing dep -> queues waiting

    def consider(queue_key: tuple[int, str]) -> None:
        candidates.pop(queue_key, None)
        queue = queues[queue_key]
        if heads[queue_key] == len(queue):
            return
        order, op = queue[heads[queue_key]]
        missing = next((dep.key for dep in op.deps if dep.key not in timings), None)
        if missing is not None:
            blocked.setdefault(missing, []).append(queue_key)
            return
        timing = _time(op, max(free[queue_key], busy.get(op.resource, 0.0)), timings)
        candidates[queue_key] = ((timing.start, op.priority, order), op, timing)

    for queue_key in queues:
        consider(queue_key)
    for _ in range(len(ops)):
        if not candidates:
            raise SimulationError(_deadlock_message(queues, heads, timings))
        queue_key = min(candidates, key=lambda q: candidates[q][0])
        _, op, timing = candidates.pop(queue_key)
        timings[op.key] = timing
        free[queue_key] = timing.end
        heads[queue_key] += 1
        touched = {queue_key, *blocked.pop(op.key, ())}
        if op.resource is not None:
            busy[op.resource] = timing.end
            touched.update(q for q in sharing[op.resource] if q in candidates)
        for touched_key in touched:
            consider(touched_key)
    return timings


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


def _time(op: Op, stream_free: float, timings: dict[Hashable, Timing]) -> Timing:
    start = without_transfers = stream_free
    ready = 0.0
    for dep in op.deps:
        timing = timings[dep.key]
        ready = max(ready, timing.end + dep.lag)
        # a transfer that took no time would have ended when it was ready to start
        without_transfers = max(without_transfers, timing.ready if dep.transfer else timing.end)
    start = max(start, ready)
    return Timing(start, start + op.duration, max(0.0, start - without_transfers), ready)


def _deadlock_message(queues, heads, timings) -> str:
    blocked = []
    for queue_key, queue in queues.items():
        if heads[queue_key] < len(queue):
            op = queue[heads[queue_key]][1]
            missing = [d.key for d in op.deps if d.key not in timings]
            blocked.append(f"{op.label} on device {op.device}/{op.stream} waits for {missing[:3]}")
    return "the schedule deadlocks: " + "; ".join(blocked[:6])
