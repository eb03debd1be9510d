"""Automatic layer partitioning: choose the plan the simulator predicts to be fastest.

The public face of the partitioner: :func:`auto_plan` (candidates and search in
:mod:`.search`, packing, rules and the memory fit in :mod:`.rules`), the simulated
iteration time it scores plans by, and the trigger for a re-plan
(docs/design.md#partitioner).
"""

from __future__ import annotations

from collections.abc import Sequence

from ..core.plan import Plan, PlanError
from .rules import (  # noqa: F401 (public)
    devices_visited,
    equal_size_plans,
    fits,
    paper_greedy_plan,
    stage_footprint,
)
from .search import OBJECTIVES, Search  # noqa: F401 (OBJECTIVES: public)
from .sim.costs import CostModel, LayerCosts
from .sim.roundpipe_schedule import isolated_iteration_time, steady_iteration_time


def auto_plan(
    costs: LayerCosts | CostModel,
    num_devices: int,
    num_microbatches: int,
    memory_budgets: Sequence[int] | None = None,
    *,
    round_size: int | None = None,
    refine: bool = True,
    objective: str = "steady",
) -> Plan:
    """The plan with the lowest predicted iteration time: ``objective="steady"`` (the
    default) the steady state of asynchronous steps, where iterations overlap;
    ``"makespan"`` one isolated iteration from idle with a synchronous step, which is
    what each iteration of synchronous steps is (:func:`predict_iteration_time`).

    ``costs`` may be plain :class:`LayerCosts` (built with ``LayerCosts.from_lists``
    from per-layer forward seconds, backward seconds and parameter bytes) or a full
    :class:`CostModel` with transfer costs. The last layer ends the fused stage
    (it is the head and loss); no layer is treated specially otherwise.
    ``memory_budgets`` gives each device's usable bytes (devices may differ).
    """
    model = costs if isinstance(costs, CostModel) else CostModel(costs)
    if memory_budgets is not None and len(memory_budgets) != num_devices:
        raise ValueError(
            f"got {len(memory_budgets)} memory budgets for {num_devices} devices; give one each"
        )
    search = Search(model, num_devices, num_microbatches, memory_budgets, round_size, objective)
    best = _best_candidate(search)
    if not refine:
        return best
    refined = [search.refine(best)]
    if objective == "makespan":
        # local moves stop in a local optimum; the steady objective's best candidate (a
        # plan of even stages) is a second start, which on some models reaches a plan
        # the makespan's own candidates do not (docs/design.md#partitioner)
        steady = Search(model, num_devices, num_microbatches, memory_budgets, round_size)
        refined.append(search.refine(_best_candidate(steady)))
    return min(refined, key=search.score)


def _best_candidate(search: Search) -> Plan:
    """The best of the candidates and of every equal-size plan, unrefined."""
    best = search.best(search.candidates())
    best = search.best(search.equal_size_plans(best), incumbent=best)
    if best is None:
        raise PlanError(search.no_fit_message())
    return best


def step_objective(is_async: bool) -> str:
    """What plans for steps of this mode minimise: asynchronous steps overlap
    iterations (``"steady"``); a synchronous one makes each stand alone (``"makespan"``)."""
    return "steady" if is_async else "makespan"


def predict_iteration_time(
    plan: Plan,
    costs: LayerCosts | CostModel,
    num_devices: int,
    num_microbatches: int,
    *,
    round_size: int | None = None,
    objective: str = "steady",
) -> float:
    """Predicted seconds per iteration of ``plan``: the steady state with asynchronous
    steps (``"steady"``), or one isolated iteration until its synchronous step is done
    (``"makespan"``)."""
    model = costs if isinstance(costs, CostModel) else CostModel(costs)
    if objective not in OBJECTIVES:
        raise ValueError(f"objective must be one of {', '.join(OBJECTIVES)}, got {objective!r}")
    if objective == "makespan":
        return isolated_iteration_time(
            plan, model, num_devices, num_microbatches, round_size=round_size
        )
    return steady_iteration_time(plan, model, num_devices, num_microbatches, round_size=round_size)


def should_replan(old: LayerCosts, new: LayerCosts, threshold: float = 0.15) -> bool:
    """Whether measurements moved enough that the current plan may no longer be best.

    True when the layer count changed, or some layer's forward+backward time (or
    parameter bytes) moved by more than ``threshold`` times the average layer's.
    Noise on individual small layers does not trigger a re-plan on every call.
    """
    if old.num_layers != new.num_layers:
        return True
    old_time = [f + b for f, b in zip(old.forward, old.backward, strict=True)]
    new_time = [f + b for f, b in zip(new.forward, new.backward, strict=True)]
    return _moved(old_time, new_time, threshold) or _moved(
        old.param_bytes, new.param_bytes, threshold
    )


def _moved(old: Sequence[float], new: Sequence[float], threshold: float) -> bool:
    mean = sum(old) / len(old) if old else 0.0
    if mean == 0:
        return any(n != 0 for n in new)
    return max(abs(n - o) for o, n in zip(old, new, strict=True)) > threshold * mean
