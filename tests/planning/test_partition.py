"""The automatic partitioner: valid plans, memory budgets, beating hand plans and 1F1B."""

from __future__ import annotations

import pytest

from roundpipe.core.plan import Plan, PlanError
from roundpipe.planning.partition import (
    auto_plan,
    devices_visited,
    fits,
    predict_iteration_time,
    should_replan,
    stage_footprint,
)
from roundpipe.planning.sim import CostModel, LayerCosts, simulate_baseline

DEVICES, MICROBATCHES = 8, 8


def _uneven_with_heavy_head() -> CostModel:
    """24 layers, every third one 1.6x heavier, and an LM head worth ~4 layers."""
    forward = [1e-3 * (1.6 if i % 3 == 2 else 1.0) for i in range(24)] + [4e-3]
    backward = [2 * f for f in forward[:-1]] + [8e-3]
    return CostModel(LayerCosts(tuple(forward), tuple(backward)), comm=0.1e-3)


HAND_PLANS = {
    "three forward layers per backward layer": Plan((3,) * 8, (1,) + (1,) * 24),
    "one layer fused with the head": Plan((4,) * 5 + (3,), (2,) + (1,) * 23),
    "two-layer backward stages": Plan((6,) * 4, (1,) + (2,) * 12),
    "three-layer backward stages": Plan((9, 9, 6), (1,) + (3,) * 8),
}


def test_auto_plan_is_valid_and_ends_with_a_fused_stage() -> None:
    costs = _uneven_with_heavy_head()
    plan = auto_plan(costs, DEVICES, MICROBATCHES)
    assert plan.validate(25) is plan
    assert plan.fused_layers >= 1


@pytest.mark.parametrize("name", sorted(HAND_PLANS))
def test_auto_plan_is_no_worse_than_a_hand_tuned_plan(name: str) -> None:
    costs = _uneven_with_heavy_head()
    auto = predict_iteration_time(auto_plan(costs, DEVICES, MICROBATCHES), costs, 8, 8)
    hand = predict_iteration_time(HAND_PLANS[name], costs, DEVICES, MICROBATCHES)
    assert auto <= hand * (1 + 1e-9)


def test_auto_plan_is_far_ahead_of_the_best_balanced_1f1b() -> None:
    costs = _uneven_with_heavy_head()
    auto = predict_iteration_time(auto_plan(costs, DEVICES, MICROBATCHES), costs, 8, 8)
    one_f_one_b = simulate_baseline("1f1b", costs, DEVICES, MICROBATCHES)  # balanced stages
    assert auto < 0.7 * one_f_one_b.iteration_time


def test_auto_plan_from_plain_runtime_lists_treats_layers_generically() -> None:
    costs = LayerCosts.from_lists([1.0, 1.0, 1.0, 1.0, 2.0], [2.0, 2.0, 2.0, 2.0, 4.0], [10] * 5)
    plan = auto_plan(costs, num_devices=2, num_microbatches=3)
    assert plan.validate(5) is plan


def test_auto_plan_respects_each_stage_fitting_half_a_budget() -> None:
    layers = LayerCosts.uniform(12, 1.0, 2.0, 3.0, 6.0, layer_bytes=100, head_bytes=300)
    costs = CostModel(layers)
    budgets = [1300] * 4  # a backward stage holds weights + grads: at most 3 layers
    plan = auto_plan(costs, 4, 4, budgets)
    assert fits(plan, costs, budgets)
    for layers_range in plan.backward_ranges():
        assert stage_footprint(costs, layers_range, backward=True) <= 650


def test_auto_plan_names_the_layer_that_cannot_fit() -> None:
    costs = CostModel(LayerCosts.uniform(4, 1.0, 2.0, layer_bytes=1000))
    with pytest.raises(PlanError, match="layer 0 alone needs 2000 bytes"):
        auto_plan(costs, 2, 2, [1000, 1000])


def test_auto_plan_rejects_a_budget_list_of_the_wrong_length() -> None:
    with pytest.raises(ValueError, match="2 memory budgets for 3 devices"):
        auto_plan(LayerCosts.uniform(4, 1.0, 2.0), 3, 3, [10, 10])


def test_jobs_stay_on_one_device_when_the_job_count_is_a_multiple_of_the_pool() -> None:
    assert devices_visited(Plan((2,), (1, 1, 1)), 4) == [{0}, {1}, {2}, {3}]
    assert devices_visited(Plan((2,), (1, 1)), 4)[0] == {0, 1, 2, 3}


def test_a_big_stage_may_use_the_big_device_it_is_pinned_to() -> None:
    costs = CostModel(LayerCosts.uniform(3, 1.0, 2.0, layer_bytes=100))
    plan = Plan((1, 1), (1, 1, 1))  # five jobs on five devices: each stays put
    assert fits(plan, costs, [1000, 1000, 1000, 400, 1000])
    assert not fits(plan, costs, [1000, 1000, 1000, 399, 1000])


def test_should_replan_ignores_small_noise() -> None:
    old = LayerCosts.from_lists([1.0] * 8, [2.0] * 8, [100] * 8)
    new = LayerCosts.from_lists([1.05] * 8, [2.1] * 8, [100] * 8)
    assert not should_replan(old, new)


def test_should_replan_when_one_layer_moves_materially() -> None:
    old = LayerCosts.from_lists([1.0] * 8, [2.0] * 8)
    new = LayerCosts.from_lists([1.0] * 7 + [2.0], [2.0] * 7 + [4.0])
    assert should_replan(old, new)


def test_should_replan_when_the_layer_count_changes() -> None:
    assert should_replan(LayerCosts.uniform(4, 1.0, 2.0), LayerCosts.uniform(5, 1.0, 2.0))
