"""The simulator's steady-state iteration time (the planner's objective) against long runs.

``steady_iteration_time`` simulates a few warm-up iterations and averages a few more;
here the same schedules run for many iterations, and the mean of the last ones (at
least the optimizer's time per step when the optimizer is asynchronous: its backlog
may take longer than any run to bind) must agree.
"""

from __future__ import annotations

import random

import pytest

from roundpipe.core.plan import Plan
from roundpipe.planning.sim.costs import CostModel, LayerCosts
from roundpipe.planning.sim.roundpipe_schedule import steady_iteration_time
from roundpipe.planning.sim.rounds import Config, Simulation

LONG_RUN = 24


def _split(rng: random.Random, total: int, size: int) -> tuple[int, ...]:
    sizes = []
    while total:
        take = min(total, rng.randint(max(1, size - 1), size + 1))
        sizes.append(take)
        total -= take
    return tuple(sizes)


def _case(seed: int):
    rng = random.Random(seed)
    n, devices, micro = rng.randint(6, 40), rng.choice([2, 4, 8]), rng.randint(1, 16)
    forward = [rng.uniform(0.5, 2) for _ in range(n)]
    work = sum(forward) * 3 * micro / devices
    costs = CostModel(
        LayerCosts(
            tuple(forward),
            tuple(f * rng.uniform(1.5, 3) for f in forward),
            tuple(rng.randint(1, 10**8) for _ in range(n)),
        ),
        comm=rng.uniform(0, 0.3),
        h2d_bandwidth=rng.choice([1e8, 1e9]),
        d2h_bandwidth=1e9,
        optimizer_time=rng.choice([0.0, rng.uniform(0, 3) * work]),
    )
    fused = rng.randint(1, max(1, n // 3))
    size = rng.randint(1, 5)
    plan = Plan(_split(rng, n - fused, size), (fused, *_split(rng, n - fused, size)))
    return plan, costs, devices, micro, rng.randint(1, micro), rng.random() < 0.7


@pytest.mark.parametrize("seed", range(40))
def test_steady_iteration_time_agrees_with_a_long_run(seed: int) -> None:
    plan, costs, devices, micro, round_size, is_async = _case(seed)
    config = Config(plan, costs, devices, round_size, is_async, record=False)
    ends = Simulation(config).iteration_ends(micro, LONG_RUN)
    long_run = (ends[-2] - ends[-6]) / 4  # the last iteration: nothing prefetches behind it
    if is_async:
        long_run = max(long_run, costs.optimizer_time)
    steady = steady_iteration_time(
        plan, costs, devices, micro, round_size=round_size, is_async=is_async
    )
    assert steady == pytest.approx(long_run, rel=1e-3)


def test_an_optimizer_slower_than_the_devices_sets_the_asynchronous_pace() -> None:
    costs = CostModel(LayerCosts.uniform(8, 1.0, 2.0, 1.0, 2.0), optimizer_time=1000.0)
    plan = Plan((2, 2, 2), (3, 2, 2, 2))
    assert steady_iteration_time(plan, costs, 4, 4) == pytest.approx(1000.0)
    assert steady_iteration_time(plan, costs, 4, 4, is_async=False) > 1000.0
