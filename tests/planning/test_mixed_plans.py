"""Plans and simulations for a mixed pool: devices of different speeds (issue 35).

The oracles: a device at speed s runs each compute op in its time / s (checked op by
op in the simulated timeline), a pool of equal devices is planned and simulated
exactly as before, and the bounds the search prunes by stay below every simulated time.
"""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from roundpipe.core.plan import Plan
from roundpipe.core.schedule import lower
from roundpipe.planning.partition import auto_plan, fits, predict_iteration_time
from roundpipe.planning.planner import devices_moved
from roundpipe.planning.rules import devices_visited, equal_size
from roundpipe.planning.sim import CostModel, LayerCosts, simulate_roundpipe
from roundpipe.planning.sim.bounds import PlanBounds
from roundpipe.planning.sim.rounds import Config, Simulation
from roundpipe.planning.sim.walk import Undecided, iteration_ends


def _costs(layers: int = 24, head: float = 4e-3, **kwargs) -> CostModel:
    per_layer = LayerCosts.uniform(
        layers, 4e-3, 8e-3, head, 2 * head, layer_bytes=1 << 20, head_bytes=1 << 16
    )
    return CostModel(per_layer, h2d_bandwidth=1e10, d2h_bandwidth=1e10, **kwargs)


def _pool_share(costs: CostModel, speeds: tuple[float, ...], microbatches: int) -> float:
    """Iterations/s the devices are worth, each at its share of an equal pool of its kind."""
    n = len(speeds)
    plan = auto_plan(costs, n, microbatches, round_size=microbatches)
    equal = predict_iteration_time(plan, costs, n, microbatches, round_size=microbatches)
    return sum(s / (equal * n) for s in speeds)


def test_speeds_of_one_collapse_to_the_plain_model_and_equal_speeds_to_scaled_times():
    costs = _costs(6)
    assert costs.with_speeds([1.0] * 4) == costs
    slow = costs.with_speeds([0.5] * 4)
    assert not slow.mixed
    assert slow.layers.forward == tuple(2 * t for t in costs.layers.forward)
    assert slow.layers.param_bytes == costs.layers.param_bytes
    mixed = costs.with_speeds([1.0, 0.5])
    assert mixed.mixed
    assert mixed.layers_on(1).backward == tuple(2 * t for t in costs.layers.backward)
    assert mixed.fastest().layers == costs.layers


@pytest.mark.parametrize("speeds", [[0.0, 1.0], [-1.0, 1.0], [float("inf"), 1.0]])
def test_bad_speeds_are_refused(speeds):
    with pytest.raises(ValueError, match="finite and > 0"):
        _costs(4).with_speeds(speeds)


def test_device_costs_must_cover_every_layer():
    with pytest.raises(ValueError, match="cover 3 layers"):
        CostModel(LayerCosts.uniform(4, 1.0, 2.0), device_layers=(LayerCosts.uniform(3, 1.0, 2.0),))


def test_each_compute_op_takes_its_devices_time():
    costs = _costs(6).with_speeds([1.0, 0.25])
    plan = Plan((2, 2, 2), (1, 2, 2, 2))
    result = simulate_roundpipe(plan, costs, 2, 3, round_size=3)
    schedule = lower(plan, 2, 0)
    checked = 0
    for span in result.timeline.spans:
        if span.kind != "forward":
            continue
        job = next(j for j in schedule.jobs if str(j) == span.label.split()[0])
        expected = costs.layers_on(job.device).stage_forward(job.layers)
        assert span.end - span.start == pytest.approx(expected)
        assert job.device == span.device
        checked += 1
    assert checked == 9  # three forward jobs of three microbatches, on both devices


def test_a_placed_plan_runs_every_call_from_device_0():
    costs = _costs(6).with_speeds([1.0, 0.5, 0.5])
    rotating = Plan((3, 2), (2, 3, 2))  # 5 jobs on 3 devices: the cursor moves on
    assert lower(rotating, 3, 0).next_cursor == 2
    plan = Plan.parse("3,2|2,3,2@0")
    assert plan == Plan((3, 2), (2, 3, 2), placed=True) and str(plan) == "3,2|2,3,2@0"
    schedule = lower(plan, 3, 0)
    assert schedule.next_device == 2 and schedule.next_cursor == 0
    assert devices_visited(plan, 3) == [{j % 3} for j in range(5)]
    assert lower(plan, 3, first_device=2).devices_of() == [0, 1, 2, 0, 1]  # whatever the cursor
    result = simulate_roundpipe(plan, costs, 3, 4, round_size=2)  # two rounds
    devices = {span.label.split()[0]: span.device for span in result.timeline.spans}
    assert devices["F0@0[0:3]"] == 0 and "F0@2[0:3]" not in devices


def test_equal_devices_give_todays_plan():
    costs = _costs(12, head=8e-3)
    assert auto_plan(costs.with_speeds([1.0] * 4), 4, 5) == auto_plan(costs, 4, 5)


