"""Plans for the step mode: the makespan objective (one isolated iteration with a
synchronous step) next to the steady state, the runtime planning for the mode its steps
use, and the automatic plan against the paper's plans on its four simulator cases
(``roundpipe.predict.paper_cases``; bench/README.md has the figures)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from roundpipe import RoundPipe, RoundPipeRunConfig
from roundpipe.core.plan import Plan
from roundpipe.planning.partition import auto_plan, predict_iteration_time
from roundpipe.planning.planner import AutoPlanner
from roundpipe.planning.sim.costs import CostModel, LayerCosts
from roundpipe.planning.sim.roundpipe_schedule import steady_iteration_time
from roundpipe.predict.paper_cases import paper_cases

DEVICES, MICRO = 4, 5
# seven layers and a head: asynchronous steps want a large fused stage (little
# recompute, iterations overlap), a synchronous step one layer per stage (short fill)
COSTS = CostModel(LayerCosts.uniform(7, 1e-3, 2e-3, 1e-3, 2e-3), comm=1e-4)


def _plans(costs: CostModel = COSTS, budgets=None) -> tuple[Plan, Plan]:
    return tuple(
        auto_plan(costs, DEVICES, MICRO, budgets, round_size=MICRO, objective=objective)
        for objective in ("steady", "makespan")
    )


def _time(plan: Plan, objective: str, costs: CostModel = COSTS) -> float:
    return predict_iteration_time(
        plan, costs, DEVICES, MICRO, round_size=MICRO, objective=objective
    )


@pytest.fixture(scope="module")
def cases():
    return paper_cases()


@pytest.mark.parametrize("objective", ["steady", "makespan"])
@pytest.mark.parametrize("refine", [True, False], ids=["runtime", "predictor"])
def test_the_automatic_plan_is_never_slower_than_the_papers_plans(cases, objective, refine):
    """The runtime's plan (refined) and the predictor's (unrefined), on both objectives,
    against the paper's rule and the best hand-tuned equal-size plan that fits."""
    for case in cases:
        auto = auto_plan(
            case.costs,
            case.num_devices,
            case.num_microbatches,
            list(case.budgets),
            round_size=case.num_microbatches,
            refine=refine,
            objective=objective,
        )
        for name, paper in case.paper_plans(objective).items():
            ratio = case.time(auto, objective) / case.time(paper, objective)
            assert ratio <= 1 + 1e-9, f"{case.name}: auto / {name} {paper} = {ratio:.4f}"


def test_the_two_objectives_pick_different_plans_and_each_wins_its_own():
    steady, makespan = _plans()
    assert steady != makespan
    assert _time(makespan, "makespan") < 0.9 * _time(steady, "makespan")
    assert _time(steady, "steady") < _time(makespan, "steady")


def test_the_makespan_is_the_steady_state_of_synchronous_steps():
    """Each iteration waits for the step before it, so it stands alone: one round per
    call, as the runtime plans, and a step slow enough to matter."""
    costs = CostModel(COSTS.layers, comm=1e-4, optimizer_time=4e-3)
    for plan in _plans(costs):
        isolated = _time(plan, "makespan", costs)
        sync = steady_iteration_time(plan, costs, DEVICES, MICRO, round_size=MICRO, is_async=False)
        assert sync == pytest.approx(isolated, rel=1e-9)
        assert isolated > _time(plan, "steady", costs)  # iterations overlap when async


def test_an_unknown_objective_is_refused():
    with pytest.raises(ValueError, match="objective must be one of steady, makespan"):
        auto_plan(COSTS, DEVICES, MICRO, objective="throughput")


def test_the_planner_follows_the_step_mode():
    planner = AutoPlanner(lambda chunk: COSTS, None)
    steady, makespan = _plans()
    assert planner.plan(DEVICES, MICRO, None) == steady  # before any step: asynchronous
    planner.saw_step(is_async=False)
    assert planner.plan(DEVICES, MICRO, None) == makespan
    planner.saw_step(is_async=False)
    assert planner.plan(DEVICES, MICRO, None) == makespan
    assert planner.replans == 2  # the same mode again is no change
    planner.saw_step(is_async=True)
    assert planner.current(DEVICES, MICRO, None) == steady
    assert planner.replans == 3


def _loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return ((output - target) ** 2).sum()


def test_the_runtime_plans_for_the_mode_its_steps_use():
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(8, 8) for _ in range(COSTS.layers.num_layers)])
    x, y = torch.randn(MICRO * 2, 8), torch.randn(MICRO * 2, 8)
    pinned = Plan((7,), (1, 7))
    with RoundPipe(model, devices=f"emulated:{DEVICES}") as pipe:
        pipe.planner.measure = lambda chunk: COSTS  # fixed costs: the plans are known
        steady, makespan = _plans(budgets=pipe.planner.budgets)
        optimizer = torch.optim.SGD(pipe.optim_parameters(), lr=0.01)
        assert pipe.plan == steady
        for is_async, expected in ((False, makespan), (False, makespan), (True, steady)):
            pipe.forward_backward((x,), label=y, loss_fn=_loss)
            pipe.step(optimizer.step, is_async=is_async)
            assert pipe.plan == expected
        pipe.synchronize()
        pipe.run_config = RoundPipeRunConfig(execute_plan=pinned)
        pipe.forward_backward((x,), label=y, loss_fn=_loss)
        pipe.step(optimizer.step, is_async=False)
        assert pipe.plan == pinned  # a pinned plan is never changed
