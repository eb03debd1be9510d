"""The automatic plan against hand-tuned ones on 50 randomised profiles (about 20 s on
two cores).

For each profile of ``roundpipe.planning.sim.profiles`` (fixed seeds) the automatic plan's
simulated steady-state iteration time must not exceed the paper's greedy rule's, nor
the best plan with equal-size stages (every fused size and stage size, searched
exhaustively: a plan whose lower bound, cheap or job-level, is not below the automatic
plan's time cannot beat it, so it is not simulated).
"""

from __future__ import annotations

import pytest

from roundpipe.planning.partition import (
    auto_plan,
    equal_size_plans,
    paper_greedy_plan,
    predict_iteration_time,
)
from roundpipe.planning.sim.bounds import PlanBounds
from roundpipe.planning.sim.profiles import random_profile


@pytest.mark.parametrize("seed", range(50))
def test_the_automatic_plan_against_hand_tuned_ones(seed: int) -> None:
    profile = random_profile(seed)
    costs, devices, micro = profile.costs, profile.num_devices, profile.num_microbatches

    def steady(plan) -> float:
        return predict_iteration_time(plan, costs, devices, micro, round_size=micro)

    auto = steady(auto_plan(costs, devices, micro, round_size=micro))
    assert auto <= steady(paper_greedy_plan(costs.layers)) * (1 + 1e-9)
    bounds = PlanBounds(costs, devices, micro, round_size=micro)
    goal = auto * (1 - 1e-9)
    for plan in sorted(equal_size_plans(costs.layers.num_layers), key=bounds.of):
        if bounds.of(plan) >= goal:
            break
        if bounds.tight(plan) < goal:
            assert steady(plan) >= goal, f"{plan} is faster than the automatic plan"
