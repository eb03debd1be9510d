"""Simulate RoundPipe by replaying the runtime's own lowered schedule, round by round.

One round is one ``roundpipe.core.schedule.lower(plan, N, cursor)`` job list run over
``R`` microbatches, exactly like one ``forward_backward`` call; an iteration is as many
rounds as cover its microbatches, then the host optimizer step. Also the steady-state
iteration time the partitioner minimises (docs/design.md#simulator).
"""

from __future__ import annotations

import gc
from contextlib import contextmanager

from ...core.plan import Plan
from ...core.schedule import Schedule, lower
from ...core.timeline import Timeline
from . import engine, walk
from .bounds import PlanBounds
from .costs import CostModel
from .result import SimResult, bubbles, busy_time, compute_makespan, peak_memory
from .rounds import BOOKKEEPING, Config, Simulation, round_sizes  # noqa: F401 (public)

WARMUP_ITERATIONS = 3
MEASURED_ITERATIONS = 4
"""The steady state is the mean of the iterations after the warm-up ones, in a run where
one more iteration follows (a run's last iteration ends early: nothing prefetches its
weights behind it). The cost model treats devices alike, so a cursor that moved on only
relabels the devices and iterations soon repeat, alone or in short cycles (two, three
and four iterations are seen); a test checks the estimate against long runs. The
estimate is never below the plan's bounds (``PlanBounds.tight``): a host optimizer
slower than the devices makes a backlog that grows for many iterations before it binds,
and a cycle the measured iterations cut short is seen by the job-level bound's longer
run."""


def round_schedules(
    plan: Plan, num_devices: int, num_rounds: int, first_device: int = 0
) -> list[Schedule]:
    """The lowered schedule of each round, the cursor carried from round to round (a
    placed plan's every round from device 0)."""
    schedules, cursor = [], first_device
    for _ in range(num_rounds):
        schedule = lower(plan, num_devices, cursor)
        schedules.append(schedule)
        cursor = schedule.next_cursor
    return schedules


def simulate_roundpipe(
    plan: Plan,
    costs: CostModel,
    num_devices: int,
    num_microbatches: int,
    *,
    round_size: int | None = None,
    first_device: int = 0,
    is_async: bool = True,
) -> SimResult:
    """One iteration of RoundPipe, plus its iteration time in training: the steady
    state of asynchronous steps, or (``is_async=False``) the iteration until its
    synchronous step is done, which each iteration of synchronous steps waits for."""
    plan.validate(costs.layers.num_layers)
    config = Config(plan, costs, num_devices, round_size or num_devices, is_async)
    single = Simulation(config)
    with _gc_paused():
        single.add_iterations(num_microbatches, 1, first_device)
        timings = engine.run(single.ops)
    spans = [s for s in engine.spans(single.ops, timings) if s.kind not in BOOKKEEPING]
    makespan = compute_makespan(spans)
    args = (plan, costs, num_devices, num_microbatches)
    if is_async:
        iteration_time = steady_iteration_time(*args, round_size=round_size)
    else:
        iteration_time = isolated_iteration_time(*args, round_size=round_size)
    busy = busy_time(spans)
    return SimResult(
        schedule="roundpipe",
        num_devices=num_devices,
        makespan=makespan,
        busy=busy,
        bubbles=bubbles(spans, num_devices, makespan),
        exposed_comm=single.exposed_comm(timings),
        peak_memory=tuple(peak_memory(single.memory_intervals(timings), num_devices)),
        timeline=Timeline(spans),
        iteration_time=iteration_time,
        steady_bubble_ratio=max(0.0, 1.0 - busy / (num_devices * iteration_time)),
        detail=f"plan {plan}, rounds of {config.round_size}",
    )


def steady_iteration_time(
    plan: Plan,
    costs: CostModel,
    num_devices: int,
    num_microbatches: int,
    *,
    round_size: int | None = None,
    is_async: bool = True,
) -> float:
    """Seconds per iteration once iterations follow each other (the partitioner's
    objective): :func:`steady_mean`, never below the plan's bounds."""
    round_size = round_size or num_devices
    mean = steady_mean(
        plan, costs, num_devices, num_microbatches, round_size=round_size, is_async=is_async
    )
    bounds = PlanBounds(
        costs, num_devices, num_microbatches, round_size=round_size, is_async=is_async
    )
    return max(mean, bounds.tight(plan))


def isolated_iteration_time(
    plan: Plan,
    costs: CostModel,
    num_devices: int,
    num_microbatches: int,
    *,
    round_size: int | None = None,
    stages: dict | None = None,
) -> float:
    """Seconds of one iteration from idle with a synchronous optimizer step, until its
    step is done (the makespan objective). With synchronous steps every iteration waits
    for the step before it, so this is also their steady state (the cursor only
    relabels the devices). Walked (:func:`roundpipe.planning.sim.walk.isolated_time`),
    or replayed as an op graph where the walk cannot tell; ``stages`` as in
    :func:`steady_mean`."""
    round_size = round_size or num_devices
    try:
        return walk.isolated_time(
            plan, costs, num_devices, num_microbatches, round_size=round_size, stages=stages
        )
    except walk.Undecided:
        config = Config(plan, costs, num_devices, round_size, False, record=False)
        with _gc_paused():
            return Simulation(config).isolated_end(num_microbatches)


def steady_mean(
    plan: Plan,
    costs: CostModel,
    num_devices: int,
    num_microbatches: int,
    *,
    round_size: int,
    is_async: bool = True,
    stages: dict | None = None,
) -> float:
    """The mean simulated iteration after the warm-up ones (``stages``: a cache for
    :func:`roundpipe.planning.sim.walk.stages_of`)."""
    warm, measured = WARMUP_ITERATIONS, MEASURED_ITERATIONS
    ends = iteration_ends(
        plan, costs, num_devices, num_microbatches, warm + measured, round_size, is_async, stages
    )
    return (ends[-1] - ends[warm - 1]) / measured


def iteration_ends(
    plan: Plan,
    costs: CostModel,
    num_devices: int,
    num_microbatches: int,
    iterations: int,
    round_size: int,
    is_async: bool,
    stages: dict | None = None,
) -> list[float]:
    """When the last compute op of each of ``iterations`` iterations ends, with one more
    iteration following (a run's last iteration is not in steady state: nothing
    prefetches behind it). Walked job by job (:mod:`roundpipe.planning.sim.walk`), or replayed as
    an op graph where the walk cannot tell."""
    try:
        return walk.iteration_ends(
            plan,
            costs,
            num_devices,
            num_microbatches,
            iterations,
            round_size=round_size,
            is_async=is_async,
            stages=stages,
        )
    except walk.Undecided:
        config = Config(plan, costs, num_devices, round_size, is_async, record=False)
        with _gc_paused():
            return Simulation(config).iteration_ends(num_microbatches, iterations + 1)[:-1]


@contextmanager
def _gc_paused():
    """A simulation allocates many small tuples that all stay alive until it ends, so
    the cyclic collector would only rescan them (it took half the time)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()