@pytest.mark.parametrize("speeds", [(1.0, 1.0, 0.5, 0.5), (1.0,) * 4 + (0.5,) * 4])
def test_a_mixed_plan_beats_the_equal_plan_and_reaches_the_devices_worth(speeds):
    costs = _costs(24)
    n, m = len(speeds), len(speeds) + 1
    mixed = costs.with_speeds(speeds)
    plan = auto_plan(mixed, n, m, round_size=m)
    time = predict_iteration_time(plan, mixed, n, m, round_size=m)
    equal_plan = auto_plan(costs, n, m, round_size=m)
    assert predict_iteration_time(equal_plan, mixed, n, m, round_size=m) > 1.3 * time
    assert (1 / time) / _pool_share(costs, speeds, m) >= 0.9


def test_bounds_on_a_mixed_pool_stay_below_the_simulated_time():
    mixed = _costs(12, head=8e-3).with_speeds([1.0, 0.5, 0.5, 0.25])
    bounds = PlanBounds(mixed, 4, 5, round_size=5)
    plans = [Plan((4, 4, 3), (2, 3, 3, 3, 2)), Plan((11,), (2,) + (1,) * 11)]
    for plan in [*plans, *(Plan(p.forward, p.backward, placed=True) for p in plans)]:
        assert bounds.tight(plan) <= predict_iteration_time(plan, mixed, 4, 5, round_size=5)


def test_a_stage_is_sized_for_the_memory_of_the_device_that_runs_it():
    costs = _costs(12, head=8e-3).with_speeds([1.0, 0.5])
    small, large = 5 << 20, 64 << 20  # the slow device has room for two layers' backward
    plan = auto_plan(costs, 2, 3, [large, small], round_size=3)
    assert fits(plan, costs, [large, small])
    schedule = lower(plan, 2, 0)
    for job in schedule.backward_jobs:
        if job.device == 1:
            assert len(job.layers) <= 2, plan


def test_the_planner_replans_when_one_class_moved():
    costs = _costs(6).with_speeds([1.0, 0.5])
    assert not devices_moved(costs, costs, 2)
    assert devices_moved(costs, _costs(6).with_speeds([1.0, 0.25]), 2)
    assert devices_moved(_costs(6), costs, 2)  # the pool turned out mixed


def _mixed_case(seed: int):
    """Random layer costs on 2-8 devices of two or three classes, each class's layers
    timed on their own (not proportionally), a random rotating plan and round size."""
    rng = random.Random(seed)
    n, devices, micro = rng.randint(2, 20), rng.choice([2, 3, 4, 8]), rng.randint(1, 10)
    forward = [rng.uniform(0.5, 2) for _ in range(n)]
    base = LayerCosts(
        tuple(forward),
        tuple(f * rng.uniform(1.5, 3) for f in forward),
        tuple(rng.choice([0, rng.randint(1, 10**8)]) for _ in range(n)),
    )
    classes = [base.scaled(1.0)]
    for _ in range(rng.randint(1, 2)):
        factors = [rng.uniform(1.0, 3.0) for _ in range(n)]
        classes.append(
            replace(
                base,
                forward=tuple(t * f for t, f in zip(base.forward, factors, strict=True)),
                backward=tuple(t * f * 1.1 for t, f in zip(base.backward, factors, strict=True)),
                recompute=tuple(t * f for t, f in zip(base.recompute, factors, strict=True)),
            )
        )
    costs = CostModel(
        base,
        comm=rng.choice([0.0, rng.uniform(0, 0.5)]),
        h2d_bandwidth=rng.choice([1e7, 1e9]),
        d2h_bandwidth=rng.choice([1e7, 1e9]),
        optimizer_time=rng.choice([0.0, rng.uniform(0, 20)]),
        device_layers=tuple(rng.choice(classes) for _ in range(devices)),
    )
    fused = rng.randint(1, n - 1)
    size = rng.randint(1, 4)
    plan = equal_size(n, fused, size)
    round_size = rng.randint(1, micro) if rng.random() < 0.5 else micro
    return plan, costs, devices, micro, round_size, rng.random() < 0.7


@pytest.mark.parametrize("seed", range(60))
def test_the_walk_times_each_device_as_the_engine_does(seed):
    plan, costs, devices, micro, round_size, is_async = _mixed_case(seed)
    config = Config(plan, costs, devices, round_size, is_async, record=False)
    expected = Simulation(config).iteration_ends(micro, 7)[:-1]
    try:
        walked = iteration_ends(
            plan, costs, devices, micro, 6, round_size=round_size, is_async=is_async
        )
    except Undecided:
        return  # the caller replays the graph
    assert walked == expected  # the same floats


def test_the_walk_decides_most_mixed_cases():
    decided = 0
    for seed in range(60):
        plan, costs, devices, micro, round_size, is_async = _mixed_case(seed)
        try:
            iteration_ends(plan, costs, devices, micro, 6, round_size=round_size, is_async=is_async)
            decided += 1
        except Undecided:
            pass
    assert decided >= 30
