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
from .search import Search
from .sim.costs import CostModel, LayerCosts
from .sim.roundpipe_schedule import steady_iteration_time


def auto_plan(
    costs: LayerCosts | CostModel,
    num_devices: int,
    num_microbatches: int,
    memory_budgets: Sequence[int] | None = None,
    *,
    round_size: int | None = None,
    refine: bool = True,
) -> Plan:
    """The plan with the lowest predicted steady-state iteration time.

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
    search = Search(model, num_devices, num_microbatches, memory_budgets, round_size)
    best = search.best(search.candidates())
    best = search.best(search.equal_size_plans(best), incumbent=best)
    if best is None:
        raise PlanError(search.no_fit_message())
    return search.refine(best) if refine else best


def predict_iteration_time(
    plan: Plan,
    costs: LayerCosts | CostModel,
    num_devices: int,
    num_microbatches: int,
    *,
    round_size: int | None = None,
) -> float:
    """Predicted steady-state seconds per iteration of ``plan`` (async optimizer)."""
    model = costs if isinstance(costs, CostModel) else CostModel(costs)
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
