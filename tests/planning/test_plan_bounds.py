"""Lower bounds on iteration time, and the planner's use of them.

The planner skips simulating plans whose bound cannot beat the best so far, so a bound
above what the simulator would find silently loses plans: the bounds are checked
against long simulated runs of random plans. The planner must also never lose to the
rules it has as candidates (the paper's greedy packing, one layer per stage).
"""

from __future__ import annotations

import random

import pytest

from roundpipe.core.plan import Plan
from roundpipe.planning.partition import (
    auto_plan,
    equal_size_plans,
    paper_greedy_plan,
    predict_iteration_time,
)
from roundpipe.planning.sim.bounds import PlanBounds
from roundpipe.planning.sim.costs import CostModel, LayerCosts
from roundpipe.planning.sim.rounds import Config, Simulation


def _profile(rng: random.Random, layers: int) -> CostModel:
    forward = [rng.uniform(0.8, 1.2) for _ in range(layers)]
    ratio = rng.uniform(1.5, 4)
    head = rng.uniform(1, 4) * sum(forward) / layers
    upload = rng.uniform(0.1, 0.6) * sum(forward) / layers * 8
    return CostModel(
        LayerCosts(
            (*forward, head),
            (*[f * ratio for f in forward], head * ratio),
            (*[int(upload * 1e6)] * layers, int(upload * 2e6)),
        ),
        comm=rng.uniform(0, 0.2) * sum(forward) / layers,
        h2d_bandwidth=1e6,
        d2h_bandwidth=1e6,
        optimizer_time=rng.choice([0.0, rng.uniform(0, 40)]),
    )


def _random_plan(rng: random.Random, n: int) -> Plan:
    fused, size = rng.randint(1, max(1, n // 4)), rng.randint(1, 6)
    stages = []
    rest = n - fused
    while rest:
        stages.append(min(rest, rng.randint(max(1, size - 2), size + 2)))
        rest -= stages[-1]
    return Plan(tuple(stages), (fused, *stages[::-1]))


@pytest.mark.parametrize("seed", range(30))
def test_no_plan_runs_faster_than_its_bound(seed: int) -> None:
    rng = random.Random(seed)
    costs = _profile(rng, rng.randint(6, 30))
    devices, micro = rng.choice([2, 4, 8]), rng.randint(1, 16)
    round_size, is_async = rng.randint(1, micro), rng.random() < 0.8
    bounds = PlanBounds(costs, devices, micro, round_size=round_size, is_async=is_async)
    # a random plan, and a good one (close to its bounds, so a bound too high shows)
    good = auto_plan(costs, devices, micro, round_size=round_size, refine=False)
    for plan in (_random_plan(rng, costs.layers.num_layers), good):
        config = Config(plan, costs, devices, round_size, is_async, record=False)
        ends = Simulation(config).iteration_ends(micro, 21)
        long_run = (ends[-2] - ends[7]) / 12  # the last iteration has nothing behind it
        assert bounds.of(plan) <= bounds.tight(plan) <= long_run * (1 + 1e-9)
        assert bounds.floor <= bounds.fused_floor(plan.backward[0]) <= bounds.of(plan)


@pytest.mark.parametrize("seed", range(8))
def test_the_planner_never_loses_to_the_papers_rule_or_to_one_layer_per_stage(
    seed: int,
) -> None:
    rng = random.Random(100 + seed)
    costs = _profile(rng, rng.randint(8, 24))
    devices, micro = rng.choice([4, 8]), rng.randint(4, 12)
    n = costs.layers.num_layers

    def score(plan: Plan) -> float:
        return predict_iteration_time(plan, costs, devices, micro, round_size=micro)

    auto = score(auto_plan(costs, devices, micro, round_size=micro))
    assert auto <= score(paper_greedy_plan(costs.layers)) * (1 + 1e-9)
    assert auto <= score(Plan((1,) * (n - 1), (1,) * n)) * (1 + 1e-9)


def test_the_papers_rule_caps_each_stage_at_1_1_times_the_slowest_layer() -> None:
    layers = LayerCosts((1.0, 1.0, 0.5, 0.5, 1.0, 3.0), (2.0, 2.0, 1.0, 1.0, 2.0, 6.0))
    plan = paper_greedy_plan(layers)
    plan.validate(6)
    assert plan.backward[0] == 1  # the heavy head alone (9 s; the next layer adds 3)
    # forward stages stay under 1.1 x 3 s (the head's forward): 1 + 1 + 0.5 + 0.5, then 1
    assert plan.forward == (4, 1)
    assert plan.backward == (1, 4, 1)  # recompute + backward under 9.9 s, from the top


def test_equal_size_plans_cover_every_fused_and_stage_size() -> None:
    plans = list(equal_size_plans(5))
    for plan in plans:
        plan.validate(5)
    assert len(plans) == len(set(plans)) == 4 + 3 + 2 + 1
    assert Plan((2, 1), (2, 1, 2)) in plans


@pytest.mark.parametrize("devices", [2, 4, 8])
def test_the_loss_chain_bounds_a_pipeline_whose_head_dominates(devices: int) -> None:
    costs = CostModel(LayerCosts.uniform(6, 1.0, 2.0, 30.0, 60.0), comm=0.5)
    plan = Plan((2, 2, 2), (1, 2, 2, 2))
    bounds = PlanBounds(costs, devices, 8, round_size=8)
    config = Config(plan, costs, devices, 8, True, record=False)
    ends = Simulation(config).iteration_ends(8, 13)
    long_run = (ends[-2] - ends[3]) / 8
    assert bounds.of(plan) <= bounds.tight(plan) <= long_run * (1 + 1e-9)
    assert bounds.of(plan) >= 0.9 * long_run  # the head's 8 x 90 s are most of it
